"""Smoke test of the codecs suite (`benches/suites/codecs.py`) on the committed Atari frames
fixture, at tiny sizes: every item round-trips, every leaf and codec has a row, real frames
compress and float noise does not, and the tables render. Numbers are not timed. Skips
without `zstandard` and `lz4` (the `bench` extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages


def test_codecs_suite_on_the_committed_fixture() -> None:
    pytest.importorskip("zstandard")
    pytest.importorskip("lz4")
    from benches import atari_frames, records
    from benches.suites import codecs

    params = codecs.parameters(quick=True)
    params.update(fixture=str(atari_frames.FIXTURE), chunk=4, passes=1, pass_mb=0.01)
    result = codecs.measure(params)
    assert result["correct"] is True
    rows = {(r["leaf"], r["game"], r["codec"]): r for r in result["rows"]}
    for codec in codecs.CODECS:
        for game in params["games"]:
            for leaf in codecs.ATARI_LEAVES:
                r = rows[(leaf, game, codec)]
                assert r["ratio"] > 2, (leaf, game, codec, r["ratio"])
                assert r["compress_gb_s"] > 0
                assert r["decompress_gb_s"] > 0
        for leaf in codecs.OTHER_LEAVES:
            assert (leaf, "all", codec) in rows
        assert rows[("noise-f32", "all", codec)]["ratio"] < 1.5
    assert not [k for k in rows if k[0] in codecs.NEAREST_LEAVES]  # the fixture has no such
    assert rows[("obs", "pong", "zstd-1")]["item_bytes"] == 84 * 84 * 4
    assert rows[("obs16", "pong", "zstd-1")]["item_bytes"] == 4 * 84 * 84 * 4
    tables = codecs.tables({"ours": result}, params)
    assert len(tables) == 2
    assert len(tables[0]["rows"]) == 3 * len(params["games"]) * len(codecs.ATARI_LEAVES)
    assert len(tables[1]["rows"]) == 3 * len(codecs.OTHER_LEAVES)
    for table in tables:
        assert "| ours |" in records.render_table(table)
