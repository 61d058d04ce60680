"""Smoke test of the ragged suite (`benches/suites/ragged.py`) at tiny sizes, echo alone: every
part runs in its own child and is correct (the table's payload is the rollouts' bytes, every
batch holds the rollouts it names, every submitted rollout reaches the consumer, in-process and
from two worker processes over TCP, which are ended), a peer
without a virtualenv is reported as not installed (and none is made: no network here), and
the tables render. Numbers are not checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages


def test_ragged_suite_quick_echo_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ECHO_PEERS_INSTALL", raising=False)
    from benches import records
    from benches.suites import ragged

    params = ragged.parameters(quick=True)
    assert params["install"] is False
    params.update(
        venv_root=str(tmp_path / "no-venvs"),
        pool=64,
        fill=300,
        max_size=10_000,
        max_bytes=64 << 20,
        threads=[1, 2],
        ingest_seconds=0.1,
        tcp_workers=2,
        tcp_warmup=0.1,
        tcp_seconds=0.2,
        fifo_fill=64,
        replay_fill=300,
        peer_fill=200,
        seconds=0.1,
        child_timeout=60.0,
    )
    result = ragged.measure(params)
    assert result["correct"] is True, result
    assert not (tmp_path / "no-venvs").exists()  # nothing was made
    memory = result["memory"]
    assert memory["raw_bytes"] == memory["payload_bytes"] > 0
    assert memory["stored_bytes"] >= memory["raw_bytes"]
    assert memory["padded_over_payload"] > 5
    for key in ("ragged/1", "fixed/1", "leaves/1", "ragged/2", "fixed/2", "leaves/2"):
        assert result["ingest"]["best"][key]["samples"] > 0, key
    tcp = result["tcp"]
    assert tcp["workers_forced"] == []
    for kind in ("ragged", "fixed", "leaves", "ragged_shm", "fixed_shm", "leaves_shm"):
        assert tcp["best"][kind]["samples"] > 0, kind
        (run,) = tcp["runs"][kind]
        assert run["consumed_samples"] > 0, kind
        assert run["inserted_total"] == run["sent"], kind
        assert run["path"] == ("shm" if kind.endswith("_shm") else "tcp"), kind
    for ratio in ("ratio", "ratio_shm", "ratio_leaves", "ratio_leaves_shm"):
        assert tcp[ratio] > 0, ratio
    for key in ("fifo_packed", "replay_packed", "replay_padded"):
        r = result["sample"][key]
        assert r["batches"] > 0, key
        assert r["memcpy"]["copy_gb_per_s"] > 0, key
    assert result["echo_peer"]["add_samples_per_s"] > 0
    for name in ("torchrl", "transferqueue"):
        assert result["setup"][name]["python"] is None
        assert result[name]["not_installed"] is True
    tables = ragged.tables({"ours": result}, params)
    assert len(tables) == 5
    prompt, completion = tcp["leaves_lengths"]
    leaves = f"fixed (int32[{prompt}], int32[{completion}], float32[{completion}], float32)"
    assert [row[1:3] for row in tables[2]["rows"]] == [
        ["tcp", "ragged"],
        ["tcp", f"fixed (uint8[{tcp['mean_sample_bytes']:,}])"],
        ["tcp", leaves],
        ["shm", "ragged"],
        ["shm", f"fixed (uint8[{tcp['mean_sample_bytes']:,}])"],
        ["shm", leaves],
    ]
    assert tables[4]["rows"][0][0].startswith("echo")
    assert "not installed" in tables[4]["rows"][1][1]
    for table in tables:
        assert records.render_table(table).startswith("**")


def test_ragged_wire_suite_quick() -> None:
    """The wire-compression suite at tiny sizes: every case correct (every rollout sent
    reaches the learner once, checked), the compressed cases' rollouts all arrived
    compressed and took fewer bytes, the raw ones none, and the table renders."""
    from benches.suites import ragged_wire

    params = ragged_wire.parameters(quick=True)
    params.update(pool=64, tcp_warmup=0.1, tcp_seconds=0.3)
    result = ragged_wire.measure(params)
    assert result["correct"] is True, result
    best = result["best"]
    for name, _, wire in ragged_wire.CASES:
        (run,) = result["runs"][name]
        assert run["inserted_total"] == run["sent"] > 0, name
        assert best[name]["compressed_share"] == (1.0 if wire else 0.0), name
    assert (
        best["1 Gb/s link, compressed"]["wire_bytes_per_sample"]
        < best["1 Gb/s link, raw"]["wire_bytes_per_sample"]
    )
    (table,) = ragged_wire.tables({"ours": result}, params)
    assert len(table["rows"]) == len(ragged_wire.CASES)
