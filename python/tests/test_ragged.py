"""Variable-length samples through `echo.Server`: ragged leaves, length groups, the packed and
padded layouts, token budgets, groups handed out whole, replay eviction by bytes, and the
refusals that name the leaf and the numbers and store nothing."""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.checkpoints import wait_for_ragged_checkpoint

import echo
from echo import CheckpointError, Packed, Padded, Ragged

MAX_LEN = 300


def example() -> dict[str, Any]:
    return {
        "prompt": Ragged(64, np.int32),
        "tokens": Ragged(MAX_LEN, np.int32, group="completion"),
        "logp": Ragged(MAX_LEN, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }


def length_of(i: int) -> int:
    return (i * 37) % (MAX_LEN + 1)


def make(i: int, n: int | None = None) -> dict[str, Any]:
    n = length_of(i) if n is None else n
    return {
        "prompt": np.arange(i % 64, dtype=np.int32),
        "tokens": (i * 1000 + np.arange(n)).astype(np.int32),
        "logp": -np.arange(n, dtype=np.float32),
        "id": np.int64(i),
    }


def check_packed(batch: Any) -> list[int]:
    """Every sample of a packed batch is what was submitted for its id; returns the ids."""
    ids = [int(i) for i in batch["id"]]
    tokens, logp = batch["tokens"], batch["logp"]
    assert isinstance(tokens, Packed)
    assert isinstance(logp, Packed)
    assert tokens.cu_seqlens is logp.cu_seqlens or np.array_equal(
        tokens.cu_seqlens, logp.cu_seqlens
    )
    cu = tokens.cu_seqlens
    assert cu.dtype == np.int32
    assert cu.shape == (len(ids) + 1,)
    assert cu[0] == 0
    for k, i in enumerate(ids):
        a, b = int(cu[k]), int(cu[k + 1])
        np.testing.assert_array_equal(tokens.values[a:b], i * 1000 + np.arange(length_of(i)))
        np.testing.assert_array_equal(logp.values[a:b], -np.arange(length_of(i)))
        p = batch["prompt"]
        pa, pb = int(p.cu_seqlens[k]), int(p.cu_seqlens[k + 1])
        np.testing.assert_array_equal(p.values[pa:pb], np.arange(i % 64))
    return ids


def test_a_ragged_example_makes_a_ragged_server() -> None:
    with echo.Server(example(), 4) as server:
        assert isinstance(server, echo.Server)
        assert server.leaf_names == ["['id']", "['logp']", "['prompt']", "['tokens']"]
        assert "ragged" in repr(server)


def test_fifo_hands_every_sample_out_once_and_intact_under_contention() -> None:
    server = echo.Server(example(), 16, num_buffers=3)
    per_writer, writers = 1500, 4

    def write(w: int) -> None:
        for k in range(per_writer):
            server.submit(make(w * 100_000 + k), timeout=30)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()

    def close_when_done() -> None:
        for t in threads:
            t.join()
        server.close(drain=True)

    closer = threading.Thread(target=close_when_done)
    closer.start()
    seen: set[int] = set()
    while (s := server.sample(timeout=30)) is not None:
        assert s.num_samples <= 16
        for i in check_packed(s.batch):
            assert i not in seen, f"sample {i} handed out twice"
            seen.add(i)
    closer.join()
    assert seen == {w * 100_000 + k for w in range(writers) for k in range(per_writer)}
    assert server.stats().samples_submitted_total == writers * per_writer


def test_a_fifo_batch_of_side_by_side_rows_is_a_read_only_view_that_outlives_the_server() -> None:
    server = echo.Server(example(), 4)
    for i in range(4):
        server.submit(make(i, 10))
    s = server.sample(timeout=5)
    assert s is not None
    values = s.batch["tokens"].values
    assert not values.flags.writeable
    assert type(values.base).__name__ == "RingLease"
    server.close()
    del server
    gc.collect()
    # The arena stays mapped as long as a view exists.
    np.testing.assert_array_equal(values[:10], np.arange(10))
    with echo.Server(example(), 2) as other:
        other.submit(make(1, 3))
        other.submit(make(2, 3))
        got = other.sample(timeout=5, copy=True)
        assert got is not None
        assert got.batch["tokens"].values.flags.writeable


def test_padded_batches_pad_with_zeros_to_a_multiple_and_carry_lengths_and_a_mask() -> None:
    server = echo.Server(example(), 3, layout="padded", pad_to_multiple=8)
    for i, n in ((1, 3), (2, 0), (3, 9)):
        server.submit(make(i, n))
    s = server.sample(timeout=5)
    assert s is not None
    tokens = s.batch["tokens"]
    assert isinstance(tokens, Padded)
    assert tokens.values.shape == (3, 16)
    np.testing.assert_array_equal(tokens.lengths, [3, 0, 9])
    assert tokens.mask.shape == (3, 16)
    assert tokens.mask.dtype == np.bool_
    np.testing.assert_array_equal(tokens.mask.sum(axis=1), [3, 0, 9])
    np.testing.assert_array_equal(tokens.values[0], [1000, 1001, 1002] + [0] * 13)
    np.testing.assert_array_equal(tokens.values[1], [0] * 16)
    np.testing.assert_array_equal(tokens.values[2, :10], [*range(3000, 3009), 0])
    # The prompt is its own group: its own lengths.
    np.testing.assert_array_equal(s.batch["prompt"].lengths, [1, 2, 3])
    # Per call, the other layout.
    for i in range(3):
        server.submit(make(10 + i, 4))
    s = server.sample(timeout=5, layout="packed")
    assert s is not None
    assert isinstance(s.batch["tokens"], Packed)


def test_episodes_with_an_inner_shape() -> None:
    ex = {"obs": Ragged(50, np.float32, (4,)), "ret": np.zeros((), np.float32)}
    server = echo.Server(ex, 2, layout="padded")
    server.submit({"obs": np.ones((7, 4), np.float32), "ret": np.float32(1)})
    server.submit({"obs": np.full((2, 4), 2, np.float32), "ret": np.float32(2)})
    s = server.sample(timeout=5)
    assert s is not None
    assert s.batch["obs"].values.shape == (2, 7, 4)
    assert s.batch["obs"].values[1, 2:].sum() == 0
    with pytest.raises(
        ValueError, match=r"\['obs'\]: expected shape \(n, 4\) with n <= 50, got \(3, 5\)"
    ):
        server.submit({"obs": np.ones((3, 5), np.float32), "ret": np.float32(1)})


def test_token_budgets_close_batches_and_groups_are_never_split() -> None:
    server = echo.Server(example(), 12, batch_tokens=1000, token_group="completion", num_buffers=4)
    groups, size = 60, 4

    def write() -> None:
        for g in range(groups):
            server.submit_group([make(g * size + k) for k in range(size)], timeout=30)
        server.close(drain=True)

    writer = threading.Thread(target=write)
    writer.start()
    seen = 0
    while (s := server.sample(timeout=30)) is not None:
        ids = check_packed(s.batch)
        assert s.num_samples == len(ids)
        assert len(ids) % size == 0
        assert len(ids) <= 12
        assert s.batch["tokens"].cu_seqlens[-1] <= 1000
        for k in range(0, len(ids), size):
            chunk = ids[k : k + size]
            assert all(i // size == chunk[0] // size for i in chunk), f"split group {chunk}"
            assert s.keys is not None
            assert len({int(key) for key in s.keys[k : k + size]}) == 1
        seen += len(ids)
    writer.join()
    assert seen == groups * size


def test_replay_draws_whole_groups() -> None:
    server = echo.Server(example(), 8, sampler=echo.Uniform(), max_size=400, seed=3)
    for g in range(50):
        server.submit_group([make(g * 4 + k, 5) for k in range(4)])
    for _ in range(20):
        s = server.sample(timeout=5)
        assert s is not None
        ids = [int(i) for i in s.batch["id"]]
        assert len(ids) == 8
        for k in range(0, 8, 4):
            assert [i // 4 for i in ids[k : k + 4]] == [ids[k] // 4] * 4
            assert ids[k] % 4 == 0
        assert s.probabilities is not None
        assert s.times_sampled is not None


def test_replay_evicts_the_oldest_by_bytes() -> None:
    budget = 4 << 20
    server = echo.Server(example(), 32, sampler=echo.Uniform(), max_size=100_000, max_bytes=budget)
    n = 6000
    for i in range(n):
        server.submit(make(i))
    stats = server.stats()
    assert stats.evicted_total > 0
    assert stats.store_size + stats.evicted_total == n
    assert stats.stored_bytes <= budget
    oldest = n - stats.store_size
    for _ in range(10):
        s = server.sample(timeout=5)
        assert s is not None
        assert min(check_packed(s.batch)) >= oldest


def test_prioritized_replay_follows_priorities() -> None:
    server = echo.Server(example(), 8, sampler=echo.Prioritized(1.0), max_size=64)
    server.submit(make(1, 3), priority=0.0)
    server.submit(make(2, 3), priority=1.0)
    s = server.sample(timeout=5)
    assert s is not None
    assert set(s.batch["id"].tolist()) == {2}
    assert s.keys is not None
    key_of_2 = int(s.keys[0])
    s2 = server.sample(timeout=5)
    assert s2 is not None
    assert server.update_priorities(np.array([key_of_2]), np.array([0.0])) == 0  # 0 skipped
    with pytest.raises(TimeoutError):
        server.sample(timeout=0.05)  # every priority is 0 now
    # A learner waiting for a batch draws as soon as a priority is raised.
    raise_it = threading.Timer(0.3, server.update_priorities, ([key_of_2], [2.0]))
    raise_it.start()
    started = time.monotonic()
    s3 = server.sample(timeout=10)
    raise_it.join()
    assert s3 is not None
    assert set(s3.batch["id"].tolist()) == {2}
    assert time.monotonic() - started < 5


def test_bad_samples_raise_precise_errors_and_store_nothing() -> None:
    server = echo.Server(example(), 4, batch_tokens=500, token_group="tokens")
    with pytest.raises(ValueError, match=r"leaf \['logp'\]: 301 rows, more than its max_len 300"):
        server.submit(make(1, 301))
    bad = make(2, 10)
    bad["logp"] = bad["logp"][:9]
    with pytest.raises(
        ValueError, match=r'"completion": leaf \[.logp.\] has 9 rows but leaf \[.tokens.\] has 10'
    ):
        server.submit(bad)
    with pytest.raises(ValueError, match=r"a group of 2 samples with 520 rows .*batch_tokens 500"):
        server.submit_group([make(3, 260), make(4, 260)])
    with pytest.raises(
        ValueError, match=r"a group of 5 samples is larger than a batch \(batch_size 4\)"
    ):
        server.submit_group([make(i, 1) for i in range(5)])
    with pytest.raises(ValueError, match="at least one sample"):
        server.submit_group([])
    with pytest.raises(TypeError, match=r"\['tokens'\]: expected dtype int32, got int64"):
        server.submit({**make(5, 3), "tokens": np.arange(3)})
    with pytest.raises(ValueError, match="structure differs"):
        server.submit({"tokens": np.arange(3, dtype=np.int32)})
    with pytest.raises(TypeError, match="list of samples"):
        server.submit_group(make(1, 1))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="FIFO table takes no priorities"):
        server.submit(make(6, 3), priority=1.0)
    assert server.stats().store_size == 0
    assert server.stats().raw_bytes == 0


def test_settings_that_do_not_apply_are_refused() -> None:
    with pytest.raises(ValueError, match=r"does not support sequence= yet"):
        echo.Server(example(), 4, sequence=echo.Sequence(length=2))
    with pytest.raises(TypeError, match="TcpTransport or None"):
        echo.Server(example(), 4, transport="tcp://:1234")
    with pytest.raises(ValueError, match="checkpoint_extra needs checkpoint_dir"):
        echo.Server(example(), 4, checkpoint_extra=dict)
    with pytest.raises(ValueError, match="needs max_size"):
        echo.Server(example(), 4, sampler=echo.Uniform())
    with pytest.raises(ValueError, match="several length groups"):
        echo.Server(example(), 4, batch_tokens=100)
    with pytest.raises(ValueError, match="names no length group"):
        echo.Server(example(), 4, batch_tokens=100, token_group="nope")
    with pytest.raises(ValueError, match='layout must be "packed" or "padded"'):
        echo.Server(example(), 4, layout="ragged")
    fixed = {"x": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="no"):
        echo.Server(fixed, 4, batch_tokens=10)
    with echo.Server(fixed, 4) as plain:
        with pytest.raises(ValueError, match=r"echo\.Ragged"):
            plain.submit_group([{"x": np.zeros(3, np.float32)}])
        with pytest.raises(ValueError, match=r"echo\.Ragged"):
            plain.sample(timeout=0.01, layout="padded")
    with pytest.raises(ValueError, match="at least 1"):
        Ragged(0, np.int32)
    with pytest.raises(TypeError, match="tuple of ints"):
        Ragged(4, np.int32, [3])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="max_len 8 but leaf"):
        echo.Server({"a": Ragged(8, np.int32, group="g"), "b": Ragged(9, np.int32, group="g")}, 2)


def test_waits_time_out() -> None:
    server = echo.Server(example(), 2, num_buffers=2)
    with pytest.raises(TimeoutError):
        server.sample(timeout=0.05)
    for i in range(4):
        server.submit(make(i, 1))
    with pytest.raises(TimeoutError, match="no room"):
        server.submit(make(9, 1), timeout=0.05)
    server.close()
    assert server.sample(timeout=1) is None
    with pytest.raises(echo.ServerClosedError):
        server.submit(make(10, 1))


def test_prometheus_counts_what_a_ragged_server_did() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from echo.metrics import EchoCollector

    server = echo.Server(example(), 4, batch_tokens=200, token_group="completion", name="ragged")
    for i in range(10):
        server.submit(make(i, 50))
    got = [server.sample(timeout=5) for _ in range(2)]
    handed = sum(s.num_samples for s in got if s is not None)
    assert handed == 8  # 4 samples of 50 rows fill a budget of 200
    registry = CollectorRegistry()
    registry.register(EchoCollector(server))
    text = generate_latest(registry).decode()
    assert 'echo_samples_sampled_total{server="ragged"} 8.0' in text
    assert 'echo_samples_inserted_total{path="submit",server="ragged"} 10.0' in text
    raw = server.stats().raw_bytes
    # Samples 8 and 9 wait; 4 to 7 are the batch the learner holds: their bytes are in use.
    assert raw == sum(2 * 50 * 4 + 8 + (i % 64) * 4 for i in range(4, 10))
    assert f'echo_raw_bytes{{server="ragged"}} {float(raw)}' in text


@pytest.mark.parametrize("sampler", ["fifo", "prioritized"])
def test_a_checkpoint_restores_every_entry_with_its_priority_and_draws(
    tmp_path: Any, sampler: str
) -> None:
    replay = sampler != "fifo"
    kwargs: dict[str, Any] = (
        {"sampler": echo.Prioritized(1.0), "max_size": 100, "max_times_sampled": 5}
        if replay
        else {"num_buffers": 8}
    )
    server = echo.Server(example(), 4, batch_tokens=900, token_group="completion", **kwargs)
    server.submit_group([make(0, 3), make(1, 4)], **({"priority": 2.0} if replay else {}))
    for i in range(2, 12):
        server.submit(make(i), **({"priority": float(i)} if replay else {}))
    if replay:
        drawn = server.sample(timeout=5)
        assert drawn is not None
    else:
        first = server.sample(timeout=5)  # handed out: not in the checkpoint
        assert first is not None
        handed = {int(i) for i in first.batch["id"]}
    path = tmp_path / "ckpt"
    server.checkpoint(path)
    server.checkpoint(path)  # replaced atomically
    assert (path / "ragged.json").exists()
    assert path.is_symlink()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.ckpt-")]) == 1
    restored = echo.Server.restore(path)
    assert type(restored) is type(server)
    assert restored.batch_tokens == 900
    if replay:
        before, after = server.stats(), restored.stats()
        assert after.store_size == before.store_size == 12
        assert after.raw_bytes == before.raw_bytes
        # Group sizes, priorities and draw counts, entry by entry.
        a = server._buffer.core.export()  # pyright: ignore[reportAttributeAccessIssue]
        b = restored._buffer.core.export()  # pyright: ignore[reportAttributeAccessIssue]
        for k in (0, 2, 3, 4):
            if k == 0:
                for x, y in zip(a[0], b[0], strict=True):
                    np.testing.assert_array_equal(x, y)
            else:
                np.testing.assert_array_equal(a[k], b[k])
        assert a[4].sum() > 0
    else:
        restored.close(drain=True)
        got: list[int] = []
        while (s := restored.sample(timeout=5)) is not None:
            got.extend(check_packed(s.batch))
        assert got == [i for i in range(12) if i not in handed]
    # Values and offsets are plain numpy files.
    tokens = next(i for i, leaf in enumerate(restored.leaf_names) if "tokens" in leaf)
    offsets = np.load(path / f"leaf_{tokens}.offsets.npy")
    values = np.load(path / f"leaf_{tokens}.npy", mmap_mode="r")
    assert offsets[-1] == len(values)
    server.close()
    restored.close()


def test_periodic_checkpoints_of_a_ragged_server(tmp_path: Any) -> None:
    from echo.checkpoint import periodic_checkpoints

    server = echo.Server(
        example(), 4, sampler=echo.Uniform(), max_size=50, checkpoint_dir=tmp_path,
        checkpoint_every=0.05,
    )  # fmt: skip
    for i in range(20):
        server.submit(make(i))

    wait_for_ragged_checkpoint(tmp_path, 20, timeout=20)
    server.close()
    restored = echo.Server.restore(periodic_checkpoints(tmp_path)[-1])
    assert restored.stats().store_size == 20
    restored.close()


def test_the_learners_state_goes_with_a_ragged_checkpoint_and_comes_back(tmp_path: Any) -> None:
    from echo.checkpoint import periodic_checkpoints, read_extra

    server = echo.Server(example(), 4, sampler=echo.Uniform(), max_size=50)
    server.submit_group([make(0, 3), make(1, 4)])
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    extra = {"params": {"w": weights}, "step": np.int64(1200), "lr": 3e-4, "tag": ("a", None)}
    path = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=r"extra\['bad'\]"):
        server.checkpoint(path, extra={"bad": object()})
    assert not path.exists(), "nothing is written for an extra that cannot be"
    server.checkpoint(path, extra=extra)
    for got in (read_extra(path), echo.Server.restore(path).restored_extra):
        np.testing.assert_array_equal(got["params"]["w"], weights)
        assert got["params"]["w"].dtype == np.float32
        assert (got["step"], type(got["step"])) == (1200, np.int64)
        assert (got["lr"], got["tag"]) == (3e-4, ("a", None))
    server.checkpoint(path)  # replaced by one without an extra
    assert read_extra(path) is None
    server.close()
    # Periodic checkpoints take the learner's state from `checkpoint_extra`.
    step = iter(range(1_000_000))
    periodic = echo.Server(
        example(), 4, sampler=echo.Uniform(), max_size=50, checkpoint_dir=tmp_path / "p",
        checkpoint_every=0.05, checkpoint_extra=lambda: {"step": next(step)},
    )  # fmt: skip
    periodic.submit(make(3))
    deadline = time.monotonic() + 10
    while not periodic_checkpoints(tmp_path / "p") and time.monotonic() < deadline:
        time.sleep(0.02)
    periodic.close()
    restored = echo.Server.restore(periodic_checkpoints(tmp_path / "p")[-1])
    assert isinstance(restored.restored_extra["step"], int)
    restored.close()


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_compressed_ragged_leaves_come_back_bit_for_bit(tmp_path: Any, layout: str) -> None:
    server = echo.Server(
        example(), 8, sampler=echo.Uniform(), max_size=200, seed=1, layout=layout,
        compress={"tokens": echo.Zstd(1), "prompt": echo.Lz4()},
    )  # fmt: skip
    assert set(server.compress) == {"tokens", "prompt"}  # by path, as any server's
    for i in range(100):
        server.submit(make(i))
    stats = server.stats()
    assert stats.raw_bytes == sum(2 * 4 * length_of(i) + 8 + 4 * (i % 64) for i in range(100))
    for _ in range(5):
        s = server.sample(timeout=5)
        assert s is not None
        if layout == "packed":
            check_packed(s.batch)
        else:
            tokens = s.batch["tokens"]
            for k, i in enumerate(int(x) for x in s.batch["id"]):
                n = int(tokens.lengths[k])
                assert n == length_of(i)
                np.testing.assert_array_equal(tokens.values[k, :n], i * 1000 + np.arange(n))
                assert not tokens.values[k, n:].any()
    path = tmp_path / "ckpt"
    server.checkpoint(path)
    restored = echo.Server.restore(path)
    assert restored.compress == server.compress
    assert restored.stats().raw_bytes == stats.raw_bytes
    s = restored.sample(timeout=5, layout="packed")
    assert s is not None
    check_packed(s.batch)
    with pytest.raises(ValueError, match="names no leaf"):
        echo.Server(example(), 4, compress={"nope": echo.Lz4()})
    with pytest.raises(ValueError, match=r"leaf \['logp'\] is float32.*Lz4\(force=True\)"):
        echo.Server(example(), 4, compress={"logp": echo.Lz4()})
    # One codec for every ragged leaf: the floating-point ones only with force=True.
    assert set(echo.Server(example(), 4, compress=echo.Lz4()).compress) == {"prompt", "tokens"}
    assert "logp" in echo.Server(example(), 4, compress=echo.Lz4(force=True)).compress
    server.close()
    restored.close()


def test_the_constructors_signatures_are_their_arguments() -> None:
    # `Server.__new__` and `TcpClient.__new__` only pick the class (ragged or not): what
    # inspect shows (help(), IDEs, code checking for an argument) is still `__init__`'s.
    import inspect

    assert "shared_memory" in inspect.signature(echo.TcpClient).parameters
    assert "batch_tokens" in inspect.signature(echo.Server).parameters
    assert list(inspect.signature(echo.Server).parameters)[:2] == ["example", "batch_size"]


def test_a_damaged_ragged_checkpoint_is_refused_naming_the_file(tmp_path: Any) -> None:
    """Every file's size and SHA-256 is in `ragged.json` and checked before anything is
    loaded: a flipped byte, a truncated file or a missing one raises `CheckpointError` naming
    it, for a restore and for reading the extra alone; the intact checkpoint restores."""
    import json
    import shutil

    from echo import checkpoint as ckpt

    server = echo.Server(example(), 4, sampler=echo.Uniform(), max_size=100)
    for i in range(20):
        server.submit(make(i))
    server.publish({"w": np.arange(8, dtype=np.float32)})
    server.checkpoint(tmp_path / "ckpt", extra={"step": 3, "opt": np.ones(4)})
    server.close()
    good = tmp_path / "ckpt"
    files = json.loads((good / "ragged.json").read_text())["files"]
    assert {"leaf_1.npy", "leaf_1.offsets.npy", "extra.json", "group_sizes.npy"} <= set(files)
    assert all(len(entry["sha256"]) == 64 for entry in files.values())

    def damaged(name: str, how: str) -> Path:
        copy = tmp_path / f"{how}-{name}"
        shutil.copytree(good.resolve(), copy)
        target = copy / name
        data = bytearray(target.read_bytes())
        if how == "flip":
            data[-3] ^= 0x40  # a value, not the header: np.load alone would not notice
            target.write_bytes(bytes(data))
        elif how == "truncate":
            target.write_bytes(bytes(data[:-4]))
        else:
            target.unlink()
        return copy

    with pytest.raises(CheckpointError, match=r"leaf_2\.npy: SHA-256 \w+ differs .*corrupted"):
        echo.Server.restore(damaged("leaf_2.npy", "flip"))
    with pytest.raises(CheckpointError, match=r"offsets\.npy: \d+ bytes, the manifest says"):
        echo.Server.restore(damaged("leaf_1.offsets.npy", "truncate"))
    with pytest.raises(CheckpointError, match=r"priorities\.npy: missing"):
        echo.Server.restore(damaged("priorities.npy", "remove"))
    extra = damaged("extra_000.npy", "flip")
    with pytest.raises(CheckpointError, match=r"extra_000\.npy: SHA-256"):
        ckpt.read_extra(extra)
    with pytest.raises(CheckpointError, match=r"extra_000\.npy: SHA-256"):
        ckpt.read_params(extra)
    with pytest.raises(CheckpointError, match=r"extra_000\.npy: SHA-256"):
        echo.Server.restore(extra)
    # A damaged data file does not stop reading the extra alone.
    assert ckpt.read_extra(damaged("leaf_0.npy", "flip"))["step"] == 3
    restored = echo.Server.restore(good)
    assert restored.stats().store_size == 20
    restored.close()


def test_a_checkpoint_keeps_numpy_int_settings_a_forced_codec_and_the_seed(
    tmp_path: Path,
) -> None:
    ex = {"lp": Ragged(8, np.float32), "id": np.zeros((), np.int64)}
    server = echo.Server(
        ex, np.int64(2), sampler=echo.Uniform(), max_size=np.int64(10), seed=np.int64(7),
        compress={"lp": echo.Lz4(force=True)}, pad_to_multiple=np.int32(2),
    )  # fmt: skip
    assert type(server.batch_size) is int
    for i in range(4):
        server.submit({"lp": np.full(i + 1, i, np.float32), "id": np.int64(i)})
    server.checkpoint(tmp_path / "ckpt")
    settings = json.loads((tmp_path / "ckpt" / "ragged.json").read_text())["settings"]
    assert (settings["batch_size"], settings["max_size"], settings["seed"]) == (2, 10, 7)
    with echo.Server.restore(tmp_path / "ckpt") as restored:
        assert restored.compress == server.compress
        assert restored.stats().store_size == 4
        s = restored.sample(timeout=5)
        assert s is not None
        packed = s.batch["lp"]
        rows = np.split(packed.values, packed.cu_seqlens[1:-1])
        for i, values in zip(s.batch["id"], rows, strict=True):
            assert values.tolist() == [float(i)] * (int(i) + 1)
    server.close()
