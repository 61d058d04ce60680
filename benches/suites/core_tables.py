"""The core suite's output (:mod:`benches.suites.core`): the summary table it prints and
writes to ``summary.txt``, and the record tables ``docs/benchmarks.md`` shows, both from the
session's ``results.json`` document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benches import common as h
from benches.suites import core_inprocess, core_views

SIDES = ("ours", "other")
SCENARIO_NAMES = tuple(sc.name for sc in core_inprocess.SCENARIOS)
# core_tcp's rows beyond the shared scenarios: the ~196 KB nested sample over TCP and over
# same-host shared memory (ours only: id-echo 0.2.1 has no shared-memory path).
TCP_EXTRA = ("nest-tcp", "nest-shm")
OURS_ONLY = frozenset({"nest-shm"})

# --------------------------------------------------------------------------- summary table


def _summary_views(doc: dict[str, Any], add: Callable[[str], None]) -> None:
    """The ``sample()`` cost by leaf count (core_views.py), with ratios when comparing."""
    views = {s: doc["views"][s][core_views.SCENARIO] for s in SIDES if doc["views"].get(s)}
    if not views:
        return
    counts = sorted({int(n) for v in views.values() for n in v["by_leaves"]})
    add("")
    add("sample() on a complete batch, us per call, median (core_views.py: the numpy views)")
    add(
        f"{'side':<6} "
        + " ".join(f"{f'{n} leaves':>10}" for n in counts)
        + f" {'per leaf':>9} {'correct':>7}"
    )
    for s, v in views.items():
        cells = " ".join(
            h.fmt_num(v["by_leaves"].get(str(n), {}).get("us_per_call"), ".2f", 10) for n in counts
        )
        add(f"{s:<6} {cells} {h.fmt_num(v.get('us_per_extra_leaf'), '.3f', 9)} {v['correct']!s:>7}")
    if len(views) == 2:
        a, b = views["ours"]["by_leaves"], views["other"]["by_leaves"]
        cells = " ".join(
            h.fmt_ratio(
                a.get(str(n), {}).get("us_per_call"), b.get(str(n), {}).get("us_per_call"), 10
            )
            for n in counts
        )
        add(f"{'ratio':<6} {cells}")
    add("  per leaf: (most leaves - fewest) / extra leaves; view construction's share per leaf")


def summary(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    m = doc["machine"]
    interp = doc["interpreters"]
    commit = (doc.get("commit") or "unknown")[:12] + (" (+dirty)" if doc["commit_dirty"] else "")
    add(f"== echo benchmarks, {doc['started']}{' (--quick)' if doc['parameters']['quick'] else ''}")
    add(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib'] or 0:.1f} GiB, "
        f"{m['platform']}; commit {commit}"
    )
    add(f"load average before {m['loadavg_before']}, after {m.get('loadavg_after')}")
    for side in SIDES:
        if side in interp:
            i = interp[side]
            add(
                f"{side:>5}: {i['label']}: echo {i['echo_version']} from {i['echo_path']} "
                f"(Python {i['python_version']}, numpy {i['numpy']}, {i['executable']})"
            )
    lim = doc["limits"]
    add("")
    add("raw limits of this machine")
    rows: list[tuple[str, str, str]] = []
    if "memcpy" in lim:
        cache = lim.get("memcpy_cache", {}).get("gbps")
        rows.append(
            (
                "memcpy, 1 thread, 64 MiB (np.copyto)",
                f"{lim['memcpy']['gbps']:8.2f} GB/s",
                f"256 KiB, in cache: {h.fmt_num(cache, '.1f', 0).strip()} GB/s",
            )
        )
    for key, what in (("loopback_64k", "64 KiB"), ("loopback_1m", "1 MiB")):
        if key in lim:
            r = lim[key]
            after = r.get("after_gbps")
            note = "" if after is None else f"before {r['before_gbps']:.2f}, after {after:.2f}"
            rows.append((f"loopback TCP, {what} sendall", f"{r['gbps']:8.2f} GB/s", note))
    for key in ("flatten_small", "flatten_large"):
        if key in lim:
            r = lim[key]
            rows.append(
                (
                    f"optree.tree_flatten, {r['leaves']} leaves",
                    f"{r['us_per_call']:8.2f} us/call",
                    "",
                )
            )
    for what, value, note in rows:
        add(f"  {what:<38} {value:<16}{f'  ({note})' if note else ''}".rstrip())

    sides = [s for s in SIDES if doc["inprocess"].get(s)]
    both = len(sides) == 2
    if sides:
        add("")
        add("in-process: 1 producer thread submit(), main thread sample() (core_inprocess.py)")
        add(
            f"{'scenario':<8} {'side':<6} {'samples/s':>12} {'GB/s':>8} {'frac memcpy':>11} "
            f"{'sample p50 us':>13} {'p99 us':>8} {'correct':>7}"
        )
        for name in SCENARIO_NAMES:
            rs = {s: doc["inprocess"][s].get(name) for s in sides}
            for s, r in rs.items():
                if r is None:
                    continue
                ov = r["sample_overhead"]
                add(
                    f"{name:<8} {s:<6} {r['samples_per_s']:>12,.0f} {r['gbps']:>8.3f} "
                    f"{r['frac_of_memcpy']:>11.4f} {h.fmt_num(ov.get('p50_us'), '.1f', 13)} "
                    f"{h.fmt_num(ov.get('p99_us'), '.1f', 8)} {r['correct']!s:>7}"
                )
            a, b = rs.get("ours"), rs.get("other")
            if both and a and b:
                oa, ob = a["sample_overhead"], b["sample_overhead"]
                add(
                    f"{name:<8} {'ratio':<6} "
                    f"{h.fmt_ratio(a['samples_per_s'], b['samples_per_s'], 12)} "
                    f"{h.fmt_ratio(a['gbps'], b['gbps'], 8)} "
                    f"{h.fmt_ratio(a['frac_of_memcpy'], b['frac_of_memcpy'], 11)} "
                    f"{h.fmt_ratio(oa.get('p50_us'), ob.get('p50_us'), 13)} "
                    f"{h.fmt_ratio(oa.get('p99_us'), ob.get('p99_us'), 8)}"
                )
        add("  frac memcpy: of a per-leaf np.copyto of one batch (the scenario's own reference)")

    _summary_views(doc, add)

    sides = [s for s in SIDES if doc["tcp"].get(s)]
    both = len(sides) == 2
    if sides:
        add("")
        launcher = doc["parameters"].get("tcp_launcher", "process")
        who = "Ray actors" if launcher == "ray" else "processes"
        add(
            f"TCP end to end: learner + K worker {who} on 127.0.0.1, "
            f"{doc['parameters']['tcp_seconds']:g} s window per K (core_tcp.py)"
        )
        add(
            f"{'scenario':<8} {'K':>4} {'side':<6} {'samples/s':>11} {'GB/s':>7} "
            f"{'frac loop':>9} {'p50 ms':>8} {'p99 ms':>8} {'correct':>7}"
        )
        for name in SCENARIO_NAMES:
            ks = sorted({int(k) for s in sides for k in doc["tcp"][s].get(name, {})})
            for k in ks:
                rs = {s: doc["tcp"][s].get(name, {}).get(str(k)) for s in sides}
                for s, r in rs.items():
                    if r is None:
                        continue
                    add(
                        f"{name:<8} {k:>4} {s:<6} {r['samples_per_s']:>11,.0f} "
                        f"{r['gbps']:>7.3f} {h.fmt_num(r.get('frac_loopback'), '.3f', 9)} "
                        f"{h.fmt_num(r['p50_ms'], '.2f', 8)} {h.fmt_num(r['p99_ms'], '.2f', 8)} "
                        f"{r['correct']!s:>7}"
                    )
                a, b = rs.get("ours"), rs.get("other")
                if both and a and b:
                    add(
                        f"{name:<8} {k:>4} {'ratio':<6} "
                        f"{h.fmt_ratio(a['samples_per_s'], b['samples_per_s'], 11)} "
                        f"{h.fmt_ratio(a['gbps'], b['gbps'], 7)} {'':>9} "
                        f"{h.fmt_ratio(a['p50_ms'], b['p50_ms'], 8)} "
                        f"{h.fmt_ratio(a['p99_ms'], b['p99_ms'], 8)}"
                    )
        add("  frac loop: GB/s as a fraction of the raw loopback blast (64 KiB sendall) above")
    if both:
        add("  ratio: ours / other; above 1 is better for samples/s and GB/s, below 1 for times")
    failed = [s["step"] for s in doc["steps"] if s.get("rc") not in (0, 1) or s.get("skipped")]
    if failed:
        add(f"steps that did not finish: {', '.join(failed)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- record tables


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def tables(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The core suite's tables for its record (and so for docs/benchmarks.md)."""
    out: list[dict[str, Any]] = []
    lim = doc["limits"]
    rows = []
    if "memcpy" in lim:
        rows.append(["memcpy, 1 thread, 64 MiB (np.copyto)", f"{lim['memcpy']['gbps']:.2f} GB/s"])
    for key, what in (("loopback_64k", "64 KiB"), ("loopback_1m", "1 MiB")):
        if key in lim:
            rows.append([f"loopback TCP, {what} sendall", f"{lim[key]['gbps']:.2f} GB/s"])
    for key in ("flatten_small", "flatten_large"):
        if key in lim:
            r = lim[key]
            rows.append(
                [f"optree.tree_flatten, {r['leaves']} leaves", f"{r['us_per_call']:.2f} us"]
            )
    out.append(
        {"title": "Raw limits of the machine", "columns": ["what", "measured"], "rows": rows}
    )
    sides = [s for s in SIDES if doc["inprocess"].get(s)]
    rows = []
    for name in SCENARIO_NAMES:
        for s in sides:
            r = doc["inprocess"][s].get(name)
            if r is None:
                continue
            ov = r["sample_overhead"]
            rows.append(
                [
                    name,
                    doc["interpreters"][s]["label"],
                    f"{r['samples_per_s']:,.0f}",
                    f"{r['gbps']:.3f}",
                    _f(ov.get("p50_us"), ".1f"),
                    _f(ov.get("p99_us"), ".1f"),
                    str(r["correct"]),
                ]
            )
    out.append(
        {
            "title": "In-process: one producer thread submit(), the main thread sample()",
            "columns": [
                "scenario",
                "echo",
                "samples/s",
                "GB/s",
                "sample p50 us",
                "p99 us",
                "correct",
            ],
            "rows": rows,
        }
    )
    rows = []
    for s in SIDES:
        v = doc["views"].get(s, {}).get(core_views.SCENARIO)
        if v is None:
            continue
        for n, r in sorted(v["by_leaves"].items(), key=lambda kv: int(kv[0])):
            rows.append([doc["interpreters"][s]["label"], n, _f(r.get("us_per_call"), ".2f")])
    out.append(
        {
            "title": "sample() on a complete batch: building the numpy views",
            "columns": ["echo", "leaves", "us per call (median)"],
            "rows": rows,
        }
    )
    rows = []
    sides = [s for s in SIDES if doc["tcp"].get(s)]
    for name in SCENARIO_NAMES + TCP_EXTRA:
        for s in sides:
            for k, r in sorted(doc["tcp"][s].get(name, {}).items(), key=lambda kv: int(kv[0])):
                rows.append(
                    [
                        name,
                        k,
                        doc["interpreters"][s]["label"],
                        f"{r['samples_per_s']:,.0f}",
                        f"{r['gbps']:.3f}",
                        _f(r.get("frac_loopback"), ".3f"),
                        _f(r.get("p50_ms"), ".2f"),
                        _f(r.get("p99_ms"), ".2f"),
                        str(r["correct"]),
                    ]
                )
    out.append(
        {
            "title": f"TCP end to end: a learner and K worker processes on 127.0.0.1, "
            f"{doc['parameters']['tcp_seconds']:g} s per K",
            "columns": [
                "scenario",
                "K",
                "echo",
                "samples/s",
                "GB/s",
                "of loopback",
                "p50 ms",
                "p99 ms",
                "correct",
            ],
            "rows": rows,
            "notes": ["*of loopback*: GB/s as a fraction of the raw 64 KiB loopback blast above."],
        }
    )
    return out
