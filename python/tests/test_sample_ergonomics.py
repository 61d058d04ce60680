"""What a new user trips over (issue #15): `repr(sample)`, unpacking a replay sample, a
`sample()` held back by the rate limiter, pickling `SampleInfo` / `HistSnapshot` (for a
logger process or a Ray actor), and `dataset_iter(timeout=...)`.
"""

from __future__ import annotations

import multiprocessing
import pickle
import re
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, take

import echo
from echo import _echo

HIST_FIELDS = ["count", "min_ns", "max_ns", "mean_ns", "p50_ns", "p90_ns", "p99_ns"]
HISTOGRAMS = ["drain_round", "memcpy", "queue_dwell"]
REPLAY_ARRAYS = ["keys", "probabilities", "times_sampled"]
# Every public attribute of SampleInfo, so a field added later is compared too.
INFO_FIELDS = sorted(
    name for name in dir(echo.SampleInfo) if not name.startswith("_") and name != "as_dict"
)
# Computed from the counters (raw_bytes / stored_bytes), not stored: compared, never set.
DERIVED = ["compression_ratio"]
COUNTERS = [
    n for n in INFO_FIELDS if n not in HISTOGRAMS and n not in REPLAY_ARRAYS and n not in DERIVED
]
FIFO_TIMEOUT = "sample(): no full batch arrived before the timeout"


def _replay(make_server: Any, make_sample: Any, n: int, **kwargs: Any) -> echo.Server:
    kwargs.setdefault("sampler", echo.Uniform())
    kwargs.setdefault("max_size", 16)
    server = make_server(**kwargs)
    for i in range(n):
        server.submit(make_sample(i), timeout=0)
    return server


def _assert_same_hist(got: echo.HistSnapshot, want: echo.HistSnapshot) -> None:
    assert type(got) is echo.HistSnapshot
    for field in HIST_FIELDS:
        assert getattr(got, field) == getattr(want, field), field


def _assert_same_info(got: echo.SampleInfo, want: echo.SampleInfo) -> None:
    """Field by field: every counter, every histogram field, the replay arrays (values and
    dtypes, or both `None`)."""
    assert type(got) is echo.SampleInfo
    for field in COUNTERS:
        assert getattr(got, field) == getattr(want, field), field
    for field in HISTOGRAMS:
        _assert_same_hist(getattr(got, field), getattr(want, field))
    for field in REPLAY_ARRAYS:
        got_array, want_array = getattr(got, field), getattr(want, field)
        if want_array is None:
            assert got_array is None, field
        else:
            assert got_array.dtype == want_array.dtype, field
            np.testing.assert_array_equal(got_array, want_array)


def _round_trip_in_child(info: echo.SampleInfo) -> tuple[echo.SampleInfo, dict[str, Any]]:
    """Runs in a spawned process: unpickles `info` and sends it (and its dict) back."""
    return info, info.as_dict()


# --- repr -----------------------------------------------------------------------------------


def test_a_fifo_sample_repr_shows_dtypes_shapes_and_sequence_not_contents(
    make_server: Any,
) -> None:
    example = {"obs": {"pixels": np.zeros((84, 84), np.uint8)}, "reward": np.zeros((), np.float32)}
    server = make_server(example, batch_size=64)
    for _ in range(128):
        server.submit(example)
    take(server)
    sample = take(server)
    assert repr(sample) == (
        "Sample(sequence=1, batch={'obs': {'pixels': uint8[64, 84, 84]}, 'reward': float32[64]})"
    )


def test_a_replay_sample_repr_summarises_keys_probabilities_and_times_sampled(
    make_server: Any, make_sample: Any
) -> None:
    # Lifo hands out the newest items, newest first: keys 5, 4, 3, 2 with probability 1.
    server = _replay(make_server, make_sample, 6, sampler=echo.Lifo())
    sample = take(server)
    np.testing.assert_array_equal(sample.keys, [5, 4, 3, 2])
    assert repr(sample) == (
        "Sample(sequence=0, batch={'id': int64[4], 'obs': float32[4, 3]}, "
        "keys=uint64[4] 2..5, probabilities=float64[4] 1..1, times_sampled=uint32[4] 1..1)"
    )


def test_a_sample_repr_never_raises_on_what_a_user_built() -> None:
    assert repr(echo.Sample([1, "x"], None)) == "Sample(sequence=?, batch=[int, str])"  # type: ignore[arg-type]


# --- unpacking ------------------------------------------------------------------------------


def test_a_fifo_sample_unpacks_into_batch_and_info_as_before(
    make_filled: Any,
) -> None:
    server = make_filled(2, batch_size=2)
    sample = take(server)
    batch, info = sample  # filterwarnings=error: no warning either
    assert len(sample) == 2
    assert tuple(sample) == (sample.batch, sample.info)
    assert batch is sample.batch
    assert info is sample.info
    assert (sample.keys, sample.probabilities, sample.times_sampled) == (None, None, None)
    assert (info.keys, info.probabilities, info.times_sampled) == (None, None, None)


def test_unpacking_a_replay_sample_keeps_keys_probabilities_and_times_sampled_in_info(
    make_server: Any, make_sample: Any
) -> None:
    server = _replay(make_server, make_sample, 4, sampler=echo.Prioritized(1.0), seed=7)
    sample = take(server)
    batch, info = sample
    assert len(sample) == 2
    assert info.keys is sample.keys
    assert info.probabilities is sample.probabilities
    assert info.times_sampled is sample.times_sampled
    assert info.keys is not None
    assert info.keys.dtype == np.uint64
    np.testing.assert_array_equal(info.keys, batch["id"])  # keys are insertion numbers
    assert info.probabilities is not None
    np.testing.assert_allclose(info.probabilities, np.full(4, 0.25))
    # The keys from `info` drive priority updates as `sample.keys` do.
    assert server.update_priorities(info.keys, np.full(4, 2.0)) == 0
    for key in info.keys:
        assert server._core.priority(int(key)) == 2.0  # pyright: ignore[reportPrivateUsage]
    # The counters without a batch have no per-item arrays, and as_dict holds counters only.
    stats = server.stats()
    assert (stats.keys, stats.probabilities, stats.times_sampled) == (None, None, None)
    assert not set(REPLAY_ARRAYS) & set(info.as_dict())


# --- timeouts that name the rate limiter ----------------------------------------------------


def test_a_fifo_sample_timeout_keeps_its_message(make_server: Any) -> None:
    server = make_server()
    with pytest.raises(TimeoutError, match=f"^{re.escape(FIFO_TIMEOUT)}$"):
        server.sample(timeout=0.01)


@pytest.mark.parametrize(
    ("limiter", "items", "why"),
    [
        (
            echo.MinSize(5),
            2,
            "the rate limiter MinSize(min_size=5) holds sampling back (inserts=2, samples=0, "
            "table size 2): sampling starts once the table holds 5 items",
        ),
        (
            echo.SampleToInsertRatio(1.0, 1, 2.0),
            1,
            # The window is [-1, 3]: one insert allows 2 draws of the batch's 4.
            "the rate limiter SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, "
            "error_buffer=2.0) holds sampling back (inserts=1, samples=2, table size 1): "
            "inserts * samples_per_insert - samples = -1.0 and a sample may not take it below "
            "min_diff = -1.0; each insert allows 1.0 more samples (2 of the batch's 4 items are "
            "drawn and kept for the next call)",
        ),
        (
            echo.Queue(2),
            1,
            "the rate limiter Queue(size=2) holds sampling back (inserts=1, samples=1, queue size "
            "2): every inserted item was sampled; each insert allows one more sample (1 of the "
            "batch's 4 items are drawn and kept for the next call)",
        ),
    ],
)
def test_a_rate_limited_sample_timeout_names_the_limiter_and_its_counters(
    make_server: Any, make_sample: Any, limiter: Any, items: int, why: str
) -> None:
    server = _replay(make_server, make_sample, items, rate_limiter=limiter)
    with pytest.raises(TimeoutError) as caught:
        server.sample(timeout=0.05)
    assert str(caught.value) == f"{FIFO_TIMEOUT}: {why}"
    assert repr(limiter) in str(caught.value)


def test_a_sample_timeout_on_an_empty_table_points_at_the_producer(make_server: Any) -> None:
    server = make_server(sampler=echo.Uniform(), max_size=8)
    with pytest.raises(TimeoutError) as caught:
        server.sample(timeout=0.01)
    assert str(caught.value) == (
        f"{FIFO_TIMEOUT}: the replay table holds no item to sample (inserts=0, samples=0, rate "
        "limiter MinSize(min_size=1)): nothing was inserted yet; is a producer running?"
    )


def test_a_sample_timeout_after_max_times_sampled_says_the_items_were_removed(
    make_server: Any, make_sample: Any
) -> None:
    server = _replay(make_server, make_sample, 2, batch_size=2, max_times_sampled=1)
    take(server)
    with pytest.raises(TimeoutError) as caught:
        server.sample(timeout=0.01)
    assert str(caught.value).endswith(
        "(inserts=2, samples=2, rate limiter MinSize(min_size=1)): every item inserted so far "
        "was removed (max_times_sampled) or evicted"
    )


def test_a_partly_drawn_batch_survives_the_timeout(make_server: Any, make_sample: Any) -> None:
    # Lifo draws the newest items: item 0 first, then (after the inserts) 3, 2, 1.
    server = _replay(make_server, make_sample, 1, sampler=echo.Lifo(), rate_limiter=echo.Queue(4))
    with pytest.raises(TimeoutError, match="1 of the batch's 4 items are drawn"):
        server.sample(timeout=0.01)
    for i in range(1, 4):
        server.submit(make_sample(i), timeout=0)
    assert [int(i) for i in take(server).batch["id"]] == [0, 3, 2, 1]


SUBMIT_TIMEOUT = "submit(): timed out waiting for space (or for the rate limiter)"
RATIO = echo.SampleToInsertRatio(4.0, 8, 6.0)
RATIO_REPR = "SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=8, error_buffer=6.0)"


def test_a_prefill_that_outruns_the_limiter_says_where_it_stops(
    make_server: Any, make_sample: Any
) -> None:
    # max_diff = 8 * 4 + 6 = 38: without a sample, the 9th insert would take the diff to 40.
    server = _replay(make_server, make_sample, 9, rate_limiter=RATIO, max_size=64)
    with pytest.raises(TimeoutError) as caught:
        server.submit(make_sample(9), timeout=0.01)
    assert str(caught.value) == (
        f"{SUBMIT_TIMEOUT}: the rate limiter {RATIO_REPR} holds inserts back (inserts=9, "
        "samples=0, table size 9): inserts * samples_per_insert - samples = 36.0 and an insert "
        "may not take it above max_diff = 38.0; each sampled item allows 1 / "
        "samples_per_insert = 0.25 more inserts. Until something samples, no insert goes in: "
        "a prefill that never calls sample() stops at 9 inserts (min_size_to_sample 8 + "
        "error_buffer 6.0 / samples_per_insert 4.0); sample while you insert, or widen "
        "error_buffer"
    )
    take(server)  # 4 samples: the diff falls to 32, and one more insert fits
    server.submit(make_sample(9), timeout=0)


def test_a_submit_batch_timeout_says_how_many_went_in_and_names_the_limiter(
    make_server: Any, make_sample: Any
) -> None:
    server = _replay(make_server, make_sample, 0, rate_limiter=echo.Queue(3), max_size=16)
    rows = {"id": np.arange(5, dtype=np.int64), "obs": np.zeros((5, 3), np.float32)}
    with pytest.raises(TimeoutError) as caught:
        server.submit_batch(rows, timeout=0.01)
    assert str(caught.value) == (
        "submit_batch(): timed out after inserting 3 of the 5 rows (the first 3, in order); "
        "submit the rest again: the rate limiter Queue(size=3) holds inserts back (inserts=3, "
        "samples=0, table size 3): 3 items are inserted and not yet sampled, the most "
        "Queue(size) allows; each sampled item allows one more insert"
    )


def test_a_fifo_submit_timeout_keeps_its_message(make_server: Any, make_sample: Any) -> None:
    server = make_server(num_buffers=2)
    for i in range(8):
        server.submit(make_sample(i), timeout=0)
    with pytest.raises(TimeoutError, match=f"^{re.escape(SUBMIT_TIMEOUT)}$"):
        server.submit(make_sample(8), timeout=0.01)


# --- pickling -------------------------------------------------------------------------------


def test_hist_snapshot_pickles_field_by_field() -> None:
    hist = echo.HistSnapshot(
        count=7, min_ns=10, max_ns=900, mean_ns=123.5, p50_ns=100, p90_ns=700, p99_ns=890
    )
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _assert_same_hist(pickle.loads(pickle.dumps(hist, protocol)), hist)
    assert hist.as_dict() == {
        "count": 7,
        "min_ns": 10,
        "max_ns": 900,
        "mean_ns": 123.5,
        "p50_ns": 100,
        "p90_ns": 700,
        "p99_ns": 890,
    }


def test_every_sample_info_field_survives_pickling() -> None:
    # Distinct values in every field (the server can't produce them all in one test): built
    # through the function unpickling calls, then round-tripped.
    state: dict[str, Any] = {name: 1000 + i for i, name in enumerate(COUNTERS)}
    for i, name in enumerate(HISTOGRAMS):
        state[name] = echo.HistSnapshot(
            count=i + 1, min_ns=2, max_ns=3, mean_ns=2.5, p50_ns=2, p90_ns=3, p99_ns=3
        )
    state["keys"] = np.arange(4, dtype=np.uint64)
    state["probabilities"] = np.full(4, 0.25)
    state["times_sampled"] = np.ones(4, np.uint32)
    info = _echo._sample_info(state)  # pyright: ignore[reportPrivateUsage]
    for name in COUNTERS:
        assert getattr(info, name) == state[name], name
    for name in (
        "v1_connections_total",
        "v2_connections_total",
        "sessions_resumed_total",
        "samples_deduplicated_total",
        "handshakes_refused_protocol_total",
        "handshakes_refused_auth_total",
        "handshakes_refused_layout_total",
    ):
        assert name in COUNTERS
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _assert_same_info(pickle.loads(pickle.dumps(info, protocol)), info)


def test_sample_info_from_a_fifo_sample_and_stats_pickle(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(batch_size=2)
    for i in range(4):
        server.submit(make_sample(i))
    take(server)
    info = take(server).info
    assert (info.sequence, info.notify_count) == (1, 2)
    _assert_same_info(pickle.loads(pickle.dumps(info)), info)
    stats = server.stats()
    _assert_same_info(pickle.loads(pickle.dumps(stats)), stats)
    assert pickle.loads(pickle.dumps(info)).as_dict() == info.as_dict()


def test_sample_info_of_a_replay_batch_pickles_its_arrays(
    make_server: Any, make_sample: Any
) -> None:
    server = _replay(make_server, make_sample, 6, sampler=echo.Prioritized(0.5), seed=1)
    info = take(server).info
    copy = pickle.loads(pickle.dumps(info))
    _assert_same_info(copy, info)
    assert copy.keys is not None
    assert copy.keys.flags.writeable  # a private copy, not a view


def test_sample_info_unpickles_what_another_echo_version_pickled() -> None:
    # A newer echo may send counters this one does not know; an older one fewer: both load.
    info = _echo._sample_info({"sequence": 3, "a_counter_from_the_future": 9})  # pyright: ignore[reportPrivateUsage]
    assert info.sequence == 3
    assert info.store_size == 0
    assert info.keys is None
    assert info.memcpy.count == 0


def test_sample_info_crosses_a_process_boundary(make_server: Any, make_sample: Any) -> None:
    server = _replay(make_server, make_sample, 6, seed=2)
    info = take(server).info
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        back, as_dict = pool.apply_async(_round_trip_in_child, (info,)).get(timeout=60)
    _assert_same_info(back, info)
    assert as_dict == info.as_dict()


# --- dataset_iter(timeout=) -----------------------------------------------------------------


def test_dataset_iter_timeout_raises_like_sample_and_loses_nothing(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(batch_size=2)
    batches = server.dataset_iter(timeout=0.05)
    server.submit(make_sample(0))
    server.submit(make_sample(1))
    assert [int(i) for i in next(batches).batch["id"]] == [0, 1]
    server.submit(make_sample(2))  # half a batch: the next one cannot complete
    with pytest.raises(TimeoutError, match=f"^{re.escape(FIFO_TIMEOUT)}$"):
        next(batches)
    with pytest.raises(StopIteration):  # a generator that raised is finished
        next(batches)
    server.submit(make_sample(3))
    again = server.dataset_iter(timeout=WAIT_S)
    assert [int(i) for i in next(again).batch["id"]] == [2, 3]


def test_dataset_iter_timeout_names_the_rate_limiter(make_server: Any, make_sample: Any) -> None:
    server = _replay(make_server, make_sample, 2, rate_limiter=echo.MinSize(3))
    with pytest.raises(TimeoutError, match=re.escape("the rate limiter MinSize(min_size=3)")):
        next(server.dataset_iter(timeout=0.01))


def test_dataset_iter_ends_at_close_with_a_timeout(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=1)
    server.submit(make_sample(0))
    batches = server.dataset_iter(timeout=WAIT_S, copy=True)
    assert int(next(batches).batch["id"][0]) == 0
    server.close()
    assert list(batches) == []


def test_dataset_iter_rejects_a_bad_timeout(make_server: Any) -> None:
    server = make_server()
    with pytest.raises(ValueError, match="timeout must be None or a number of seconds >= 0"):
        next(server.dataset_iter(timeout=-1.0))
