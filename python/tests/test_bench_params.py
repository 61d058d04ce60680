"""Smoke test of the params suite (`benches/suites/params.py`) at tiny sizes: the fetch
part's four copies (memcpy, the loopback blast, `params()` over TCP and on a shared-memory
connection), the publish part and the latency phases run, every copy checks out, and the
tables render; then the whole suite in a child process as `python -m benches params` runs
it, with its Ray part measured where ray is installed and reported as not installed where
it is not. Numbers are not checked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages

TINY = {
    "bytes": 300_000,
    "fetches": 3,
    "repeats": 1,
    "ray_fetches": 2,
    "publishes": 3,
    "feeders": 2,
    "fetchers": [1, 2],
    "seconds": 0.5,
}


def test_params_suite_on_tiny_sizes_without_ray() -> None:
    from benches import records
    from benches.suites import params as suite

    params = {**suite.parameters(quick=True), **TINY, "ray": False}
    result = suite.measure(params)
    assert result["correct"] is True, result
    fetch = result["fetch"]
    assert fetch["paths"] == {"tcp": "tcp", "shm": "shm", "blast": "tcp"}
    for name in ("memcpy", "blast", "tcp", "shm"):
        assert fetch[name]["n"] == 3, (name, fetch[name])
        assert fetch[name]["bad"] == 0
        assert fetch[name]["gbps_best"] > 0
    assert result["publish"]["n"] == 3
    assert result["ray"] == {"status": "not measured (ray=false)"}
    latency = result["latency"]
    assert [(p["mode"], p["k"]) for p in latency["phases"]] == [
        ("quiet", 0),
        ("newest", 1),
        ("back-to-back", 1),
        ("newest", 2),
        ("back-to-back", 2),
    ]
    for phase in latency["phases"]:
        assert phase["samples"] > 0, phase
        assert phase["fetchers"] == phase["k"]  # the fetchers of its groups, all reported
        if phase["mode"] != "quiet":
            assert phase["publishes"] >= 1, phase
            assert phase["fetches"] >= phase["k"], phase  # every fetcher fetched
            assert phase["p99_rise_ms"] is not None
    assert 0 < latency["received"] <= latency["sent"]
    fetch_table, latency_table, publish_table = suite.tables({"ours": result}, params)
    assert len(fetch_table["rows"]) == 5  # the ray row says why it is missing
    assert "not measured (ray=false)" in fetch_table["rows"][-1][1]
    assert len(latency_table["rows"]) == 5
    assert len(publish_table["rows"]) == 5
    for table in (fetch_table, latency_table, publish_table):
        assert "| ours |" in records.render_table(table)


@pytest.mark.timeout(240)
def test_params_suite_in_a_child_with_its_ray_part(tmp_path: Path) -> None:
    from benches.suites import params as suite

    params = {**suite.parameters(quick=True), **TINY, "fetchers": [1], "fetch_modes": ["newest"]}
    out = tmp_path / "ours.json"
    cmd = [sys.executable, "-m", "benches._child", "benches.suites.params"]
    proc = subprocess.run([*cmd, json.dumps(params), str(out)], cwd=ROOT, timeout=220, check=False)
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert proc.returncode == 0, doc.get("error")
    result = doc["result"]
    assert result["correct"] is True, result
    ray = result["ray"]
    if importlib.util.find_spec("ray") is None:
        assert ray["status"].startswith("not installed"), ray
        return
    assert ray["status"] == "measured", ray
    assert ray["correct"] is True
    assert ray["zero_copy"] is True  # Ray hands out views into its object store
    assert ray["get"]["n"] == ray["get_copy"]["n"] == ray["put"]["n"] == 2
    fetch_table = suite.tables({"ours": result}, params)[0]
    assert any("ray.get" in row[1] and row[-1] == "yes" for row in fetch_table["rows"])
