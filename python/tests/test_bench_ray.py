"""Smoke test of the `ray` benchmark suite (`benches/suites/ray_service.py`) at tiny sizes: its
measurement runs in a child process, as `python -m benches ray` runs it, on its own local Ray
cluster on loopback, and every part of it is `correct` (each learner consumed what its
workers had acknowledged, every client's samples arrived, the restarted learner restored and
its workers resumed); the tables render. Numbers are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray suite needs the `distributed` extra")

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)

TINY = {
    "nodes": 1,
    "shards": [1, 2],
    "workers": 2,
    "batch_size": 8,
    "inflight": 32,
    "seconds": 0.3,
    "compare_seconds": 0.2,
    "compare_repeats": 1,
    "connect_clients": 8,
    "connect_procs": 2,
    "connect_threads": 2,
    "registry_calls": 20,
    "idle_seconds": 0.2,
    "spread_rounds": 4,
    "restart_workers": 1,
    "checkpoint_every": 0.3,
    "shared_memory": False,
    "model_learners": 8,
    "model_workers": 4096,
    "model_nic_gbit": 25.0,
}


def test_ray_suite_runs_on_tiny_sizes_and_checks_out(tmp_path: Path) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benches import records
    from benches.suites import ray_service

    assert set(TINY) == set(ray_service.parameters(quick=True))
    out = tmp_path / "ray.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "benches._child", ray_service.__name__, json.dumps(TINY), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text(encoding="utf-8"))["result"]
    assert result["correct"] is True, result
    assert [r["shards"] for r in result["shards"]] == [1, 2]
    assert result["shards"][1]["balance"] == [1, 1]  # two workers over two shards
    assert result["connect"]["acked"] == 8
    assert result["restart"]["generation"] == 2
    assert result["restart"]["restored"] is True
    tables = ray_service.tables({"ours": result}, TINY)
    assert len(tables) == 5
    for table in tables:
        assert table["rows"], table["title"]
        assert all(len(row) == len(table["columns"]) for row in table["rows"])
        records.render_table(table)
