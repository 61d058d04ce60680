"""benches/atari_frames.py: the committed fixture (real ALE frames, a few steps per game) has
the DQN shapes and dtypes, the resize is exact area averaging, and a rollout is the same for
the same seed (those tests skip without ale-py, which is in the `bench` extra only)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # for `benches`; after the installed packages
from benches import atari_frames as af  # noqa: E402


def _area_reference(screen: np.ndarray) -> np.ndarray:
    """Area averaging as float weight matrices (the textbook form of what resize computes)."""

    def weights(n_in: int, n_out: int) -> np.ndarray:
        w = np.zeros((n_out, n_in))
        for i in range(n_out):
            for j in range(n_in):
                lo, hi = max(i * n_in, j * n_out), min((i + 1) * n_in, (j + 1) * n_out)
                w[i, j] = max(0, hi - lo)
        return w / w.sum(axis=1, keepdims=True)

    out: np.ndarray = weights(210, 84) @ screen.astype(np.float64) @ weights(160, 84).T
    return out


def test_resize_is_area_averaging_rounded() -> None:
    rng = np.random.default_rng(7)
    screens = rng.integers(0, 256, (3, 210, 160), dtype=np.uint8)
    out = af.resize(screens)
    assert out.shape == (3, 84, 84)
    assert out.dtype == np.uint8
    for screen, small in zip(screens, out, strict=True):
        assert np.abs(small.astype(np.float64) - _area_reference(screen)).max() <= 0.5 + 1e-9
    flat = np.full((210, 160), 173, np.uint8)
    assert (af.resize(flat) == 173).all()


def test_nearest_resize_keeps_rows_and_columns_and_adds_no_gray_level() -> None:
    screen = np.random.default_rng(8).integers(0, 256, (210, 160), dtype=np.uint8)
    out = af.resize_nearest(screen)
    assert out.shape == (84, 84)
    assert out.dtype == np.uint8
    assert out[0, 0] == screen[0, 0]
    assert out[1, 1] == screen[2, 1]  # row 1 * 2.5, column 1 * 1.9, rounded down
    assert out[83, 83] == screen[207, 158]
    assert set(np.unique(out)) <= set(np.unique(screen))


def test_committed_fixture_has_the_dqn_shapes() -> None:
    games, meta = af.load(af.FIXTURE)
    assert af.FIXTURE.stat().st_size < 8 * 1024
    assert set(games) == set(af.GAMES) == set(meta["games"])
    for game, arrays in games.items():
        frames, starts = arrays["frames"], arrays["episode_start"]
        assert frames.shape == (meta["steps"], 84, 84), game
        assert frames.dtype == np.uint8
        assert starts.dtype == np.bool_
        assert starts[0]
        assert frames.std() > 0, f"{game}: a blank screen"
        obs = af.observations(frames, starts)
        assert obs.shape == (meta["steps"], 84, 84, 4)
        assert obs.dtype == np.uint8
        assert obs.flags.c_contiguous
        assert (obs[..., -1] == frames).all()  # the newest frame last
        assert all((obs[0, :, :, k] == frames[0]).all() for k in range(4))  # episode start


def test_observations_repeat_the_first_frame_after_an_episode_start() -> None:
    frames = np.arange(6, dtype=np.uint8)[:, None, None] * np.ones((1, 84, 84), np.uint8)
    starts = np.array([True, False, False, False, True, False])
    newest_to_oldest = af.observations(frames, starts)[:, 0, 0, :]
    assert newest_to_oldest.tolist() == [
        [0, 0, 0, 0],
        [0, 0, 0, 1],
        [0, 0, 1, 2],
        [0, 1, 2, 3],
        [4, 4, 4, 4],
        [4, 4, 4, 5],
    ]


def test_a_rollout_is_the_same_for_the_same_seed() -> None:
    pytest.importorskip("ale_py")
    a = af.rollout("breakout", 60, seed=3)
    b = af.rollout("breakout", 60, seed=3)
    c = af.rollout("breakout", 60, seed=4)
    assert a["frames"].shape == (60, 84, 84)
    assert a["frames"].dtype == np.uint8
    assert np.array_equal(a["frames"], b["frames"])
    assert np.array_equal(a["episode_start"], b["episode_start"])
    assert not np.array_equal(a["frames"], c["frames"])


def test_the_generator_writes_the_committed_fixture_byte_for_byte(tmp_path: Path) -> None:
    pytest.importorskip("ale_py")
    _, meta = af.load(af.FIXTURE)
    if meta["ale_py"] != af._ale_version():
        pytest.skip(f"the fixture was written with ale-py {meta['ale_py']}")
    out = tmp_path / "fixture.npz"
    argv = ["--out", str(out), "--steps", str(meta["steps"]), "--seed", str(meta["seed"])]
    assert af.main([*argv, "--compressed"]) == 0
    assert out.read_bytes() == af.FIXTURE.read_bytes()


def test_cached_generates_once_and_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("ale_py")
    first = af.cached(5, seed=1, games=["pong"], cache=tmp_path)
    (path,) = tmp_path.iterdir()
    mtime = path.stat().st_mtime_ns
    again = af.cached(5, seed=1, games=["pong"], cache=tmp_path)
    assert path.stat().st_mtime_ns == mtime
    assert np.array_equal(first["pong"]["frames"], again["pong"]["frames"])
    assert first["pong"]["frames"].shape == (5, 84, 84)
