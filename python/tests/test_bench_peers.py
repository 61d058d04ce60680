"""Smoke test of the peers suite (`benches/suites/peers.py`) at tiny sizes, echo alone: every
row runs in its own child and is correct, a peer without a virtualenv is reported as not
installed (and none is made: no network here), and the tables render. Numbers are not
checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages


def test_peers_suite_quick_echo_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ECHO_PEERS_INSTALL", raising=False)
    from benches import records
    from benches.suites import peers, peers_child

    params = peers.parameters(quick=True)
    assert params["install"] is False
    params.update(
        libs=["echo", "memcpy", "cpprb"],
        venv_root=str(tmp_path / "no-venvs"),
        size=2_000,
        atari_size=300,
        seq_size=2_000,
        pool=512,
        atari_pool=16,
        seconds=0.05,
        fill_seconds=1.0,
        repeats=2,
    )
    result = peers.measure(params)
    assert result["correct"] is True, result
    assert not (tmp_path / "no-venvs").exists()  # nothing was made
    assert result["setup"]["cpprb"]["python"] is None
    echo_rows = result["rows"]["echo"]
    assert set(echo_rows) == set(peers_child.ROWS)
    for row, r in echo_rows.items():
        assert r["status"] == "measured", (row, r)
        assert r["best"] > 0
        assert len(r["runs"][0]["rates"]) == 2
    assert result["rows"]["memcpy"]["atari_sample"]["best"] > 0
    assert all(r["status"] == "not installed" for r in result["rows"]["cpprb"].values())
    main, apis = peers.tables({"ours": result}, params)
    assert len(main["rows"]) == len(peers_child.ROWS)
    assert main["rows"][0][4] == "not installed"  # the cpprb column
    assert main["rows"][8][-2] != "-"  # the memcpy ceiling of the Atari sample
    assert len(apis["rows"]) == 2
    assert "| echo |" in records.render_table(apis)
