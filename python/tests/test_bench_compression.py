"""Smoke test of the compressed-replay suite (`benches/suites/compression.py`) on the committed
Atari frames fixture, at tiny sizes: every part runs in its child processes and checks every
batch it reads against the pool, the relay holds its rate, the targets and tables come out;
without ale-py (and no cached frames) it skips with its reason; and the committed record's
tables are the ones its results render. Numbers are not judged."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages
from benches import atari_frames, records  # noqa: E402
from benches.suites import compression  # noqa: E402


def _tiny() -> dict[str, Any]:
    params = compression.parameters(quick=True)
    params.update(
        fixture=str(atari_frames.FIXTURE),
        memory_items=3000,
        memory_raw_items=600,
        chunk=64,
        items=300,
        rows=8,
        seconds=0.05,
        repeats=1,
        baseline_items=300,
        workers=1,
        wire_seconds=0.3,
        wire_warmup=0.1,
    )
    return params


@pytest.mark.timeout(180)  # eleven memory children, the relay, workers: ~25 s on 2 busy cores
def test_compression_suite_on_the_committed_fixture() -> None:
    params = _tiny()
    result = compression.measure(params)
    assert result["correct"] is True, json.dumps(result)[:2000]
    cases = {(m["game"], m["codec"], m["items"]) for m in result["memory"]}
    assert cases == {(k["game"], k["codec"], k["items"]) for k in compression._memory_cases(params)}
    for m in result["memory"]:
        assert m["correct"] is True, m
        assert m["raw_bytes"] == m["items"] * result["item_raw_bytes"]
        if m["codec"] != "none":
            assert m["compression_ratio"] > 2, m
    th = result["throughput"]
    for key in ("sample/copy", "sample/sum", "insert/submit", "insert/submit_batch"):
        for codec in compression.CODECS:
            assert th["rates"][f"{key}/{codec}"] > 0
    wire = result["wire"]
    assert wire["with_available"] is compression.wire_compression_available()
    assert {r["path"] for r in wire["rounds"]} == {p for p, _ in compression.WIRE_PATHS}
    for r in wire["rounds"]:
        assert r["correct"] is True, r
        assert r["samples_per_s"] > 0
    # The token bucket never lets more through than its rate (and a short burst).
    assert wire["blast_mb_per_s"]["relay-limited"] <= 1.15 * params["rate_mbit"] / 8
    assert len(result["targets"]) == 4 + 8 + 2
    tables = compression.tables({"ours": result}, params)
    assert [len(t["rows"]) for t in tables] == [14, 5, 4, 3, 3]
    for table in tables:
        assert "| ours |" in records.render_table(table)
    if not wire["with_available"]:
        assert compression.NOT_AVAILABLE in records.render_table(tables[-1])


def test_without_ale_py_the_suite_skips_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    real = compression.importlib.util.find_spec
    monkeypatch.setattr(
        compression.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ale_py" else real(name, *a),
    )
    params = compression.parameters(quick=True)
    params["pool_steps"] = 3  # never cached
    result = compression.measure(params)
    assert result["correct"] is True
    assert "ale-py" in result["skipped"]
    tables = compression.tables({"ours": result}, params)
    assert len(tables) == 1
    assert "skipped: ale-py" in records.render_table(tables[0])


def test_the_committed_record_renders_its_own_tables() -> None:
    record = records.load("compression")
    assert record is not None
    assert record["suite"] == "compression"
    assert record["tables"] == compression.tables(record["results"], record["parameters"])
    if not record["quick"]:
        assert record["parameters"]["memory_items"] == 1_000_000


def test_with_wire_compression_the_ratios_and_targets_come_out() -> None:
    """Rounds with wire compression sit beside those without: the committed record's rounds
    without it, with made-up rounds with it beside them, give those ratios and verdicts."""
    record = records.load("compression")
    assert record is not None
    params, res = record["parameters"], json.loads(json.dumps(record["results"]["ours"]))
    wire = res["wire"]
    wire["with_available"] = True
    wire["rounds"] = [r for r in wire["rounds"] if not r.get("wire_compression")]
    for r in list(wire["rounds"]):
        factor = 5.0 if r["path"] == "relay-limited" else 0.5
        wire["rounds"].append(
            {**r, "wire_compression": True, "samples_per_s": factor * r["samples_per_s"]}
        )
    got = {t["what"]: t for t in compression.targets(res, params)}
    relay = got[f"wire, {params['rate_mbit']:g} Mb/s relay: with / without wire compression"]
    direct = got["wire, direct loopback: with / without wire compression"]
    assert (relay["shown"], relay["met"]) == ("5.00x", True)
    assert (direct["shown"], direct["met"]) == ("0.50x", False)
    table = compression.tables({"ours": res}, params)[-1]
    assert compression.NOT_AVAILABLE not in records.render_table(table)
    assert [row[6] for row in table["rows"]] == ["0.50x", "5.00x", "0.50x"]
