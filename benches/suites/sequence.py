"""Sequence tables: batches of windows against memcpy, numpy gathers (and TorchRL's
SliceSampler where an interpreter with it is given), resident bytes per stored step, and step
inserts over TCP and shared memory against plain samples. The measurement is
``benches/suites/sequence_tables.py`` (its docstring says what each part does); this suite runs
it and keeps the numbers its tables show. Run: ``python -m benches sequence [--quick]``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from benches import common as c

# The full run: 1e6 Atari-like steps (7 GB) and 1e6 small ones, 16 TCP workers.
FULL: dict[str, Any] = {"quick": False, "extra": []}
# The quick run: small tables, a short TCP part (about 1-2 minutes on 2 cores).
QUICK: dict[str, Any] = {
    "quick": True,
    "extra": ["--steps", "100000", "--small-steps", "100000", "--alt-steps", "20000"],
}


def parameters(quick: bool) -> dict[str, Any]:
    return dict(QUICK if quick else FULL)


def limit_s(params: dict[str, Any]) -> float:
    return 600.0 if params["quick"] else 2400.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    from benches.suites import sequence_tables

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sequence.json"
        argv = (["--quick"] if params["quick"] else []) + [str(a) for a in params["extra"]]
        argv += ["--max-seconds", str(int(limit_s(params)) - 30), "--out", str(out)]
        status = sequence_tables.main(argv)
        doc = json.loads(out.read_text(encoding="utf-8"))
    results: dict[str, Any] = {"status": status, "correct": bool(doc["correct"]), "kinds": {}}
    for kind, r in doc["results"].items():
        results["kinds"][kind] = {
            "step_bytes": r["echo"].get("bytes_per_batch", 0)
            // max(1, doc["params"].get("batch_size", 64) * doc["params"].get("length", 80)),
            "steps": r["memory"].get("steps_stored"),
            "echo_gb_s": r["echo"].get("gb_per_s"),
            "echo_p50_ms": r["echo"].get("p50_ms"),
            "echo_p99_ms": r["echo"].get("p99_ms"),
            "memcpy_gb_s": r["memcpy"].get("gb_per_s"),
            "numpy_fancy_gb_s": r["numpy_fancy"].get("gb_per_s"),
            "numpy_take_gb_s": r["numpy_take"].get("gb_per_s"),
            "torchrl_gb_s": (r.get("torchrl") or {}).get("gb_per_s"),
            "bytes_per_step_ratio": r["memory"].get("ratio_to_step_bytes"),
            "alt_bytes_per_step_ratio": r["alt_window_replay"].get("ratio_to_step_bytes"),
        }
    results["tcp"] = {}
    for kind, t in doc.get("tcp", {}).items():
        if not isinstance(t, dict) or "step_bytes" not in t:
            continue
        for path in ("tcp", "shm"):
            if path in t:
                part = t[path]
                results["tcp"][f"{kind}/{path}"] = {
                    "steps_per_s": part["steps"]["per_s"],
                    "samples_per_s": part["samples"]["per_s"],
                    "ratio": part["ratio"],
                }
    return results


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    size = "quick sizes (1e5 steps)" if params["quick"] else "1e6 steps"
    gather_cols = [
        "echo",
        "step",
        "sample() GB/s",
        "p50 / p99 ms",
        "memcpy GB/s",
        "numpy fancy GB/s",
        "numpy take(out=) GB/s",
        "TorchRL GB/s",
        "bytes per stored step",
        "whole windows in a replay table",
    ]
    gather = c.failed_rows(results, len(gather_cols))
    tcp_cols = ["echo", "step / path", "steps/s", "samples/s", "steps / samples"]
    tcp = c.failed_rows(results, len(tcp_cols))
    for side, r in results.items():
        if "error" in r:
            continue
        for kind, k in r["kinds"].items():
            torchrl = k["torchrl_gb_s"]
            gather.append(
                [
                    side,
                    kind,
                    f"{k['echo_gb_s']:.1f}",
                    f"{k['echo_p50_ms']:.2f} / {k['echo_p99_ms']:.2f}",
                    f"{k['memcpy_gb_s']:.1f}",
                    f"{k['numpy_fancy_gb_s']:.1f}",
                    f"{k['numpy_take_gb_s']:.1f}",
                    "not installed" if torchrl is None else f"{torchrl:.2f}",
                    f"{k['bytes_per_step_ratio']:.2f}x",
                    f"{k['alt_bytes_per_step_ratio']:.2f}x",
                ]
            )
        for name, t in r["tcp"].items():
            tcp.append(
                [
                    side,
                    name,
                    c.num(t["steps_per_s"]),
                    c.num(t["samples_per_s"]),
                    f"{t['ratio']:.2f}",
                ]
            )
    return [
        {
            "title": f"Batches of 64 windows of 80 steps (period 40), {size}: GB/s of step bytes",
            "columns": gather_cols,
            "rows": gather,
            "notes": [
                "memcpy: np.copyto of one batch's bytes between two buffers in the same loop; "
                "numpy: the same steps in flat arrays, windows gathered per leaf",
                "bytes per stored step: resident bytes after the fill over the step's own "
                "bytes; whole windows: the same steps sent as windows of a replay table",
            ],
        },
        {
            "title": "Step inserts over TCP and shared memory against plain samples of the same "
            "step (one send() per step, a learner reading every batch)",
            "columns": tcp_cols,
            "rows": tcp,
        },
    ]
