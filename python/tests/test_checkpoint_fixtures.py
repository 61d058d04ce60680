"""Checkpoints written by an earlier echo still mean what they meant.

`data/checkpoints/` holds small checkpoints of every kind (FIFO, replay, sequence), raw and
with compressed leaves, written by echo 0.3.0 with `data/checkpoints/make.py` (its
`sample(i)` made every row), and a version-1 replay manifest. Each test restores one with the
echo under test and checks that it holds exactly that data: the rows in the files, what
sampling hands out, the learner's `extra`, and, once checkpointed again, the same files
byte for byte (the restored table kept every row, key, priority and count).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import echo
from echo import Server

FIXTURES = Path(__file__).parent / "data" / "checkpoints"


def sample(i: int) -> dict[str, Any]:
    """Row `i` as `data/checkpoints/make.py` wrote it."""
    return {
        "obs": np.array([i, i + 0.5, -i], np.float32),
        "action": np.array(i * 7, np.int64),
        "frame": ((np.arange(256) // 32 + i) % 251).astype(np.uint8),
    }


def rows(indices: list[int]) -> dict[str, np.ndarray]:
    return {key: np.stack([sample(i)[key] for i in indices]) for key in ("action", "frame", "obs")}


def copy(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    return dest


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def check_extra(server: Server) -> None:
    extra = server.restored_extra
    assert extra["step"] == 3
    assert extra["name"] == ("adam", 0.5)
    np.testing.assert_array_equal(extra["weights"], np.arange(4, dtype=np.float32))
    assert extra["weights"].dtype == np.float32
    assert server.params_version == 0  # written before parameters were checkpointed


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_data_files(fixture: Path, again: Path, names: list[str]) -> None:
    """`names` hold the same bytes in both checkpoints, and the new manifest says so."""
    written = manifest(again)["files"]
    for name in names:
        assert digest(again / name) == digest(fixture / name), name
        assert written[name]["sha256"] == digest(fixture / name), name


def test_a_fifo_checkpoint_hands_out_the_samples_it_held(tmp_path: Path) -> None:
    path = copy("fifo-v3", tmp_path)
    head = manifest(path)
    assert (head["format"], head["format_version"]) == ("echo-fifo-checkpoint", 3)
    assert head["counts"] == {"items": 6, "handed_out_before": 4, "from_ring": 6, "from_ingress": 0}
    np.testing.assert_array_equal(
        np.load(path / "leaf_000.npy"), rows(list(range(4, 10)))["action"]
    )
    restored = Server.restore(path)
    with restored:
        check_extra(restored)
        got = restored.sample(timeout=5)
        assert got is not None
        for key, expected in rows([4, 5, 6, 7]).items():
            np.testing.assert_array_equal(got.batch[key], expected)
        assert restored.stats().store_size == 2  # samples 8 and 9: fewer than a batch


@pytest.mark.parametrize("name", ["replay-v3", "replay-v1", "replay-zstd-v4", "replay-lz4-v4"])
def test_a_replay_checkpoint_restores_every_item_key_and_priority(
    name: str, tmp_path: Path
) -> None:
    path = copy(name, tmp_path)
    head = manifest(path)
    assert head["format"] == "echo-replay-checkpoint"
    assert head["format_version"] == {"replay-v1": 1, "replay-v3": 3}.get(name, 4)
    expected = rows(list(range(10)))
    np.testing.assert_array_equal(np.load(path / "keys.npy"), np.arange(10, dtype=np.uint64))
    np.testing.assert_array_equal(np.load(path / "leaf_000.npy"), expected["action"])
    np.testing.assert_array_equal(np.load(path / "leaf_002.npy"), expected["obs"])
    codecs = {"replay-zstd-v4": echo.Zstd(1, force=True), "replay-lz4-v4": echo.Lz4(force=True)}
    restored = Server.restore(path)
    with restored:
        check_extra(restored)
        assert restored.compress == ({"frame": codecs[name]} if name in codecs else {})
        assert restored.stats().store_size == 10
        again = tmp_path / "again"
        restored.checkpoint(again)
        seen: set[int] = set()
        for _ in range(50):
            got = restored.sample(timeout=5)
            assert got is not None
            for row, key in enumerate(got.info.keys):
                i = int(key)
                seen.add(i)
                for leaf, values in sample(i).items():
                    np.testing.assert_array_equal(got.batch[leaf][row], values)
        assert seen <= set(range(10))
    data = ["leaf_000.npy", "leaf_002.npy", "keys.npy", "priorities.npy", "times_sampled.npy"]
    if name in codecs:
        frame = "leaf_001.zst" if name == "replay-zstd-v4" else "leaf_001.lz4"
        data += [frame, "leaf_001.lengths.npy"]
    else:
        data += ["leaf_001.npy"]
    same_data_files(path, again, data)
    # The priorities are the updated ones, and the table-wide state (the limiter's counters,
    # the RNG, the next key, the largest priority) came back whole.
    assert sorted(np.load(path / "priorities.npy").tolist()) != [1.0 + i for i in range(10)]
    assert manifest(again)["state"] == head["state"]


@pytest.mark.parametrize("name", ["sequence-v3", "sequence-zstd-v4"])
def test_a_sequence_checkpoint_restores_its_chunks_windows_and_open_episodes(
    name: str, tmp_path: Path
) -> None:
    path = copy(name, tmp_path)
    head = manifest(path)
    assert (head["format"], head["format_version"]) == (
        "echo-sequence-checkpoint",
        3 if name == "sequence-v3" else 4,
    )
    assert head["counts"]["items"] == 11
    assert head["counts"]["open_episodes"] == 2
    steps = np.load(path / "leaf_002.npy")  # obs, chunk by chunk
    assert sorted(int(o[0]) for o in steps) == [*range(7), *range(100, 104)]
    restored = Server.restore(path)
    with restored:
        check_extra(restored)
        assert restored.sequence == echo.Sequence(3, 1)
        again = tmp_path / "again"
        restored.checkpoint(again)
        # Every window is 3 consecutive steps of one episode (padded past its end).
        for _ in range(20):
            got = restored.sample(timeout=5)
            assert got is not None
            for w in range(2):
                mask = got.mask[w]
                first = int(got.batch["obs"][w, 0, 0])
                for t in range(3):
                    if mask[t]:
                        for leaf, values in sample(first + t).items():
                            np.testing.assert_array_equal(got.batch[leaf][w, t], values)
        # The open episodes go on: stream 0's next step joins steps 5 and 6, so a window
        # 5, 6, 7 appears once 7 is in.
        restored.submit(sample(7), stream=0)
        starts: set[int] = set()
        for _ in range(200):
            got = restored.sample(timeout=5)
            assert got is not None
            starts.update(int(got.batch["obs"][w, 0, 0]) for w in range(2))
        assert 5 in starts
    data = ["leaf_000.npy", "leaf_002.npy"]
    data += ["leaf_001.npy"] if name == "sequence-v3" else ["leaf_001.zst", "leaf_001.lengths.npy"]
    same_data_files(path, again, data)
    assert manifest(again)["counts"] == head["counts"]
