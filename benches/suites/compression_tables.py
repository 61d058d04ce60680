"""The ``compression`` suite's targets and tables (:mod:`benches.suites.compression`): the
issue's targets with what was measured, resident memory per game, sampling and insert rates
against the uncompressed table, the Python ``zstandard`` and TorchRL baselines, and the wire
paths; rendered from a result, as ``docs/benchmarks.md`` shows them.
"""

from __future__ import annotations

import statistics
from typing import Any

from benches import common as c
from benches.suites import compression_common as cc
from benches.suites.compression_common import (
    BATCH,
    CODEC_LABELS,
    CODECS,
    GAME_NAMES,
    INSERT_TARGET,
    MEMORY_TARGET,
    SAMPLE_TARGET,
)

PY_ZSTD = "py-zstd"  # the Python zstandard loop, in the throughput process beside echo's tables
WIRE_RELAY_TARGET = 4.0  # samples/s with / without wire compression through the 1 Gb/s link
WIRE_DIRECT_TARGET = 0.8  # the same, direct loopback
NOT_AVAILABLE = "not available"


def _memory_summary(res: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Per game (and mixed): the compressed table's RSS at ``memory_items`` against the
    uncompressed one's, scaled from ``memory_raw_items``."""
    full = cc.memory_sizes(params, "items")[0]
    rows = []
    for game, codec, comp, plain in cc.memory_pairs(res, params, "items"):
        row = {"game": game, "codec": codec, "items": full}
        row["rss_bytes_per_item"] = comp["rss_bytes_per_item"]
        row["stored_bytes_per_item"] = comp["stored_bytes"] / full
        row["compression_ratio"] = comp["compression_ratio"]
        row["rss_gib"] = comp["rss_mib"] / 1024
        if plain is not None:
            row["raw_rss_bytes_per_item"] = plain["rss_bytes_per_item"]
            row["raw_rss_gib_scaled"] = plain["rss_bytes_per_item"] * full / 2**30
            row["fraction"] = comp["rss_bytes_per_item"] / plain["rss_bytes_per_item"]
        rows.append(row)
    return rows


def _ratio(th: dict[str, Any], key: str, codec: str) -> float | None:
    """The median of the paired windows' ratios; None when there are none."""
    return cc.median_or_none(cc.paired_ratios(th, key, codec))


def _ratio_cell(th: dict[str, Any], key: str, codec: str) -> str:
    rs = cc.paired_ratios(th, key, codec)
    if not rs:
        return "-"
    spread = f" ({min(rs):.2f}-{max(rs):.2f})" if len(rs) > 1 else ""
    return f"{statistics.median(rs):.2f}x{spread}"


def _wire_ratio(wire: dict[str, Any], path: str) -> float | None:
    by = {(r["path"], r["wire_compression"]): r.get("samples_per_s") for r in wire["rounds"]}
    a, b = by.get((path, True)), by.get((path, False))
    return a / b if a and b else None


def targets(res: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it is met (None: not
    measurable here)."""
    out: list[dict[str, Any]] = []
    for row in _memory_summary(res, params):
        if row["codec"] != "zstd-1" or "fraction" not in row:
            continue
        out.append(
            {
                "what": f"memory, {GAME_NAMES[row['game']]}: RSS of zstd-1 / uncompressed",
                "value": row["fraction"],
                "target": f"<= 1/{1 / MEMORY_TARGET:.0f}",
                "met": row["fraction"] <= MEMORY_TARGET,
                "shown": f"1/{1 / row['fraction']:.1f}",
            }
        )
    th = res.get("throughput", {})
    for key, codec, label in (
        ("sample/copy", "zstd-1", "sampling, copy consumer, zstd-1"),
        ("sample/copy", "lz4", "sampling, copy consumer, LZ4"),
        ("sample/sum", "zstd-1", "sampling, sum consumer, zstd-1"),
        ("sample/sum", "lz4", "sampling, sum consumer, LZ4"),
        ("insert/submit", "zstd-1", "inserts, submit, zstd-1"),
        ("insert/submit_batch", "zstd-1", f"inserts, submit_batch of {params['rows']}, zstd-1"),
        ("insert/submit", "lz4", "inserts, submit, LZ4"),
        ("insert/submit_batch", "lz4", f"inserts, submit_batch of {params['rows']}, LZ4"),
    ):
        r = _ratio(th, key, codec)
        target = SAMPLE_TARGET if key.startswith("sample") else INSERT_TARGET
        out.append(
            {
                "what": f"{label} / uncompressed",
                "value": r,
                "target": f">= {target:.2f}x",
                "met": None if r is None else r >= target,
                "shown": "-" if r is None else f"{r:.2f}x",
            }
        )
    wire = res.get("wire", {})
    for path, target, label in (
        ("relay-limited", WIRE_RELAY_TARGET, f"wire, {params['rate_mbit']:g} Mb/s relay"),
        ("direct", WIRE_DIRECT_TARGET, "wire, direct loopback"),
    ):
        r = _wire_ratio(wire, path) if wire.get("rounds") else None
        out.append(
            {
                "what": f"{label}: with / without wire compression",
                "value": r,
                "target": f">= {target:g}x",
                "met": None if r is None else r >= target,
                "shown": NOT_AVAILABLE if r is None else f"{r:.2f}x",
            }
        )
    return out


def _met(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _targets_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "target", "measured", "required", "met"]
    rows = cc.unmeasured_rows(results, len(cols))
    for side, res in cc.sides(results):
        rows += [[side, t["what"], t["shown"], t["target"], _met(t["met"])] for t in res["targets"]]
    return {
        "title": "Compressed replay: the issue's targets",
        "columns": cols,
        "rows": rows,
        "notes": [
            f"memory: RSS per item of the zstd-1 table at {params['memory_items']:,} items over "
            f"the uncompressed table's at {params['memory_raw_items']:,} (scaled linearly); "
            f"sampling and inserts: tables of {params['items']:,} mixed items; wire: samples/s "
            "with over without wire compression"
        ],
    }


def _memory_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    full, raw = int(params["memory_items"]), int(params["memory_raw_items"])
    cols = ["echo", "game", "codec", "RSS bytes/item", "stored bytes/item", "stats ratio"]
    cols += [f"RSS at {full:,} items", "uncompressed RSS bytes/item"]
    cols += [f"uncompressed at {full:,} (scaled)", "RSS fraction"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []
    pool_size = "-"
    for side, res in cc.sides(results):
        pool_size = f"{res['pool_per_game']:,}"
        for m in _memory_summary(res, params):
            rows.append(
                [
                    side,
                    GAME_NAMES[m["game"]],
                    CODEC_LABELS[m["codec"]],
                    c.num(m["rss_bytes_per_item"]),
                    c.num(m["stored_bytes_per_item"]),
                    f"{m['compression_ratio']:.1f}x",
                    f"{m['rss_gib']:.2f} GiB",
                    c.num(m.get("raw_rss_bytes_per_item")),
                    c.num(m.get("raw_rss_gib_scaled"), ".1f") + " GiB",
                    f"1/{1 / m['fraction']:.1f}" if "fraction" in m else "-",
                ]
            )
        mixed = {
            (m["codec"], m["items"]): m.get("rss_bytes_per_item")
            for m in res["memory"]
            if m["game"] == "mixed"
        }
        half, tenth = max(1, raw // 2), max(1, full // 10)
        notes.append(
            f"{side}: linear in the item count (mixed, RSS bytes/item): uncompressed "
            f"{c.num(mixed.get(('none', half)))} at {half:,} items, "
            f"{c.num(mixed.get(('none', raw)))} at {raw:,}; zstd-1 "
            f"{c.num(mixed.get(('zstd-1', tenth)))} at {tenth:,}, "
            f"{c.num(mixed.get(('zstd-1', full)))} at {full:,}"
        )
        fills = {
            (m["game"], m["codec"]): m["fill_per_s"]
            for m in res["memory"]
            if m["items"] in (raw, full) and "fill_per_s" in m
        }
        per_game = [
            GAME_NAMES[g]
            + " "
            + ", ".join(f"{CODEC_LABELS[k]} {fills[g, k]:,.0f}" for k in CODECS if (g, k) in fills)
            for g in [*params["games"], "mixed"]
        ]
        notes.append(
            f"{side}: filling the empty table, submit_batch of {params['chunk']} rows, "
            "items/s: " + "; ".join(per_game)
        )
    return {
        "title": f"Memory of replay tables of Atari steps ({pool_size} real observations per "
        "game, cycled): RSS of the child process over its baseline",
        "columns": cols,
        "rows": rows,
        "notes": [
            "RSS bytes/item: (VmRSS after filling - VmRSS before the server was built) / items; "
            "stored: stats().stored_bytes / items; RSS fraction: compressed over uncompressed "
            "RSS bytes/item",
            f"uncompressed tables measured at {raw:,} items ({raw * 28_237 / 1e9:.1f} GB raw) "
            f"and scaled linearly: {full:,} of them "
            f"({full * 28_237 / 1e9:.0f} GB) do not fit this 24 GiB machine",
            *notes,
        ],
    }


RATE_ROWS = (
    ("sample/copy", "sample(), copy obs into a preallocated array", "batches/s"),
    ("sample/sum", "sample(), obs.sum()", "batches/s"),
    ("insert/submit", "submit(), one item per call, full table", "items/s"),
    ("insert/submit_batch", "submit_batch(), {rows} rows per call, full table", "items/s"),
)


def _per_core_note(side: str, th: dict[str, Any]) -> str:
    """Obs GB/s per busy core of echo's sampling and inserts, and of the libraries alone."""
    rates, cores, ref = th["rates"], th.get("cpu_cores", {}), th.get("codec_gb_s", {})
    obs_bytes = 84 * 84 * 4

    def per_core(key: str, per_call: int) -> str:
        rate, busy = rates.get(key), cores.get(key)
        return c.num(rate * per_call / busy / 1e9 if rate and busy else None, ".2f")

    echo_part = ", ".join(
        f"{CODEC_LABELS[k]} {per_core(f'sample/copy/{k}', BATCH * obs_bytes)} / "
        f"{per_core(f'insert/submit/{k}', obs_bytes)}"
        for k in CODECS
    )
    lib_part = ", ".join(
        f"{CODEC_LABELS[k]} {c.num(ref.get(f'{k}/decompress'), '.2f')} / "
        f"{c.num(ref.get(f'{k}/compress'), '.2f')}"
        for k in ("zstd-1", "lz4")
    )
    return (
        f"{side}: obs GB/s per busy core, echo sampling (copy consumer: decompression, gather "
        f"and the consumer's copy together) / inserting (submit): {echo_part}; the codecs' "
        "libraries on one core (the Python zstandard and lz4 packages, the same "
        f"observations), decompress / compress: {lib_part if ref else '-'}"
    )


def _rates_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "operation", "unit", "uncompressed", "zstd-1", "ratio", "LZ4", "ratio"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []
    for side, res in cc.sides(results):
        th = res["throughput"]
        if "error" in th:
            rows.append([side, str(th["error"])[:120], *["-"] * (len(cols) - 2)])
            continue
        rates, cores = th["rates"], th.get("cpu_cores", {})
        others = th.get("others_cpu_cores", {})
        for key, what, unit in RATE_ROWS:
            cells = [side, what.format(rows=params["rows"]), unit]
            cells.append(c.num(rates.get(f"{key}/none")))
            for codec in ("zstd-1", "lz4"):
                cells += [c.num(rates.get(f"{key}/{codec}")), _ratio_cell(th, key, codec)]
            rows.append(cells)

        def cpu(d: dict[str, float], op: str) -> str:
            return ", ".join(
                f"{CODEC_LABELS[k]} {d[f'{op}/{k}']:.2f}" for k in CODECS if f"{op}/{k}" in d
            )

        ratio = th["compression_ratio"]
        notes.append(
            f"{side}: CPU cores (median over the windows) of this process while sampling with "
            f"the copy consumer: {cpu(cores, 'sample/copy')}; of every other process on the "
            f"machine meanwhile: {cpu(others, 'sample/copy') or '-'}; the tables' stats ratio: "
            f"zstd-1 {ratio['zstd-1']:.1f}x, LZ4 {ratio['lz4']:.1f}x"
        )
        notes.append(_per_core_note(side, th))
    return {
        "title": f"Sampling and inserts: {params['items']:,} mixed items per table, batches of "
        f"{BATCH}, median of {params['repeats']} windows of {params['seconds']:g} s each",
        "columns": cols,
        "rows": rows,
        "notes": [
            "ratio: the median over the repeats of the rate over the uncompressed table's in "
            "the window run just before or after it (the range in brackets); inserts go into "
            "the full table, each evicting the oldest (the steady state); the same consumer "
            "reads every batch of every table",
            *notes,
        ],
    }


BASE_KEYS = ("insert/submit", "insert/submit_batch", "sample/copy", "sample/sum")


def _baselines_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    full = int(params["memory_items"])
    cols = ["echo", "implementation", "items held", "RSS bytes/item"]
    cols += [f"RSS at {full:,} (scaled)", "insert 1/call, /s", f"insert {params['rows']}/call, /s"]
    cols += ["batches/s, copy", "batches/s, sum"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []

    def mem_cells(items: int, per_item: float) -> list[str]:
        return [f"{items:,}", c.num(per_item), f"{per_item * full / 2**30:.2f} GiB"]

    def baseline_row(
        side: str, label: str, result: dict[str, Any], rates: dict[str, Any], key: str
    ) -> bool:
        """Appends a baseline's row (or why it was not measured), its rates `rates[key %
        k]` for each of `BASE_KEYS`; whether it was measured."""
        if "skipped" in result or "error" in result:
            why = result.get("skipped") or result.get("error")
            rows.append([side, label, f"not measured: {why}"[:160], *["-"] * 6])
            return False
        rows.append(
            [
                side,
                label,
                *mem_cells(result["items"], result["rss_bytes_per_item"]),
                *(c.num(rates.get(key % k)) for k in BASE_KEYS),
            ]
        )
        return True

    for side, res in cc.sides(results):
        mixed = {(m["game"], m["codec"]): m for m in _memory_summary(res, params)}
        echo_mem = mixed.get(("mixed", "zstd-1"))
        rates = res["throughput"].get("rates", {})
        if echo_mem is not None:
            rows.append(
                [
                    side,
                    "echo, compress={'obs': Zstd(1)}",
                    *mem_cells(full, echo_mem["rss_bytes_per_item"]),
                    *(c.num(rates.get(f"{k}/zstd-1")) for k in BASE_KEYS),
                ]
            )
        b = res.get("zstandard", {})
        label = "Python loop: zstandard level 1, a list of bytes"
        if baseline_row(side, label, b, rates, f"%s/{PY_ZSTD}"):
            notes.append(
                f"{side}: zstandard {b['zstandard']}, one compress() per item in a Python loop "
                "(so one item or a batch per call is the same); its rates come from the "
                "throughput process, windows alternating with echo's tables on the same items"
            )
        t = res.get("torchrl", {})
        label = "TorchRL CompressedListStorage, level 1"
        if baseline_row(side, label, t, t.get("rates", {}), "%s"):
            notes.append(
                f"{side}: TorchRL {t['torchrl']} (tensordict {t['tensordict']}, torch "
                f"{t['torch']}, {t['torch_threads']} threads), its own process with "
                f"{t['items']:,} items: ReplayBuffer with a RandomSampler; inserts are add() "
                f"and extend() of {params['rows']} rows, one window of each"
            )
    return {
        "title": "Baselines: echo's zstd-1 table, a Python zstandard loop and TorchRL's "
        "CompressedListStorage (mixed items, batches of 256, the same consumers)",
        "columns": cols,
        "rows": rows,
        "notes": [
            f"RSS bytes/item measured at the items held, scaled linearly to {full:,}; rates: "
            f"echo and the zstandard loop with {params['items']:,} items each",
            *notes,
        ],
    }


WIRE_PATHS = (
    ("direct", "direct loopback"),
    ("relay-limited", "relay at {rate:g} Mb/s"),
    ("relay-unlimited", "relay, no limit"),
)


def _wire_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "path", "raw blast MB/s", "without: samples/s", "without: raw MB/s"]
    cols += ["with: samples/s", "with / without", "worker CPU us/sample (without)"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []
    for side, res in cc.sides(results):
        w = res["wire"]
        blasts = w.get("blast_mb_per_s", {})
        by = {(r["path"], r["wire_compression"]): r for r in w.get("rounds", [])}
        for path, label in WIRE_PATHS:
            off, on = by.get((path, False), {}), by.get((path, True))
            r = _wire_ratio(w, path)
            rows.append(
                [
                    side,
                    label.format(rate=w["rate_mbit"]),
                    c.num(blasts.get(path)),
                    c.num(off.get("samples_per_s")),
                    c.num(off.get("mb_per_s_raw")),
                    NOT_AVAILABLE if on is None else c.num(on.get("samples_per_s")),
                    "-" if r is None else f"{r:.2f}x",
                    c.num(off.get("worker_cpu_us"), ".1f"),
                ]
            )
        if not w["with_available"]:
            notes.append(
                f"{side}: this echo's TcpClient has no wire_compression keyword: measured "
                "without wire compression only"
            )
        failed = [r for r in w.get("rounds", []) if not r.get("correct")]
        if failed:
            notes.append(
                f"{side}: failed rounds: "
                + "; ".join(f"{r['path']}: {r.get('error')}" for r in failed)[:300]
            )
    return {
        "title": f"Wire: {params['workers']} TcpClient worker processes sending one step per "
        "send() to a zstd-1 table, directly and through a Python relay on loopback",
        "columns": cols,
        "rows": rows,
        "notes": [
            "raw blast: one connection sending 1 MiB chunks through the same path, the path's "
            "own ceiling (the relay is Python threads: its unlimited ceiling shows whether a "
            "limit is the link's or the relay's); raw MB/s: samples/s x 28,237 bytes",
            *notes,
        ],
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    return cc.suite_tables(
        results,
        params,
        _targets_table,
        _memory_table,
        _rates_table,
        _baselines_table,
        _wire_table,
    )
