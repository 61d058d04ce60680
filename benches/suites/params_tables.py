"""The tables of the ``params`` suite (:mod:`benches.suites.params`): the fetch against
memcpy, loopback TCP and ``ray.get``; the learner's ``sample()`` latency while workers
fetch; the publish latency."""

from __future__ import annotations

import statistics
from typing import Any

from benches import common as c

FETCH_COLUMNS = [
    "echo",
    "copy",
    "GB/s (best)",
    "GB/s (median)",
    "ms (median)",
    "/ memcpy",
    "/ loopback TCP",
    "target",
    "correct",
]
LATENCY_COLUMNS = [
    "echo",
    "phase",
    "fetchers",
    "publishes/s",
    "fetches (GB/s)",
    "sample() p50 ms",
    "p99 ms (range)",
    "max ms",
    "p99 rise ms (range)",
    "target: rise <= 1 ms",
    "samples/s",
    "publish() p50 / max ms",
    "correct",
]
PUBLISH_COLUMNS = ["echo", "call", "ms (median)", "ms (p99)", "ms (max)", "GB/s (median)", "n"]


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """``a`` / ``b`` of their best GB/s."""
    x, y = a.get("gbps_best"), b.get("gbps_best")
    return x / y if x and y else None


def _target(s: dict[str, Any], f: dict[str, Any], over_tcp: bool) -> str:
    """Whether ``s`` meets the issue's targets: 0.5x memcpy, and over TCP 0.6x loopback."""
    to_mem = _ratio(s, f["memcpy"]) or 0.0
    out = f"0.5x memcpy: {'met' if to_mem >= 0.5 else 'not met'}"
    if over_tcp:
        to_blast = _ratio(s, f["blast"]) or 0.0
        out += f"; 0.6x loopback: {'met' if to_blast >= 0.6 else 'not met'}"
    return out


def _fetch_rows(side: str, r: dict[str, Any]) -> list[list[str]]:
    f, ray = r["fetch"], r["ray"]
    ok = bool(f["correct"])
    copies: list[tuple[str, dict[str, Any], str, bool]] = [
        ("numpy memcpy (`np.copyto`, preallocated)", f["memcpy"], "reference", True),
        (
            "loopback TCP blast (Python sockets, `recv_into` preallocated)",
            f["blast"],
            "reference",
            not f["blast"]["bad"],
        ),
        ("`params()`, `shared_memory=False` (TCP)", f["tcp"], _target(f["tcp"], f, True), ok),
        (
            f"`params()`, `shared_memory=True` (`transport_path` {f['paths']['shm']})",
            f["shm"],
            _target(f["shm"], f, False),
            ok,
        ),
    ]
    if ray.get("status") == "measured":
        copies += [
            (
                f"`ray.get` in an actor, Ray {ray['ray_version']} (zero-copy views)",
                ray["get"],
                "-",
                ray["correct"],
            ),
            ("`ray.get` + copy into arrays of its own", ray["get_copy"], "-", ray["correct"]),
        ]
    rows = [
        [
            side,
            name,
            c.num(s.get("gbps_best"), ".2f"),
            c.num(s.get("gbps_median"), ".2f"),
            c.num(s.get("ms_median"), ".2f"),
            c.num(_ratio(s, f["memcpy"]), ".3f"),
            c.num(_ratio(s, f["blast"]), ".2f"),
            target,
            "yes" if correct else "NO",
        ]
        for name, s, target, correct in copies
    ]
    if ray.get("status") != "measured":
        rows.append([side, f"`ray.get`: {ray['status']}", *["-"] * (len(FETCH_COLUMNS) - 2)])
    return rows


def _med(phases: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(x[key]) for x in phases if x.get(key) is not None]
    return statistics.median(vals) if vals else None


def _kinds(lat: dict[str, Any], modes: list[str]) -> list[tuple[str, int]]:
    """The latency part's phases: quiet, then each fetch mode with each fetcher count."""
    return [("quiet", 0)] + [(m, k) for k in lat["fetchers"] for m in modes]


def _phases(lat: dict[str, Any], mode: str, k: int) -> list[dict[str, Any]]:
    return [x for x in lat["phases"] if x["mode"] == mode and x["k"] == k]


def _with_range(phases: list[dict[str, Any]], key: str) -> str:
    """The median of ``key`` over the repeats, and their range when there are several."""
    vals = [float(x[key]) for x in phases if x.get(key) is not None]
    if len(vals) < 2:
        return c.num(_med(phases, key), ".2f")
    return f"{statistics.median(vals):.2f} ({c.span(vals)})"


def _latency_rows(side: str, lat: dict[str, Any], modes: list[str]) -> list[list[str]]:
    rows: list[list[str]] = []
    for mode, k in _kinds(lat, modes):
        ph = _phases(lat, mode, k)
        if not ph:
            continue
        quiet = mode == "quiet"
        rise = _med(ph, "p99_rise_ms")
        worst = max((x["publish_max_ms"] or 0.0) for x in ph)
        rows.append(
            [
                side,
                "quiet: nothing published, no fetch" if quiet else f"fetching {mode}",
                str(k),
                c.num(_med(ph, "publish_hz"), ".1f"),
                f"{c.num(_med(ph, 'fetches'))} ({c.num(_med(ph, 'fetched_gbps'), '.2f')})",
                c.num(_med(ph, "sample_p50_ms"), ".3f"),
                _with_range(ph, "sample_p99_ms"),
                c.num(_med(ph, "sample_max_ms"), ".2f"),
                "-" if quiet else _with_range(ph, "p99_rise_ms"),
                "-" if quiet or rise is None else ("met" if rise <= 1.0 else "not met"),
                c.num(_med(ph, "samples_per_s")),
                "-" if quiet else f"{c.num(_med(ph, 'publish_p50_ms'), '.2f')} / {worst:.2f}",
                "yes" if lat["correct"] else "NO",
            ]
        )
    return rows


def _publish_rows(side: str, r: dict[str, Any], params: dict[str, Any]) -> list[list[str]]:
    p, ray, lat = r["publish"], r["ray"], r["latency"]
    rows = [
        [
            side,
            "`server.publish()`, nothing fetching",
            c.num(p.get("ms_median"), ".2f"),
            c.num(p.get("ms_p99"), ".2f"),
            c.num(max(p.get("ms", []), default=None), ".2f"),
            c.num(p.get("gbps_median"), ".2f"),
            str(p.get("n")),
        ]
    ]
    for mode, k in _kinds(lat, list(params["fetch_modes"]))[1:]:
        ph = [x for x in _phases(lat, mode, k) if x["publishes"]]
        p50 = _med(ph, "publish_p50_ms")
        if p50 is None:
            continue
        rows.append(
            [
                side,
                f"`server.publish()` at {params['publish_hz']:g} Hz, {k} workers fetching "
                f"{mode} (medians of the phases' p50 and p99; the worst)",
                c.num(p50, ".2f"),
                c.num(_med(ph, "publish_p99_ms"), ".2f"),
                c.num(max(x["publish_max_ms"] for x in ph), ".2f"),
                c.num(r["bytes"] / p50 / 1e6, ".2f"),
                str(sum(x["publishes"] for x in ph)),
            ]
        )
    if ray.get("status") == "measured":
        q = ray["put"]
        rows.append(
            [
                side,
                "`ray.put()` of the same pytree (for comparison)",
                c.num(q.get("ms_median"), ".2f"),
                c.num(q.get("ms_p99"), ".2f"),
                c.num(max(ray.get("put_ms", []), default=None), ".2f"),
                c.num(q.get("gbps_median"), ".2f"),
                str(q.get("n")),
            ]
        )
    return rows


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    fetch_rows = c.failed_rows(results, len(FETCH_COLUMNS))
    latency_rows = c.failed_rows(results, len(LATENCY_COLUMNS))
    publish_rows = c.failed_rows(results, len(PUBLISH_COLUMNS))
    for side, r in results.items():
        if "error" not in r:
            fetch_rows += _fetch_rows(side, r)
            latency_rows += _latency_rows(side, r["latency"], list(params["fetch_modes"]))
            publish_rows += _publish_rows(side, r, params)
    mb = params["bytes"] / 1e6
    reps = params["repeats"]
    sample = next((r["latency"]["sample_bytes"] for r in results.values() if "latency" in r), "?")
    return [
        {
            "title": f"Fetching {mb:g} MB of parameters (8 float32 leaves) on one host, "
            f"{params['fetches']} copies x {reps} repeat(s) each",
            "columns": FETCH_COLUMNS,
            "rows": fetch_rows,
            "notes": [
                "*GB/s*: 1e9 bytes/s of the best and of the median copy. *ms*: one whole "
                "copy. *params()*: a worker process's `client.params()` from the learner's "
                "server in the suite's process, into arrays of the call's own (a fresh buffer "
                "each call); every copy's sha256 checked. Over TCP the worker pulls 1 MiB "
                "chunks through its socket; on a shared-memory connection echo copies the "
                "version out of the learner's shared-memory slots. *loopback TCP blast*: a "
                "one-byte request, then the same bytes `sendall` by a Python thread of the "
                "learner's process and `recv_into` a preallocated buffer by a worker process. "
                "*ray.get*: in a Ray actor, from the object store of a local Ray instance, a "
                "fresh `ray.put` for each get; Ray hands out read-only views into the object "
                "store (no copy at all); the copy row adds `np.array` of each leaf. *ratios*: "
                "best to best. *target*: the issue's, 0.5x memcpy on the same host and, over "
                "TCP, 0.6x the loopback blast.",
            ],
        },
        {
            "title": f"The learner's sample() latency while workers fetch: FIFO, batch "
            f"{params['batch_size']}, {params['feeders']} feeder processes ({sample} B "
            f"samples), a step every {params['step_ms']:g} ms, {mb:g} MB published at "
            f"{params['publish_hz']:g} Hz, {reps} repeat(s) of {params['seconds']:g} s "
            "(medians)",
            "columns": LATENCY_COLUMNS,
            "rows": latency_rows,
            "notes": [
                "*fetching newest*: each fetcher process waits for the next version and "
                "fetches it (`params(min_version=last + 1)`); *back-to-back*: each fetches "
                "again as soon as it has a copy. *fetches*: all fetchers' whole copies in a "
                "phase, and their bytes per second. *p99 rise*: per repeat, against the same "
                "repeat's quiet phase; the issue's target is 1 ms or less. The learner "
                "publishes between its steps, so `publish()` is not in the `sample()` "
                "numbers; its own latency is in the last column.",
            ],
        },
        {
            "title": f"Publishing {mb:g} MB of parameters",
            "columns": PUBLISH_COLUMNS,
            "rows": publish_rows,
            "notes": [
                "*publish()*: each a new version of the same 8 leaves, timed in the learner "
                "(the Python-side checks and both copies: the one kept for checkpoints and "
                "the server's own). *GB/s*: the parameters' bytes over the median call.",
            ],
        },
    ]
