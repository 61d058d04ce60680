"""Writes the checkpoint fixtures beside this file, with the echo that is imported.

The fixtures pin what checkpoints on disk mean: `test_checkpoint_fixtures.py` restores each
one with the echo under test and checks it holds exactly the data below. They were written
by echo 0.3.0 before the checkpoint format moved into the core; run this again only to add a
fixture for a new format version, never to replace one that exists (that would hide a
change in what an old file means).

    python python/tests/data/checkpoints/make.py [NAME ...]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import echo
from echo import Fifo, Lz4, Prioritized, Sequence, Server, Uniform, Zstd

HERE = Path(__file__).resolve().parent


def example() -> dict[str, Any]:
    """Every fixture's sample: a float vector, an int scalar and a compressible frame."""
    return {
        "obs": np.zeros(3, np.float32),
        "action": np.zeros((), np.int64),
        "frame": np.zeros(256, np.uint8),
    }


def sample(i: int) -> dict[str, Any]:
    """Sample (or step) `i`: every leaf a function of `i`."""
    return {
        "obs": np.array([i, i + 0.5, -i], np.float32),
        "action": np.array(i * 7, np.int64),
        "frame": ((np.arange(256) // 32 + i) % 251).astype(np.uint8),
    }


EXTRA = {"step": 3, "weights": np.arange(4, dtype=np.float32), "name": ("adam", 0.5)}


def fifo() -> Server:
    server = Server(example(), 4, num_buffers=3, sampler=Fifo())
    for i in range(10):
        server.submit(sample(i))
    assert server.sample(timeout=5) is not None  # samples 0-3 handed out
    return server


def replay(compress: Any = None) -> Server:
    server = Server(
        example(),
        4,
        max_size=16,
        sampler=Prioritized(0.8),
        seed=7,
        compress=compress,
    )
    for i in range(10):
        server.submit(sample(i), priority=1.0 + i)
    got = server.sample(timeout=5)
    assert got is not None
    server.update_priorities(got.info.keys, np.array([0.25, 0.5, 0.75, 2.0]))
    return server


def sequence(compress: Any = None) -> Server:
    server = Server(
        example(),
        2,
        max_size=64,
        sampler=Uniform(),
        seed=11,
        sequence=Sequence(3, 1),
        compress=compress,
    )
    # Stream 0: an episode of 5 steps that ended, then 2 steps of an open one; stream 1:
    # 4 steps of an open episode.
    for t in range(5):
        server.submit(sample(t), stream=0, end_episode=t == 4)
    for t in range(5, 7):
        server.submit(sample(t), stream=0)
    for t in range(4):
        server.submit(sample(100 + t), stream=1)
    assert server.sample(timeout=5) is not None
    return server


FIXTURES = {
    "fifo-v3": fifo,
    "replay-v3": replay,
    "replay-zstd-v4": lambda: replay({"frame": Zstd(1)}),
    "replay-lz4-v4": lambda: replay({"frame": Lz4()}),
    "sequence-v3": sequence,
    "sequence-zstd-v4": lambda: sequence({"frame": Zstd(3)}),
}


def write(name: str) -> None:
    dest = HERE / name
    if dest.exists():
        sys.exit(f"{dest} exists: fixtures are never rewritten (see the module doc)")
    server = FIXTURES[name]()
    with tempfile.TemporaryDirectory() as tmp, server:
        link = Path(tmp) / "ckpt"
        server.checkpoint(link, extra=EXTRA)
        shutil.copytree(os.path.realpath(link), dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    version = manifest["format_version"]
    print(f"{name}: format {manifest['format']} v{version}, echo {echo.__version__}")


def replay_v1() -> None:
    """The version-1 replay checkpoint: no ingress samples and no tuning (written before
    either was recorded), made from replay-v3 by dropping what version 1 did not have."""
    source, dest = HERE / "replay-v3", HERE / "replay-v1"
    if dest.exists():
        sys.exit(f"{dest} exists: fixtures are never rewritten (see the module doc)")
    shutil.copytree(source, dest)
    manifest_file = dest / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["format_version"] = 1
    manifest["counts"] = {"items": manifest["counts"]["items"]}
    manifest.pop("tuning", None)
    manifest_file.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print("replay-v1: from replay-v3")


if __name__ == "__main__":
    names = sys.argv[1:] or [*FIXTURES, "replay-v1"]
    for name in names:
        if name == "replay-v1":
            replay_v1()
        else:
            write(name)
