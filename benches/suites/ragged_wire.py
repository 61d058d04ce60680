"""Ragged rollouts compressed on the wire: rollouts/s of ``tcp_workers`` worker processes
sending the ``ragged`` suite's synthetic LLM rollouts (``benches/suites/ragged_data.py``) to a
FIFO learner whose ``compress=`` names the token leaves (``prompt`` and ``tokens``,
``Zstd(1)``; the ``float32`` log-probabilities stay raw), with the workers compressing them
(``wire_compression=True``, the default) or sending raw (``False``, the learner then
compresses them itself as it stores them), directly on loopback and through a relay process
that limits each direction to ``rate_mbit`` (a link between hosts; the ``compression``
suite's relay). The rounds are ``ragged_tcp``'s (the learner reads every byte of every batch
and checks each against the pool; every rollout sent is stored and handed out once); each
case runs ``repeats`` windows, the cases interleaved, and the table shows the best window of
each with the bytes a rollout took on the wire.

The token ids are uniform over a 151,936-id vocabulary (17.2 bits of entropy in 32), which
is the worst case for compression: real token streams repeat more.

Run: ``python -m benches ragged-wire [--quick]``.
"""

from __future__ import annotations

import time
from typing import Any

from benches import common as c
from benches.suites import ragged, ragged_tcp
from benches.suites.ragged_data import Rollouts

# (name, relay rate in Mbit/s or None for direct, workers compress)
CASES = (
    ("direct, raw", None, False),
    ("direct, compressed", None, True),
    ("1 Gb/s link, raw", "rate", False),
    ("1 Gb/s link, compressed", "rate", True),
)


def parameters(quick: bool) -> dict[str, Any]:
    base = ragged.parameters(quick)
    keep = ("prompt_min", "prompt_max", "completion_median", "completion_sigma")
    out: dict[str, Any] = {k: base[k] for k in keep}
    out.update(completion_max=base["completion_max"], ingest_batch=64, max_samples=10_000_000)
    if quick:
        out.update(pool=200, tcp_workers=2, tcp_warmup=0.2, tcp_seconds=0.5, repeats=1)
    else:
        out.update(pool=2_000, tcp_workers=4, tcp_warmup=0.5, tcp_seconds=3.0, repeats=3)
    out["rate_mbit"] = 1000.0
    return out


def limit_s(params: dict[str, Any]) -> float:
    per_round = float(params["tcp_warmup"]) + float(params["tcp_seconds"]) + 60.0
    return 300.0 + len(CASES) * int(params["repeats"]) * per_round


def measure(params: dict[str, Any]) -> dict[str, Any]:
    from benches.suites.ragged_child import _check_packed  # pyright: ignore[reportPrivateUsage]

    compress = _codecs()
    pool = Rollouts(params)
    fixed = ragged_tcp.fixed_payloads(pool)
    k = int(params["tcp_workers"])
    log = c.logger("ragged-wire")
    workers = ragged_tcp.Workers(k, params, limit_s(params))
    runs: dict[str, list[dict[str, Any]]] = {}
    correct = True
    try:
        workers.start()
        made = workers.collect(ragged_tcp.TIMEOUT_S + 4.0 * k)
        if any(m[0] != "made" for m in made):
            raise RuntimeError(f"a worker did not start: {made}")
        for rnd in range(int(params["repeats"])):
            order = CASES[rnd % len(CASES) :] + CASES[: rnd % len(CASES)]
            for name, relay, wire in order:
                r = ragged_tcp._round(  # pyright: ignore[reportPrivateUsage]
                    workers, "ragged", "tcp", rnd, params, pool, fixed, _check_packed, log,
                    compress=compress, wire=wire,
                    relay_mbit=None if relay is None else float(params["rate_mbit"]),
                )  # fmt: skip
                correct = correct and r["correct"]
                runs.setdefault(name, []).append(r)
    finally:
        forced = workers.stop()
    best: dict[str, Any] = {}
    for name, rs in runs.items():
        top = max(rs, key=lambda r: r["samples_per_s"])
        wire_bytes = (
            top["compressed_bytes"] / top["compressed_samples"]
            if top["compressed_samples"]
            else pool.mean_bytes()
        )
        best[name] = {
            "samples_per_s": top["samples_per_s"],
            "gb_per_s": top["gb_per_s"],
            "wire_bytes_per_sample": wire_bytes,
            # Over the whole round, every counter settled: the window's two counters are read
            # one after the other while frames go in, a frame apart at either end.
            "compressed_share": c.rate(top["compressed_total"], top["inserted_total"]),
            "worker_cpu_us_per_sample": top["worker_cpu_us_per_sample"],
            "learner_cpu_cores": top["learner_cpu_cores"],
            "spread": max(r["samples_per_s"] for r in rs)
            / max(1e-12, min(r["samples_per_s"] for r in rs)),
        }
    return {
        "pool": pool.facts(),
        "workers": k,
        "best": best,
        "runs": runs,
        "workers_forced": forced,
        "finished": time.time(),
        "correct": correct and not forced and len(best) == len(CASES),
    }


def _codecs() -> dict[str, Any]:
    import echo

    return {"prompt": echo.Zstd(1), "tokens": echo.Zstd(1)}


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "case",
        "rollouts/s",
        "raw GB/s",
        "bytes on the wire / rollout",
        "vs raw, same link",
        "worker CPU us / rollout",
        "learner cores",
        "window spread",
        "correct",
    ]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        best = r.get("best", {})
        for name, relay, _ in CASES:
            b = best.get(name)
            if b is None:
                continue
            raw = best.get(("direct" if relay is None else "1 Gb/s link") + ", raw")
            ratio = (
                b["samples_per_s"] / raw["samples_per_s"] if raw and raw["samples_per_s"] else None
            )
            rows.append(
                [
                    side,
                    name,
                    c.num(b["samples_per_s"]),
                    c.num(b["gb_per_s"], ".3f"),
                    c.num(b["wire_bytes_per_sample"]),
                    c.num(ratio, ".2f") + "x",
                    c.num(b["worker_cpu_us_per_sample"], ".1f"),
                    c.num(b["learner_cpu_cores"], ".2f"),
                    c.num(b["spread"], ".2f"),
                    "yes" if r.get("correct") else "NO",
                ]
            )
    facts = next((r["pool"] for r in results.values() if "pool" in r), {})
    return [
        {
            "title": f"Ragged rollouts compressed on the wire: {params['tcp_workers']} worker "
            f"processes, prompt and tokens Zstd(1), best of {params['repeats']} window(s) of "
            f"{params['tcp_seconds']:g} s",
            "columns": columns,
            "rows": rows,
            "notes": [
                f"Rollouts of {c.num(facts.get('mean_sample_bytes'))} bytes on average "
                "(prompt 64-512 int32 tokens, completion lognormal median 600, int32 tokens "
                "and float32 log-probabilities); token ids uniform over a 151,936-id "
                "vocabulary, the worst case for compression.",
                f"The link: a relay process on loopback limiting each direction to "
                f"{params['rate_mbit']:g} Mbit/s. Raw: the workers send raw "
                "(wire_compression=False) and the learner compresses the same leaves as it "
                "stores them.",
            ],
        }
    ]
