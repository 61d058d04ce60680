"""Sequence tables in-process: steps of streams in, windows of one episode out.

Every step carries a unique id (`stream * 10**6 + episode * 10**3 + index`) in its `id` leaf and
in every element of its `obs`, so a test can check that a window is consecutive steps of one
episode of one stream, in order, uncorrupted, and that its mask, start and flags say so.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import echo

Window = tuple[int, int, list[int]]
WAIT_S = 10.0
STEP = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}


def step(stream: int, episode: int, index: int) -> dict[str, np.ndarray]:
    uid = stream * 10**6 + episode * 10**3 + index
    return {"id": np.array(uid, np.int64), "obs": np.full(3, uid, np.float32)}


def server(length: int, **kwargs: Any) -> echo.Server:
    seq = echo.Sequence(
        length,
        period=kwargs.pop("period", None),
        at_end=kwargs.pop("at_end", "pad"),
        max_streams=kwargs.pop("max_streams", 4096),
    )
    kwargs.setdefault("max_size", 10_000)
    kwargs.setdefault("seed", 0)
    return echo.Server(STEP, kwargs.pop("batch_size", 8), sequence=seq, **kwargs)


def windows(sample: echo.Sample) -> list[Window]:
    """`(stream, start, ids of the real steps)` of every window, each checked: real steps
    first and consecutive within one episode, zeros after, metadata consistent."""
    ids = sample.batch["id"]
    obs = sample.batch["obs"]
    mask, start, stream = sample.mask, sample.start, sample.stream
    assert mask is not None
    assert start is not None
    assert stream is not None
    out: list[Window] = []
    for w in range(ids.shape[0]):
        real = int(mask[w].sum())
        assert mask[w, :real].all(), mask[w]
        assert not mask[w, real:].any(), mask[w]
        got = [int(x) for x in ids[w, :real]]
        expected_obs = np.repeat(ids[w, :real, None], 3, 1).astype(np.float32)
        np.testing.assert_array_equal(obs[w, :real], expected_obs)
        assert not ids[w, real:].any(), "padding is zeros"
        assert not obs[w, real:].any(), "padding is zeros"
        assert got == list(range(got[0], got[0] + real)), got
        assert got[0] // 10**6 == int(stream[w])
        assert got[0] % 10**3 == int(start[w])
        assert len({g // 10**3 for g in got}) == 1, f"one episode: {got}"
        out.append((int(stream[w]), int(start[w]), got))
    return out


def drain(s: echo.Server) -> list[Window]:
    """Every window of a LIFO, `max_times_sampled=1` server with `batch_size=1`, once."""
    out: list[Window] = []
    while s.stats().store_size:
        got = s.sample(timeout=5)
        assert got is not None
        out += windows(got)
    return sorted(out)


def lifo(length: int, **kwargs: Any) -> echo.Server:
    return server(length, sampler=echo.Lifo(), max_times_sampled=1, batch_size=1, **kwargs)


@pytest.mark.parametrize(
    ("at_end", "expected"),
    [
        ("pad", [(0, 4), (2, 4), (4, 3), (6, 1)]),
        ("shift", [(0, 4), (2, 4), (3, 4)]),
        ("drop", [(0, 4), (2, 4)]),
    ],
)
def test_each_at_end_mode_cuts_the_windows_it_says(
    at_end: str, expected: list[tuple[int, int]]
) -> None:
    s = lifo(4, period=2, at_end=at_end)
    for i in range(7):
        s.submit(step(5, 0, i), stream=5, end_episode=i == 6)
    got = drain(s)
    assert [(start, len(ids)) for _, start, ids in got] == expected
    assert all(stream == 5 for stream, _, _ in got)


def test_batches_are_windows_with_their_metadata() -> None:
    s = server(4, at_end="pad", batch_size=6)
    for i in range(10):
        s.submit(step(1, 0, i), stream=1, truncated=i == 9)
    got = s.sample(timeout=5)
    assert got is not None
    assert got.batch["id"].shape == (6, 4)
    assert got.batch["obs"].shape == (6, 4, 3)
    assert got.batch["obs"].dtype == np.float32
    assert got.mask is not None
    assert got.mask.shape == (6, 4)
    assert got.mask.dtype == np.bool_
    assert got.truncated is not None
    assert got.terminated is not None
    assert got.truncated.all(), "the episode was truncated"
    assert not got.terminated.any()
    assert got.episode is not None
    assert (got.episode == got.episode[0]).all()
    assert got.keys is not None
    assert got.keys.dtype == np.uint64
    assert got.info.keys is got.keys, "info carries the per-window arrays too"
    windows(got)
    with pytest.raises(ValueError, match="read-only"):
        got.batch["id"][0, 0] = 1
    copied = s.sample(timeout=5, copy=True)
    assert copied is not None
    assert copied.batch["id"].flags.writeable


def test_interleaved_streams_never_mix_and_every_window_arrives() -> None:
    rng = np.random.default_rng(7)
    s = lifo(5, period=3, at_end="shift")
    lengths = {k: [int(n) for n in rng.integers(1, 14, size=4)] for k in range(6)}
    todo = {
        k: [(e, i, i + 1 == n) for e, n in enumerate(ls) for i in range(n)]
        for k, ls in lengths.items()
    }
    while any(todo.values()):
        k = int(rng.choice([k for k, v in todo.items() if v]))
        e, i, last = todo[k].pop(0)
        s.submit(step(k, e, i), stream=k, end_episode=last)
    got = drain(s)
    expected: list[Window] = []
    for k, ls in lengths.items():
        for e, n in enumerate(ls):
            starts = [(st, 5) for st in range(0, n, 3) if st + 5 <= n]
            if any(st + 5 > n for st in range(0, n, 3)):
                shifted = max(0, n - 5)
                if shifted not in [st for st, _ in starts]:
                    starts.append((shifted, n - shifted))
            for st, real in starts:
                first = k * 10**6 + e * 10**3 + st
                expected.append((k, st, list(range(first, first + real))))
    assert got == sorted(expected)


def test_a_vector_env_is_one_stream_per_row_with_per_row_episode_ends() -> None:
    n_envs = 4
    s = lifo(3, at_end="drop", max_streams=64)
    # Env e ends an episode every e + 3 steps; env 1's are truncated (a time limit).
    episode, index = [0] * n_envs, [0] * n_envs
    for _ in range(24):
        uid = [10 + e for e in range(n_envs)]
        ids = np.array([(10 + e) * 10**6 + episode[e] * 10**3 + index[e] for e in range(n_envs)])
        ends = np.array([index[e] + 1 == e + 3 for e in range(n_envs)])
        cut = ends & (np.arange(n_envs) == 1)
        batch = {"id": ids, "obs": np.repeat(ids[:, None], 3, 1).astype(np.float32)}
        assert s.submit_batch(batch, stream=10, end_episode=ends & ~cut, truncated=cut) == n_envs
        for e in range(n_envs):
            index[e] += 1
            if ends[e]:
                episode[e], index[e] = episode[e] + 1, 0
        assert uid
    got = drain(s)
    by_stream = {k: [w for w in got if w[0] == k] for k in range(10, 14)}
    for e in range(n_envs):
        # Episodes of e + 3 steps, windows of 3 every 3, drop: one window per full episode
        # starting at 0, plus one more for episodes of 6 steps.
        per_episode = len(range(0, e + 3 - 2, 3))
        assert len(by_stream[10 + e]) == per_episode * (24 // (e + 3)) + (
            1 if 24 % (e + 3) >= 3 else 0
        ), (e, by_stream[10 + e])
    stats = s.stats()
    assert stats.streams_open == sum(1 for e in range(n_envs) if 24 % (e + 3))
    assert stats.episodes_ended_total == sum(24 // (e + 3) for e in range(n_envs))


def test_eviction_with_an_odd_max_size_under_concurrent_inserts_and_samples() -> None:
    s = server(6, period=2, at_end="pad", max_size=211, batch_size=16)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for n in range(6000):
                e, i = divmod(n, 17)
                s.submit(step(k, e % 1000, i), stream=k, end_episode=i == 16)
        except BaseException as err:  # noqa: BLE001 -- reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    batches = 0
    while any(t.is_alive() for t in threads) or batches < 20:
        got = s.sample(timeout=10)
        assert got is not None
        windows(got)
        batches += 1
    for t in threads:
        t.join(10)
    stop.set()
    assert not errors, errors
    stats = s.stats()
    assert stats.steps_stored <= 211
    assert stats.steps_inserted_total == 18_000
    assert stats.windows_evicted_total > 0
    assert stats.steps_evicted_total > 0


def test_prioritized_windows_follow_their_priorities() -> None:
    s = server(2, sampler=echo.Prioritized(1.0), batch_size=64, seed=11)
    # Four episodes of two steps: one window each, priorities 1, 2, 3, 4 from the steps.
    for k in range(4):
        for i in range(2):
            s.submit(step(k, 0, i), stream=k, end_episode=i == 1, priority=float(k + 1))
    counts = np.zeros(4)
    for _ in range(300):
        got = s.sample(timeout=5)
        assert got is not None
        assert got.stream is not None
        counts += np.bincount(got.stream.astype(np.int64), minlength=4)
    expected = counts.sum() * np.arange(1, 5) / 10
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 16.3, (counts, expected)  # 3 degrees of freedom, 0.1% critical value


def test_update_priorities_on_windows_and_on_evicted_keys() -> None:
    s = server(2, max_size=8, batch_size=4)
    for i in range(2):
        s.submit(step(0, 0, i))
    got = s.sample(timeout=5)
    assert got is not None
    assert got.keys is not None
    key = int(got.keys[0])
    assert s.update_priorities([key], [5.0]) == 0
    for i in range(2, 40):
        s.submit(step(0, 0, i))
    assert s.update_priorities([key], [7.0]) == 1, "its steps are evicted"
    assert s.stats().unknown_keys_total == 1
    assert s.stats().priority_updates_total == 1


def test_a_new_window_gets_the_largest_priority_of_its_steps() -> None:
    s = server(3, sampler=echo.Prioritized(1.0), batch_size=1)
    for i, p in enumerate([0.5, None, 2.5]):
        s.submit(step(0, 0, i), priority=p)
    got = s.sample(timeout=5)
    assert got is not None
    assert got.keys is not None
    assert s._core.priority(int(got.keys[0])) == 2.5  # pyright: ignore[reportPrivateUsage]


def test_rate_limiters_and_max_times_sampled_count_windows() -> None:
    s = server(2, rate_limiter=echo.Queue(2), batch_size=1)
    # Windows of 2, one every 2 steps: 4 steps make the 2 windows the queue allows.
    for i in range(4):
        s.submit(step(0, 0, i))
    stats = s.stats()
    assert (stats.store_size, stats.windows_stored, stats.steps_stored) == (2, 2, 4)
    with pytest.raises(TimeoutError):
        s.submit(step(0, 0, 4), timeout=0.05)  # two windows unsampled: the queue is full
    assert s.stats().steps_inserted_total == 4, "the held step was not written"
    assert s.sample(timeout=5) is not None
    s.submit(step(0, 0, 4), timeout=5)  # a sampled window made room
    limited = server(1, max_times_sampled=2, batch_size=1)
    limited.submit(step(0, 0, 0))
    for _ in range(2):
        assert limited.sample(timeout=5) is not None
    assert (limited.stats().store_size, limited.stats().windows_stored) == (0, 0)
    assert limited.stats().removed_max_times_sampled_total == 1


def test_end_episode_truncates_a_gone_stream_and_keeps_its_windows() -> None:
    s = lifo(3, at_end="pad")
    for i in range(4):
        s.submit(step(2, 0, i), stream=2)
    assert s.stats().store_size == 1
    assert s.stats().streams_open == 1
    assert s.end_episode(2) is True
    assert s.end_episode(2) is False, "no open episode any more"
    got = s.sample(timeout=5)
    assert got is not None
    assert got.truncated is not None
    assert got.truncated.all()
    stats = s.stats()
    assert (stats.streams_open, stats.episodes_ended_total) == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"length": 0}, ValueError, r"Sequence\(length\) must be in \[1, "),
        ({"length": 4, "period": 0}, ValueError, r"Sequence\(period\) must be in \[1, "),
        ({"length": 2.5}, TypeError, r"Sequence\(length\) must be an int, got float"),
        ({"length": 4, "at_end": "wrap"}, ValueError, "must be 'pad', 'shift' or 'drop'"),
        ({"length": 4, "max_streams": 0}, ValueError, r"Sequence\(max_streams\)"),
    ],
)
def test_bad_sequence_settings_raise_precise_errors(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        echo.Sequence(**kwargs)


def test_bad_server_arguments_raise_precise_errors() -> None:
    seq = echo.Sequence(4)
    with pytest.raises(
        ValueError, match=r"sequence= needs a replay sampler .*got sampler=Fifo\(\)"
    ):
        echo.Server(STEP, 4, sequence=seq, sampler=echo.Fifo(), max_size=100)
    with pytest.raises(ValueError, match="max_size is required"):
        echo.Server(STEP, 4, sequence=seq)
    with pytest.raises(ValueError, match=r">= length \(4\), got 3"):
        echo.Server(STEP, 4, sequence=seq, max_size=3)
    with pytest.raises(ValueError, match="remover=MinPriority"):
        echo.Server(STEP, 4, sequence=seq, max_size=100, remover=echo.MinPriority())
    with pytest.raises(TypeError, match=r"sequence must be an echo\.Sequence"):
        echo.Server(STEP, 4, sequence=4, max_size=100)  # pyright: ignore[reportArgumentType]


def test_bad_steps_raise_precise_errors_and_write_nothing() -> None:
    s = server(2, max_streams=8)
    with pytest.raises(ValueError, match=r"stream 8 out of range: in-process streams are 0 to 7"):
        s.submit(step(0, 0, 0), stream=8)
    with pytest.raises(ValueError, match=r"stream must be >= 0, got -1"):
        s.submit(step(0, 0, 0), stream=-1)
    # Beyond 64 bits: the same message, naming the argument and its range (not OverflowError).
    beyond = r"stream 1180591620717411303424 out of range: in-process streams are 0 to 7"
    with pytest.raises(ValueError, match=beyond):
        s.submit(step(0, 0, 0), stream=2**70)
    with pytest.raises(ValueError, match=beyond):
        s.submit_batch(
            {"id": np.zeros(1, np.int64), "obs": np.zeros((1, 3), np.float32)}, stream=2**70
        )
    with pytest.raises(ValueError, match=beyond):
        s.end_episode(2**70)
    with pytest.raises(ValueError, match=r"stream 18446744073709551615 out of range"):
        s.submit(step(0, 0, 0), stream=2**64 - 1)
    with pytest.raises(ValueError, match=r"streams 6 to 8 \(one per row\) out of range"):
        s.submit_batch({"id": np.zeros(3, np.int64), "obs": np.zeros((3, 3), np.float32)}, stream=6)
    with pytest.raises(TypeError, match="end_episode must be a bool"):
        s.submit(step(0, 0, 0), end_episode=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="end_episode must be a bool or an array of bools"):
        s.submit_batch(
            {"id": np.zeros(2, np.int64), "obs": np.zeros((2, 3), np.float32)},
            end_episode=np.array([0, 1]),
        )
    with pytest.raises(ValueError, match=r"one bool or one per row \(2,\), got shape \(3,\)"):
        s.submit_batch(
            {"id": np.zeros(2, np.int64), "obs": np.zeros((2, 3), np.float32)},
            end_episode=np.array([True, False, True]),
        )
    with pytest.raises(ValueError, match="structure"):
        s.submit({"id": np.zeros((), np.int64)}, stream=0)
    with pytest.raises(TypeError, match="dtype"):
        s.submit({"id": np.zeros((), np.int32), "obs": np.zeros(3, np.float32)}, stream=0)
    assert s.stats().steps_inserted_total == 0
    assert s.stats().streams_open == 0


def test_episode_arguments_need_a_sequence_table() -> None:
    for s in (echo.Server(STEP, 2), echo.Server(STEP, 2, sampler=echo.Uniform(), max_size=10)):
        with pytest.raises(ValueError, match=r"end_episode=/truncated= needs a sequence table"):
            s.submit(step(0, 0, 0), end_episode=True)
        with pytest.raises(ValueError, match=r"stream= needs a sequence table"):
            s.submit(step(0, 0, 0), stream=1)
        with pytest.raises(ValueError, match="needs a sequence table"):
            s.submit_batch(
                {"id": np.zeros(1, np.int64), "obs": np.zeros((1, 3), np.float32)},
                truncated=np.array([True]),
            )
        with pytest.raises(ValueError, match="needs a sequence table"):
            s.end_episode(0)


def _ops(s: echo.Server, first: int, last: int) -> None:
    """Steps `first..last` of a fixed schedule: streams 0-3, episodes of 3 + (k + e) % 6 steps,
    some truncated; whatever is open at `last` stays open."""
    for n in range(first, last):
        k = n % 4
        e, i = divmod(n // 4, 9)
        length = 3 + (k + e) % 6
        if i >= length:
            continue
        s.submit(
            step(k, e, i),
            stream=k,
            end_episode=i + 1 == length,
            truncated=i + 1 == length and e % 3 == 2,
        )


@pytest.mark.parametrize("at_end", ["pad", "shift", "drop"])
def test_a_checkpoint_restores_open_episodes_which_go_on(at_end: str, tmp_path: Any) -> None:
    def new() -> echo.Server:
        return lifo(4, period=2, at_end=at_end, max_size=97)

    checkpointed, reference = new(), new()
    _ops(checkpointed, 0, 301)
    _ops(reference, 0, 301)
    before = checkpointed.stats()
    assert before.streams_open > 0, "open episodes cross the checkpoint"
    checkpointed.checkpoint(tmp_path / "ckpt")
    _ops(checkpointed, 301, 500)  # the checkpoint is of the table before these
    restored = echo.Server.restore(tmp_path / "ckpt")
    after = restored.stats()
    assert (after.steps_stored, after.store_size, after.streams_open) == (
        before.steps_stored,
        before.store_size,
        before.streams_open,
    )
    assert restored.sequence == checkpointed.sequence
    assert restored.max_size == 97
    # Both go on alike: the open episodes continue in the restored server.
    _ops(restored, 301, 420)
    _ops(reference, 301, 420)
    got, expected = drain(restored), drain(reference)
    assert got == expected
    assert any(start > 0 for _, start, _ in got)


def test_periodic_checkpoints_cover_sequence_tables(tmp_path: Any) -> None:
    s = server(3, checkpoint_dir=tmp_path, checkpoint_every=0.05, max_size=200)
    for i in range(10):
        s.submit(step(7, 0, i), stream=7)
    deadline = time.monotonic() + 10.0
    while not echo.checkpoint.periodic_checkpoints(tmp_path):
        assert time.monotonic() < deadline, "no periodic checkpoint"
        time.sleep(0.01)
    s.close()
    newest = echo.checkpoint.periodic_checkpoints(tmp_path)[-1]
    restored = echo.Server.restore(newest)
    info = restored.stats()
    assert (info.steps_stored, info.streams_open) == (10, 1)
    restored.submit(step(7, 0, 10), stream=7, end_episode=True)
    got = restored.sample(timeout=5)
    assert got is not None
    windows(got)
    restored.close()


def test_a_checkpoint_of_another_layout_or_a_damaged_one_is_refused(tmp_path: Any) -> None:
    s = server(2)
    for i in range(5):
        s.submit(step(0, 0, i))
    s.checkpoint(tmp_path / "ckpt")
    other = {"id": np.zeros((), np.int64), "obs": np.zeros((4,), np.float32)}
    with pytest.raises(echo.CheckpointError, match="does not match"):
        echo.Server.restore(tmp_path / "ckpt", other)
    data = tmp_path / "ckpt" / "sequence.npy"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(echo.CheckpointError, match="SHA-256"):
        echo.Server.restore(tmp_path / "ckpt")


@pytest.mark.parametrize("producers", [1, 8, 64])
def test_in_process_producers_on_their_own_streams_never_mix(producers: int) -> None:
    """`producers` threads, each submitting episodes of its own stream at once; every window
    handed out is whole and one stream's, and every window the episodes give arrives."""
    s = lifo(3, period=2, at_end="pad", max_streams=64)
    lengths = {k: [2 + (k + e) % 5 for e in range(3)] for k in range(producers)}
    errors: list[BaseException] = []

    def produce(k: int) -> None:
        try:
            for e, n in enumerate(lengths[k]):
                for i in range(n):
                    s.submit(step(k, e, i), stream=k, end_episode=i + 1 == n, timeout=WAIT_S)
        except BaseException as err:  # noqa: BLE001 -- reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    assert s.stats().streams_open == 0
    got = drain(s)
    expected: list[Window] = []
    for k, ns in lengths.items():
        for e, n in enumerate(ns):
            for st in range(0, n, 2):
                real = min(3, n - st)
                first = k * 10**6 + e * 10**3 + st
                expected.append((k, st, list(range(first, first + real))))
    assert got == sorted(expected)
