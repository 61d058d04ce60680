"""Smoke test of the compressed-sequence suite (`benches/suites/sequence_compression.py`) on
the committed Atari frames fixture, at tiny sizes: every part runs in its child processes and
checks every window it reads against the pool, the targets and tables come out; without
ale-py (and no cached frames) it skips with its reason; and the committed record's tables are
the ones its results render. Numbers are not judged."""

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
from benches.suites import sequence_compression as suite  # noqa: E402


def _tiny() -> dict[str, Any]:
    params = suite.parameters(quick=True)
    params.update(
        fixture=str(atari_frames.FIXTURE),
        length=4,
        period=2,
        streams=4,
        batch_size=8,
        memory_steps=400,
        memory_raw_steps=200,
        steps=200,
        seconds=0.05,
        repeats=2,
    )
    return params


@pytest.mark.timeout(180)  # nine children on 2 busy cores: ~15 s
def test_sequence_compression_suite_on_the_committed_fixture() -> None:
    params = _tiny()
    result = suite.measure(params)
    assert result["correct"] is True, json.dumps(result)[:2000]
    cases = {(m["game"], m["codec"], m["steps"]) for m in result["memory"]}
    assert cases == {(k["game"], k["codec"], k["steps"]) for k in suite._memory_cases(params)}
    for m in result["memory"]:
        assert m["correct"] is True, m
        assert m["raw_bytes"] == m["steps_stored"] * result["step_raw_bytes"]
        if m["codec"] != "none":
            assert m["stored_bytes"] < m["raw_bytes"], m
    th = result["throughput"]
    for op in suite.OPS:
        for codec in suite.CODECS:
            assert th["rates"][f"{op}/{codec}"] > 0
            assert len(th["runs"][f"{op}/{codec}"]) == params["repeats"]
    assert len(result["targets"]) == 4 + 3
    tables = suite.tables({"ours": result}, params)
    assert [len(t["rows"]) for t in tables] == [7, 5, 3]
    for table in tables:
        assert "| ours |" in records.render_table(table)


def test_without_ale_py_the_suite_skips_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    real = compression.importlib.util.find_spec
    monkeypatch.setattr(
        compression.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ale_py" else real(name, *a),
    )
    params = suite.parameters(quick=True)
    params["pool_steps"] = 3  # never cached
    result = suite.measure(params)
    assert result["correct"] is True
    assert "ale-py" in result["skipped"]
    tables = suite.tables({"ours": result}, params)
    assert len(tables) == 1
    assert "skipped: ale-py" in records.render_table(tables[0])


def test_the_committed_record_renders_its_own_tables() -> None:
    record = records.load("sequence-compression")
    assert record is not None
    assert record["suite"] == "sequence-compression"
    assert record["tables"] == suite.tables(record["results"], record["parameters"])
    if not record["quick"]:
        assert record["parameters"]["memory_steps"] == 1_000_000
