"""Checkpoints of replay servers (issue #13): what a restore reproduces, consistency under
concurrent inserts and samples, atomic replacement under SIGKILL, and damaged checkpoints."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.checkpoints import example, intact_ids, item, kill_mid_checkpoint

import echo
from echo import (
    CheckpointError,
    Fifo,
    Lifo,
    MinPriority,
    MinSize,
    Prioritized,
    Queue,
    SampleToInsertRatio,
    Server,
    Uniform,
)


def contents(path: Path) -> dict[str, Any]:
    """Everything a checkpoint holds: the arrays and the manifest's state and settings."""
    manifest = json.loads((path / "manifest.json").read_text())
    arrays = {
        name: np.load(path / name, mmap_mode="r").copy()
        for name in manifest["files"]
        if name.endswith(".npy")
    }
    return {"arrays": arrays, "state": manifest["state"], "settings": manifest["settings"]}


def assert_same_contents(a: Path, b: Path) -> None:
    ca, cb = contents(a), contents(b)
    assert ca["state"] == cb["state"]
    assert ca["settings"] == cb["settings"]
    assert ca["arrays"].keys() == cb["arrays"].keys()
    for name in ca["arrays"]:
        np.testing.assert_array_equal(ca["arrays"][name], cb["arrays"][name], err_msg=name)


SAMPLERS = [Uniform(), Prioritized(0.7), Lifo()]
REMOVERS = [Fifo(), Lifo(), MinPriority()]
LIMITERS = [MinSize(2), SampleToInsertRatio(2.0, 2, 500.0), Queue(100)]


def fill(server: Server, ids: range) -> None:
    for i in ids:
        server.submit(item(i), timeout=10, priority=1.0 + (i % 5))


@pytest.mark.parametrize("limiter", LIMITERS, ids=repr)
@pytest.mark.parametrize("remover", REMOVERS, ids=repr)
@pytest.mark.parametrize("sampler", SAMPLERS, ids=repr)
def test_restore_reproduces_items_priorities_counts_and_limiter_state(
    tmp_path: Path, sampler: Any, remover: Any, limiter: Any
) -> None:
    kwargs: dict[str, Any] = {"sampler": sampler, "remover": remover, "rate_limiter": limiter}
    with Server(example(), 4, max_size=16, seed=1, **kwargs) as server:
        fill(server, range(30))
        for _ in range(3):
            sample = server.sample(timeout=10)
            assert sample is not None
            assert sample.keys is not None
            server.update_priorities(sample.keys, np.full(4, 0.5))
        server.checkpoint(tmp_path / "a")
        restored = Server.restore(tmp_path / "a")
        with restored:
            assert restored.batch_size == 4
            assert restored.max_size == 16
            assert restored.sampler == sampler
            restored.checkpoint(tmp_path / "b")
            assert_same_contents(tmp_path / "a", tmp_path / "b")
            # The same evictions, keys and limiter counts from here on.
            fill(server, range(100, 110))
            fill(restored, range(100, 110))
            server.checkpoint(tmp_path / "a")
            restored.checkpoint(tmp_path / "b")
            assert_same_contents(tmp_path / "a", tmp_path / "b")
    c = contents(tmp_path / "a")["arrays"]
    intact_ids(c["leaf_002.npy"], c["leaf_001.npy"], c["leaf_000.npy"])
    assert len(c["keys.npy"]) == 16


def test_max_times_sampled_counts_survive_a_restore(tmp_path: Path) -> None:
    with Server(example(), 2, max_size=8, max_times_sampled=3, sampler=Uniform(), seed=4) as s:
        fill(s, range(8))
        for _ in range(5):
            assert s.sample(timeout=10) is not None
        s.checkpoint(tmp_path / "c")
        restored = Server.restore(tmp_path / "c")
        with restored:
            ts = np.load(tmp_path / "c" / "times_sampled.npy")
            assert ts.sum() > 0
            assert ts.max() < 3
            left = int((3 - ts).sum())
            drawn = 0
            while drawn < left - 1:  # every remaining draw, then the table runs dry
                batch = restored.sample(timeout=10)
                assert batch is not None
                assert batch.times_sampled is not None
                assert batch.times_sampled.max() <= 3
                drawn += 2
            assert restored.stats().store_size <= 1


def chi_square(counts: np.ndarray[Any, Any], probabilities: np.ndarray[Any, Any]) -> float:
    expected = counts.sum() * probabilities
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("sampler", [Uniform(), Prioritized(0.8)], ids=repr)
def test_the_sampling_distribution_is_unchanged_after_restore(tmp_path: Path, sampler: Any) -> None:
    n = 20
    with Server(example(), 8, max_size=n, sampler=sampler, seed=7) as server:
        for i in range(n):
            server.submit(item(i), priority=float(i + 1))
        first = server.sample()
        assert first is not None
        assert first.keys is not None
        assert first.probabilities is not None
        before = dict(zip(first.keys.tolist(), first.probabilities.tolist(), strict=True))
        server.checkpoint(tmp_path / "d")
    restored = Server.restore(tmp_path / "d")
    weights = np.arange(1, n + 1, dtype=np.float64) ** getattr(sampler, "exponent", 0.0)
    probabilities = weights / weights.sum()
    counts = np.zeros(n)
    with restored:
        for _ in range(1000):
            batch = restored.sample(timeout=10)
            assert batch is not None
            assert batch.keys is not None
            assert batch.probabilities is not None
            np.add.at(counts, batch.keys.astype(np.int64), 1)
            for key, p in zip(batch.keys.tolist(), batch.probabilities.tolist(), strict=True):
                assert p == pytest.approx(probabilities[key], rel=1e-9)
                if key in before:
                    assert p == pytest.approx(before[key], rel=1e-9)
    # 19 degrees of freedom: the 0.1% critical value is 43.82 (a fixed seed: deterministic).
    assert chi_square(counts, probabilities) < 43.82


def test_a_lifo_sampler_continues_with_the_same_items(tmp_path: Path) -> None:
    with Server(example(), 3, max_size=10, sampler=Lifo(), seed=2) as server:
        fill(server, range(10))
        server.checkpoint(tmp_path / "e")
        restored = Server.restore(tmp_path / "e")
        with restored:
            for _ in range(3):
                a, b = server.sample(timeout=10), restored.sample(timeout=10)
                assert a is not None
                assert b is not None
                assert a.keys is not None
                np.testing.assert_array_equal(a.keys, b.keys)
                np.testing.assert_array_equal(a.times_sampled, b.times_sampled)


def test_a_checkpoint_under_concurrent_inserts_and_samples_is_consistent(tmp_path: Path) -> None:
    server = Server(example(), 8, max_size=2000, sampler=Uniform(), max_times_sampled=4, seed=3)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(base: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                server.submit(item(base + i), timeout=10)
                i += 1
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    def sampler() -> None:
        try:
            while not stop.is_set():
                batch = server.sample(timeout=10)
                assert batch is not None
                b = batch.batch
                intact_ids(b["obs"], b["extra"]["id"], b["extra"]["blob"])
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k * 10**9,)) for k in range(2)]
    threads.append(threading.Thread(target=sampler))
    for t in threads:
        t.start()
    try:
        for round_ in range(4):
            path = tmp_path / f"live{round_ % 2}"
            server.checkpoint(path)
            c = contents(path)["arrays"]
            intact_ids(c["leaf_002.npy"], c["leaf_001.npy"], c["leaf_000.npy"])
            keys = c["keys.npy"]
            assert np.all(np.diff(keys.astype(np.int64)) > 0), "insertion order"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        server.close()
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    restored = Server.restore(tmp_path / "live1")
    with restored:
        stats = restored.stats()
        assert stats.store_size == len(np.load(tmp_path / "live1" / "keys.npy"))


@pytest.mark.parametrize("stage", ["leaves-written", "before-swap"])
def test_a_process_killed_mid_checkpoint_leaves_the_previous_one_loadable(
    tmp_path: Path, stage: str
) -> None:
    path = tmp_path / "ckpt"
    kill_mid_checkpoint(
        path,
        stage,
        "max_size=64, sampler=Uniform(), seed=1",
    )
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert len(leftovers) == 2, f"the previous and the partial directory: {leftovers}"
    restored = Server.restore(path)
    with restored:
        assert restored.stats().store_size == 10, "the first checkpoint, whole"
        x = np.load(path / "leaf_000.npy")
        np.testing.assert_array_equal(
            x, np.repeat(np.arange(10, dtype=np.uint8), 1024).reshape(10, 1024)
        )
        restored.submit({"x": np.full(1024, 99, np.uint8)})
        restored.checkpoint(path)
    assert len([p for p in tmp_path.iterdir() if p.name != "ckpt"]) == 1, "leftovers removed"
    assert Server.restore(path).stats().store_size == 11


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    with Server(example(), 2, max_size=8, sampler=Uniform(), seed=1) as server:
        fill(server, range(6))
        server.checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _damaged(tmp_path: Path, kind: str) -> Path:
    """A replay or a FIFO checkpoint of a few items, to damage."""
    if kind == "replay":
        server = Server(example(), 2, max_size=8, sampler=Uniform(), seed=1)
    else:
        server = Server(example(), 2, num_buffers=4)
    with server:
        for i in range(6 if kind == "replay" else 5):
            server.submit(item(i), timeout=10, priority=1.0 if kind == "replay" else None)
        server.checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize(("kind", "file"), [("replay", "leaf_002.npy"), ("fifo", "leaf_001.npy")])
def test_a_flipped_byte_is_reported_with_the_file(tmp_path: Path, kind: str, file: str) -> None:
    saved = _damaged(tmp_path, kind)
    target = saved.resolve() / file
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{file}: SHA-256 .* \(corrupted\)"):
        Server.restore(saved)


@pytest.mark.parametrize(("kind", "file"), [("replay", "priorities.npy"), ("fifo", "leaf_000.npy")])
def test_a_truncated_file_is_reported_with_the_file(tmp_path: Path, kind: str, file: str) -> None:
    saved = _damaged(tmp_path, kind)
    target = saved.resolve() / file
    target.write_bytes(target.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=rf"{file}: \d+ bytes, the manifest says"):
        Server.restore(saved)


@pytest.mark.parametrize(
    ("kind", "file"), [("replay", "keys.npy"), ("fifo", "leaf_002.npy"), ("fifo", "manifest.json")]
)
def test_a_deleted_file_is_reported_with_the_file(tmp_path: Path, kind: str, file: str) -> None:
    saved = _damaged(tmp_path, kind)
    (saved.resolve() / file).unlink()
    with pytest.raises(CheckpointError, match=rf"{file}: missing"):
        Server.restore(saved)
    (saved.resolve() / "manifest.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing"):
        Server.restore(saved)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("replay", r"manifest\.json: the example's leaf \['obs'\]"),
        ("fifo", r"\['obs'\].*does not match"),
    ],
)
def test_a_wrong_example_is_reported(tmp_path: Path, kind: str, message: str) -> None:
    saved = _damaged(tmp_path, kind)
    wrong = example()
    wrong["obs"] = np.zeros((3,), np.float64)
    with pytest.raises(CheckpointError, match=message):
        Server.restore(saved, wrong)
    with pytest.raises(CheckpointError, match="leaves"):
        Server.restore(saved, {"obs": np.zeros((3,), np.int64)})


def test_a_newer_format_version_is_refused(saved: Path) -> None:
    manifest = saved.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = echo.checkpoint.FORMAT_VERSION + 1
    manifest.write_text(json.dumps(data))
    newer = echo.checkpoint.FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match=rf"manifest\.json: format version {newer} is newer"):
        Server.restore(saved)


def test_checkpoint_files_open_with_numpy_memory_maps(saved: Path) -> None:
    ids = np.load(saved / "leaf_001.npy", mmap_mode="r")
    np.testing.assert_array_equal(ids, np.arange(6, dtype=np.uint64))
    assert np.load(saved / "keys.npy").dtype == np.uint64
    assert np.load(saved / "times_sampled.npy").dtype == np.uint32
    manifest = json.loads((saved / "manifest.json").read_text())
    # The lowest version that describes it: 4 only adds compressed leaf files.
    assert manifest["format_version"] == 3
    assert manifest["counts"] == {"items": 6, "from_ingress": 0}
    assert [leaf["name"] for leaf in manifest["layout"]["leaves"]] == [
        "['extra']['blob']",
        "['extra']['id']",
        "['obs']",
    ]


def test_a_tuple_tree_needs_the_example(tmp_path: Path) -> None:
    ex = (np.zeros((2,), np.float32), np.zeros((), np.int32))
    with Server(ex, 1, max_size=4, sampler=Uniform()) as server:
        server.submit((np.ones(2, np.float32), np.array(5, np.int32)))
        server.checkpoint(tmp_path / "t")
    with pytest.raises(CheckpointError, match="pass example="):
        Server.restore(tmp_path / "t")
    restored = Server.restore(tmp_path / "t", ex)
    with restored:
        batch = restored.sample(timeout=10)
        assert batch is not None
        assert int(batch.batch[1][0]) == 5


def test_a_version_1_checkpoint_is_still_read(saved: Path) -> None:
    manifest = saved.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 1
    data["counts"] = {"items": data["counts"]["items"]}  # version 1 had no ingress samples
    manifest.write_text(json.dumps(data))
    restored = Server.restore(saved)
    with restored:
        assert restored.stats().store_size == 6
        restored.checkpoint(saved.parent / "again")
    np.testing.assert_array_equal(
        np.load(saved.parent / "again" / "leaf_001.npy"), np.arange(6, dtype=np.uint64)
    )


def test_checkpoint_refuses_to_replace_a_directory_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    server = Server(example(), 2, max_size=4, sampler=Uniform())
    with server, pytest.raises(FileExistsError, match="not a checkpoint link"):
        server.checkpoint(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
