"""The sample both checkpoint test files store (every byte derived from its id, so a torn or
misaligned row shows) and the checks of what comes back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

BLOB = 64


def example() -> dict[str, Any]:
    return {
        "obs": np.zeros((3,), np.int64),
        "extra": {"id": np.zeros((), np.uint64), "blob": np.zeros((BLOB,), np.uint8)},
    }


def item(i: int) -> dict[str, Any]:
    """A sample every byte of which is derived from `i`."""
    return {
        "obs": np.array([i, 2 * i, 3 * i], np.int64),
        "extra": {
            "id": np.array(i, np.uint64),
            "blob": ((i * 7 + np.arange(BLOB)) % 251).astype(np.uint8),
        },
    }


def intact_ids(obs: Any, ids: Any, blob: Any) -> list[int]:
    """The ids of rows (of a checkpoint's leaves or a batch) that are each one whole
    `item(i)`; fails on any torn row."""
    ids = np.asarray(ids).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(obs), np.stack([ids, 2 * ids, 3 * ids], axis=1))
    expected = (ids[:, None] * 7 + np.arange(BLOB)[None, :]) % 251
    np.testing.assert_array_equal(np.asarray(blob), expected.astype(np.uint8))
    return [int(i) for i in ids]


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import echo, echo.checkpoint
    from echo import Server, Uniform
    path, stage = sys.argv[1], sys.argv[2]
    server = Server({{"x": np.zeros((1024,), np.uint8)}}, 4, {settings})
    for i in range(10):
        server.submit({{"x": np.full(1024, i, np.uint8)}})
    server.checkpoint(path)
    for i in range(10, 50):
        server.submit({{"x": np.full(1024, i, np.uint8)}})
    def hook(at):
        if at == stage:
            os.kill(os.getpid(), signal.SIGKILL)
    echo.checkpoint._test_hook = hook
    server.checkpoint(path)
    print("not killed", flush=True)
    """
)


def kill_mid_checkpoint(path: Path, stage: str, settings: str) -> None:
    """In a child process: a server of `{"x": u8[1024]}` samples in batches of 4, with the
    keyword arguments `settings` (source text), takes 10 samples and a checkpoint at `path`,
    then 40 more and a second checkpoint, during which the process is SIGKILLed at `stage`
    (a checkpoint test hook)."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED.format(settings=settings), str(path), stage],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr


def wait_for_ragged_checkpoint(directory: Path, samples: int, timeout: float) -> None:
    """Waits until the newest periodic checkpoint in `directory` (a ragged server's) holds
    `samples` samples: one that began before the last submit may finish after it, so the
    newest one's manifest, not its arrival, says whether it holds them all."""
    from echo.checkpoint import periodic_checkpoints

    def newest_holds_all() -> bool:
        found = periodic_checkpoints(directory)
        if not found:
            return False
        manifest = json.loads((Path(found[-1]) / "ragged.json").read_text())
        return bool(manifest["counts"]["samples"] == samples)

    deadline = time.monotonic() + timeout
    while not newest_holds_all():
        assert time.monotonic() < deadline, f"no periodic checkpoint of all {samples} samples"
        time.sleep(0.02)
