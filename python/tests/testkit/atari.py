"""Real Atari frames for the compression tests: the committed ALE fixture (written by
`benches/atari_frames.py`), 8 preprocessed 84x84 uint8 frames from each of Pong, Breakout and
MsPacman."""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "atari_frames.npz"
GAMES = ("pong", "breakout", "ms_pacman")


def frames() -> np.ndarray:
    """The fixture's 24 frames, the three games one after the other."""
    with np.load(FIXTURE) as data:
        return np.concatenate([data[f"{g}/frames"] for g in GAMES])


def stacked(frames: np.ndarray, i: int, uid: int) -> np.ndarray:
    """An `(84, 84, 4)` observation: the four frames from `i` on (cycled), `uid` written
    into its first 8 bytes so that every observation differs."""
    n = len(frames)
    obs = np.stack([frames[(i + k) % n] for k in range(4)], axis=-1)
    obs.reshape(-1)[:8] = np.frombuffer(np.uint64(uid).tobytes(), np.uint8)
    return obs
