"""PNG plots of the core suite: TCP throughput and latency vs actor count.

``python -m benches.plots DIR/results.json [OUT_DIR]`` draws them again from a saved result;
:func:`plot_record` draws them from a core record (``benches/records/core.json``) for
``python -m benches report``, which names them in :data:`PLOTS`.

matplotlib is optional: without it :func:`plot_all` prints one line and draws nothing, and
:func:`plot_record` raises ``ImportError``. Both sides of a comparison share the axes (ours
in blue, the other interpreter in orange).
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

COLORS = {"ours": "#1f6fb4", "other": "#e07b28"}
# The plots a record can give the docs: (suite, name) -> what it shows, for the alt text.
PLOTS = {
    ("core", "tcp-throughput"): "TCP throughput vs actors",
    ("core", "tcp-latency"): "TCP latency (p50, p99) vs actors",
}


def _times(x: Any, factor: float) -> Any:
    return x * factor


def _finish(plt: Any, fig: Any, title: str, subtitle: str, path: Path) -> Path:
    fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.005, subtitle, ha="center", fontsize=8, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def machine_line(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    return f"{m.get('cpu') or 'unknown CPU'}, {m.get('cores')} cores"


def _sample_bytes(rounds: dict[str, Any]) -> int:
    """Bytes per sample of a scenario; records before ``sample_bytes`` was kept give it as
    bytes/s over samples/s."""
    r = next(iter(rounds.values()))
    if r.get("sample_bytes"):
        return int(r["sample_bytes"])
    if r.get("gbps") and r.get("samples_per_s"):
        return round(float(r["gbps"]) * 1e9 / float(r["samples_per_s"]))
    return 0


def _series(rounds: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    ks = sorted(int(k) for k in rounds)
    ys = [float(rounds[str(k)].get(key) or math.nan) for k in ks]
    return ks, ys


def _hollow_if_incorrect(
    ax: Any, rounds: dict[str, Any], key: str, color: str, marker: str
) -> None:
    """Redraws the points of rounds that were not ``correct`` with a hollow marker."""
    bad = sorted(int(k) for k, r in rounds.items() if not r.get("correct"))
    if bad:
        ys = [float(rounds[str(k)].get(key) or math.nan) for k in bad]
        ax.plot(bad, ys, marker, ls="none", mfc="white", mec=color, ms=8, mew=1.5, zorder=3)


def _any_incorrect(doc: dict[str, Any]) -> bool:
    return any(
        not r.get("correct")
        for side in doc["tcp"].values()
        for rounds in side.values()
        for r in rounds.values()
    )


def _sides(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(side, legend label) for each side that has TCP results."""
    labels = {"ours": doc["label"], "other": doc.get("compare_label") or "other"}
    return [(side, labels[side]) for side in ("ours", "other") if doc["tcp"].get(side)]


def _subtitle(doc: dict[str, Any]) -> str:
    p = doc["parameters"]
    commit = (doc.get("commit") or "unknown")[:10]
    dirty = "+dirty" if doc.get("commit_dirty") else ""
    note = "; hollow marker: round not correct (samples lost)" if _any_incorrect(doc) else ""
    return (
        f"{p['tcp_seconds']:g} s per point, {doc['started'][:10]}, commit {commit}{dirty}"
        f"{', quick' if p['quick'] else ''}{note}"
    )


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _scenarios(doc: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    sides = _sides(doc)
    names = ("small", "large", "nest-tcp", "nest-shm")
    return sides, [n for n in names if any(n in doc["tcp"][s] for s, _ in sides)]


def _axes(plt: Any, n: int) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.2), dpi=100)
    return fig, list(axes) if n > 1 else [axes]


def _ticks(ax: Any, doc: dict[str, Any], sides: list[tuple[str, str]], name: str) -> None:
    ax.set_xscale("log", base=2)
    ks_all = sorted({int(k) for s, _ in sides for k in doc["tcp"][s].get(name, {})})
    ax.set_xticks(ks_all, [str(k) for k in ks_all])
    ax.set_xlabel("actors (worker processes)")


def throughput(plt: Any, doc: dict[str, Any], path: Path) -> Path | None:
    """Samples/s received by the learner vs actor count, one panel per scenario."""
    sides, scenarios = _scenarios(doc)
    if not sides or not scenarios:
        return None
    fig, axs = _axes(plt, len(scenarios))
    for ax, name in zip(axs, scenarios, strict=True):
        sample_bytes = 0
        for side, label in sides:
            rounds = doc["tcp"][side].get(name)
            if not rounds:
                continue
            sample_bytes = _sample_bytes(rounds)
            ks, ys = _series(rounds, "samples_per_s")
            ax.plot(ks, ys, "o-", color=COLORS[side], label=label)
            _hollow_if_incorrect(ax, rounds, "samples_per_s", COLORS[side], "o")
        loop = doc["limits"].get("loopback_64k")
        if name == "large" and loop and sample_bytes:
            ref = float(loop["gbps"]) * 1e9 / sample_bytes
            ax.axhline(ref, color="0.45", ls="--", lw=1, label="raw loopback (64 KiB sendall)")
            gb = sample_bytes / 1e9
            sec = ax.secondary_yaxis(
                "right", functions=(partial(_times, factor=gb), partial(_times, factor=1 / gb))
            )
            sec.set_ylabel("GB/s")
        _ticks(ax, doc, sides, name)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("samples/s received by the learner")
        ax.set_title(f"{name} ({sample_bytes:,} B per sample)", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    title = f"echo over TCP: throughput vs actors. {machine_line(doc)}"
    return _finish(plt, fig, title, _subtitle(doc), path)


def latency(plt: Any, doc: dict[str, Any], path: Path) -> Path | None:
    """p50 and p99 of send() to sample() vs actor count, one panel per scenario."""
    sides, scenarios = _scenarios(doc)
    if not sides or not scenarios:
        return None
    fig, axs = _axes(plt, len(scenarios))
    for ax, name in zip(axs, scenarios, strict=True):
        for side, label in sides:
            rounds = doc["tcp"][side].get(name)
            if not rounds:
                continue
            ks, p50 = _series(rounds, "p50_ms")
            _, p99 = _series(rounds, "p99_ms")
            ax.plot(ks, p50, "o-", color=COLORS[side], label=f"{label} p50")
            ax.plot(ks, p99, "^--", color=COLORS[side], label=f"{label} p99", alpha=0.8)
            _hollow_if_incorrect(ax, rounds, "p50_ms", COLORS[side], "o")
            _hollow_if_incorrect(ax, rounds, "p99_ms", COLORS[side], "^")
        _ticks(ax, doc, sides, name)
        ax.set_yscale("log")
        ax.set_ylabel("send to sample() latency, ms")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    title = f"echo over TCP: latency vs actors. {machine_line(doc)}"
    return _finish(plt, fig, title, _subtitle(doc), path)


DRAW = {"tcp-throughput": throughput, "tcp-latency": latency}


def plot_all(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes ``tcp-throughput.png`` and ``tcp-latency.png`` into ``out_dir``."""
    try:
        plt = _pyplot()
    except ImportError:
        print("benches: matplotlib is not installed: no PNG plots (JSON only)")
        return []
    written = [draw(plt, doc, out_dir / f"{name}.png") for name, draw in DRAW.items()]
    return [p for p in written if p is not None]


def _from_record(record: dict[str, Any]) -> dict[str, Any]:
    """A core record in the shape of a core session's results.json, as far as plots go."""
    labels = {s: i.get("label") or s for s, i in record["interpreters"].items()}
    return {
        "tcp": record["results"]["tcp"],
        "limits": record["results"]["limits"],
        "machine": record["machine"],
        "parameters": record["parameters"],
        "started": record["started"],
        "commit": record.get("commit"),
        "commit_dirty": record.get("commit_dirty"),
        "label": labels.get("ours", "ours"),
        "compare_label": labels.get("other"),
    }


def plot_record(record: dict[str, Any], name: str, path: Path) -> Path | None:
    """Draws plot ``name`` of :data:`PLOTS` from ``record`` into ``path`` (``None``: the
    record has no data for it). Raises ``ImportError`` without matplotlib."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    return DRAW[name](plt, _from_record(record), path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m benches.plots RESULTS_JSON [OUT_DIR]", file=sys.stderr)
        return 2
    src = Path(args[0])
    doc: dict[str, Any] = json.loads(src.read_text(encoding="utf-8"))
    out = Path(args[1]) if len(args) == 2 else src.parent
    out.mkdir(parents=True, exist_ok=True)
    for path in plot_all(doc, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
