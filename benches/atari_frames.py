"""Real Atari frames for the benchmarks and tests: a fixed-seed rollout of seeded random
actions in the Arcade Learning Environment (``ale-py``, whose wheels ship the ROMs),
preprocessed the DQN way.

Usage::

    python -m benches.atari_frames --out PATH [--steps 1000] [--seed 0]
                                   [--games pong,breakout,ms_pacman] [--resize area|nearest]
                                   [--compressed]

Per game, per agent step: the action (uniform over the game's minimal action set, drawn from
``numpy.random.default_rng``) is repeated for 4 emulator frames, the last two grayscale
screens (210x160) are max-pooled and the result is area-averaged down to 84x84 ``uint8``
(``--resize nearest`` keeps every 2.5th row and 1.9th column instead).
Episodes start with 0-30 no-op steps and end at game over (or after ``MAX_EPISODE_STEPS``);
the emulator runs with sticky actions (``repeat_action_probability=0.25``, as the
``ALE/...-v5`` environments), seeded through ALE's ``random_seed``. An observation is the
frame stack of the last 4 frames, ``(84, 84, 4) uint8``, the first frame of an episode
repeated until there are 4 (:func:`observations`).

The file (``.npz``) holds, per game, ``GAME/frames`` ``(steps, 84, 84) uint8`` (the newest
frame of each step's observation) and ``GAME/episode_start`` ``(steps,) bool``, plus
``meta`` (JSON: seed, steps, games, preprocessing version, ale-py version). Stacks are built
on load, so a file holds each frame once. The same seed, steps and ale-py give the same bytes
(the resize is exact integer arithmetic, so no BLAS or machine difference enters).

Large files are never committed: :func:`cached` generates them under ``target/atari-frames``
on demand. The committed ``python/tests/data/atari_frames.npz`` is a few steps per game
(``--steps 8 --compressed``), for tests without ale-py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "target" / "atari-frames"
FIXTURE = ROOT / "python" / "tests" / "data" / "atari_frames.npz"
GAMES = ("pong", "breakout", "ms_pacman")
# Bump when the preprocessing changes: cached files carry it in their name.
VERSION = 1
SIZE = 84
STACK = 4
FRAME_SKIP = 4
STICKY = 0.25
MAX_NOOPS = 30
MAX_EPISODE_STEPS = 27_000  # 108,000 emulator frames, as the v5 environments
MAX_STEPS = 1_000_000  # bound on one game's rollout
SCREEN = (210, 160)
_DEN = 5 * 40  # sub-pixels per output pixel (see resize)


def resize(screens: np.ndarray) -> np.ndarray:
    """``(..., 210, 160) uint8`` screens area-averaged to ``(..., 84, 84) uint8``, rounded
    half up. 210 -> 84 is 5:2 and 160 -> 84 is 40:21: each axis is repeated by the second
    number and summed in blocks of the first, so each output pixel is the exact integer sum
    of its 5 x 40 sub-pixels. No floating point, so every machine gives the same bytes."""
    lead = screens.shape[:-2]
    x = screens.astype(np.int32)
    x = np.repeat(x, 2, axis=-2).reshape(*lead, SIZE, 5, SCREEN[1]).sum(axis=-2)
    x = np.repeat(x, 21, axis=-1).reshape(*lead, SIZE, SIZE, 40).sum(axis=-1)
    return ((x + _DEN // 2) // _DEN).astype(np.uint8)


_NEAREST_ROWS = np.arange(SIZE) * SCREEN[0] // SIZE
_NEAREST_COLS = np.arange(SIZE) * SCREEN[1] // SIZE


def resize_nearest(screens: np.ndarray) -> np.ndarray:
    """``(..., 210, 160)`` to ``(..., 84, 84)`` by keeping every 2.5th row and 1.9th column
    (nearest neighbour): no new gray levels, so it compresses better than area averaging,
    but thin objects (Pong's ball, Breakout's bricks' edges) can vanish from a frame."""
    return np.ascontiguousarray(screens[..., _NEAREST_ROWS, :][..., _NEAREST_COLS])


RESIZES = {"area": resize, "nearest": resize_nearest}


def rollout(game: str, steps: int, seed: int, resize: str = "area") -> dict[str, np.ndarray]:
    """``steps`` agent steps of seeded random play in ``game``: ``frames`` ``(steps, 84, 84)
    uint8`` and ``episode_start`` ``(steps,) bool``. ``resize``: ``area`` (the default, as
    OpenCV's ``INTER_AREA`` in the usual DQN wrappers) or ``nearest``."""
    import ale_py
    import ale_py.roms  # not imported by `import ale_py` since ale-py 0.12

    shrink = RESIZES[resize]
    if not 0 < steps <= MAX_STEPS:
        raise ValueError(f"steps must be in [1, {MAX_STEPS}], got {steps}")
    rom = ale_py.roms.get_rom_path(game)
    if rom is None:
        raise ValueError(f"ale-py ships no ROM named {game!r}")
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    ale = ale_py.ALEInterface()
    ale.setInt("random_seed", seed % (2**31))
    ale.setFloat("repeat_action_probability", STICKY)
    ale.setInt("frame_skip", 1)
    ale.loadROM(str(rom))
    actions = ale.getMinimalActionSet()
    noop = ale_py.Action.NOOP
    rng = np.random.default_rng([seed, zlib.crc32(game.encode())])
    frames = np.empty((steps, SIZE, SIZE), np.uint8)
    starts = np.zeros(steps, bool)
    screens = np.empty((2, *SCREEN), np.uint8)
    episode_steps = 0
    noops = 0
    for t in range(steps):
        if t == 0 or ale.game_over() or episode_steps >= MAX_EPISODE_STEPS:
            ale.reset_game()
            starts[t] = True
            episode_steps = 0
            noops = int(rng.integers(0, MAX_NOOPS + 1))
        action = noop if episode_steps < noops else actions[int(rng.integers(len(actions)))]
        for k in range(FRAME_SKIP):
            ale.act(action)
            if k >= FRAME_SKIP - 2:
                ale.getScreenGrayscale(screens[k - (FRAME_SKIP - 2)])
            if ale.game_over():
                ale.getScreenGrayscale(screens[1])  # both pooled screens are the last one
                ale.getScreenGrayscale(screens[0])
                break
        frames[t] = shrink(screens.max(axis=0))
        episode_steps += 1
    return {"frames": frames, "episode_start": starts}


def observations(frames: np.ndarray, episode_start: np.ndarray) -> np.ndarray:
    """The ``(steps, 84, 84, 4) uint8`` frame stacks (oldest first along the last axis), the
    first frame of an episode repeated at its start."""
    n = len(frames)
    t = np.arange(n)
    first = np.maximum.accumulate(np.where(episode_start, t, 0))  # each step's episode start
    idx = np.maximum(t[:, None] - (STACK - 1) + np.arange(STACK)[None, :], first[:, None])
    return np.ascontiguousarray(frames[idx].transpose(0, 2, 3, 1))


def _ale_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("ale-py")
    except Exception:  # noqa: BLE001  not installed, or no metadata
        return None


def generate(
    steps: int, seed: int, games: Sequence[str] = GAMES, resize: str = "area"
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every game's rollout as the arrays of a file, and its ``meta``."""
    arrays: dict[str, np.ndarray] = {}
    for game in games:
        for key, value in rollout(game, steps, seed, resize).items():
            arrays[f"{game}/{key}"] = value
    meta = {
        "seed": seed,
        "steps": steps,
        "games": list(games),
        "version": VERSION,
        "ale_py": _ale_version(),
        "preprocessing": f"grayscale, max of the last 2 of {FRAME_SKIP} frames, {resize} resize "
        f"to {SIZE}x{SIZE}, stack of {STACK}; sticky actions {STICKY}, 0-{MAX_NOOPS} no-ops",
    }
    return arrays, meta


def write(
    path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any], compressed: bool
) -> Path:
    """Writes the file atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save = np.savez_compressed if compressed else np.savez
    with open(tmp, "wb") as f:
        save(f, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    os.replace(tmp, path)
    return path


def load(path: Path) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """``({game: {"frames", "episode_start"}}, meta)`` from a file :func:`write` wrote."""
    with np.load(path, allow_pickle=False) as z:
        meta: dict[str, Any] = json.loads(str(z["meta"]))
        games = {
            g: {"frames": z[f"{g}/frames"], "episode_start": z[f"{g}/episode_start"]}
            for g in meta["games"]
        }
    return games, meta


def cached(
    steps: int,
    seed: int = 0,
    games: Sequence[str] = GAMES,
    cache: Path = CACHE,
    resize: str = "area",
) -> dict[str, dict[str, np.ndarray]]:
    """The rollouts of ``games``, generated once into ``cache`` and read from there after."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for game in games:
        path = cache / f"{game}-seed{seed}-steps{steps}-{resize}-v{VERSION}.npz"
        if not path.exists():
            arrays, meta = generate(steps, seed, [game], resize)
            write(path, arrays, meta, compressed=False)
        out[game] = load(path)[0][game]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benches.atari_frames", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="the .npz file to write")
    p.add_argument("--steps", type=int, default=1000, help="agent steps per game")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--games", default=",".join(GAMES), help="comma-separated ALE ROM names")
    p.add_argument("--resize", choices=sorted(RESIZES), default="area", help="default area")
    p.add_argument("--compressed", action="store_true", help="np.savez_compressed (deflate)")
    args = p.parse_args(argv)
    games = [g for g in args.games.split(",") if g]
    try:
        arrays, meta = generate(args.steps, args.seed, games, args.resize)
    except (ImportError, ValueError) as e:
        print(f"atari_frames: {e}", file=sys.stderr)
        return 2
    path = write(args.out, arrays, meta, args.compressed)
    print(f"wrote {path} ({path.stat().st_size:,} bytes): {args.steps} steps of {', '.join(games)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
