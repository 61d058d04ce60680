"""Smoke test of the sequence-table benchmark (`benches/suites/sequence_tables.py`) at tiny sizes:
it runs, writes its JSON record, and every result in it is `correct` (windows consecutive,
masks right, the numpy gathers and memory children sound, the tcp rounds' totals add up).
Numbers are not checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sequence_quick(tmp_path: Path) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benches.suites import sequence_tables

    out = tmp_path / "sequence.json"
    argv = ["--quick", "--steps", "4000", "--small-steps", "4000", "--alt-steps", "2000"]
    argv += ["--streams", "8", "--batch-size", "16", "--batches", "4", "--seconds", "0.5"]
    argv += ["--min-episode", "50", "--max-episode", "300", "--frame-pool", "64"]
    argv += ["--tcp-workers", "2", "--tcp-seconds", "0.3", "--tcp-warmup", "0.2"]
    argv += ["--max-seconds", "50", "--out", str(out)]
    status = sequence_tables.main(argv)
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert status == 0
    assert doc["correct"] is True
    assert set(doc["results"]) == {"atari", "small"}
    for kind, r in doc["results"].items():
        for name in ("echo", "memcpy", "numpy_fancy", "numpy_take", "memory", "alt_window_replay"):
            assert r[name]["correct"] is True, (kind, name, r[name])
        assert r["echo"]["batches"] >= 1
        assert r["echo"]["p50_ms"] > 0
        assert r["memory"]["steps_stored"] > 0
        assert r["torchrl"] == {"skipped": "no --torchrl-python given"}
    tcp = doc["tcp"]
    assert set(tcp) == {"small", "workers_started_s", "workers_forced"}
    assert tcp["workers_forced"] == []
    for path in ("tcp", "shm"):
        r = tcp["small"][path]
        assert r["correct"] is True, (path, r)
        assert r["steps"]["per_s"] > 0
        assert r["samples"]["per_s"] > 0
        assert r["ratio"] > 0
