"""`Server.writer()`: single samples given as their leaves, positionally, in the example's
flattened order. Every sample arrives exactly once and intact; a wrong leaf count, dtype or
shape is the precise exception naming the leaf; a full ring times out; a closed server and a
sequence table are refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import echo
from echo import Server, ServerClosedError, Uniform

EXAMPLE = {
    "obs": np.zeros(5, np.float32),
    "action": np.zeros((), np.int64),
    "meta": {"id": np.zeros((), np.uint64)},
}


def leaves(i: int) -> tuple[np.ndarray, ...]:
    # optree's order: the dict keys sorted, depth first: action, meta.id, obs.
    return (
        np.asarray(i % 7, np.int64),
        np.asarray(i, np.uint64),
        np.arange(5, dtype=np.float32) + i,
    )


def test_the_writer_names_its_leaves_in_the_examples_flattened_order() -> None:
    with Server(EXAMPLE, 2) as server:
        writer = server.writer(timeout=1.5)
        assert server.leaf_names == ["['action']", "['meta']['id']", "['obs']"]
        assert writer.leaves == server.leaf_names
        assert writer.timeout == 1.5
        assert repr(writer) == (
            "SampleWriter(leaves=[['action'], ['meta']['id'], ['obs']], timeout=1.5)"
        )
        assert isinstance(writer, echo.SampleWriter)


def test_samples_from_several_writer_threads_arrive_exactly_once_and_intact() -> None:
    threads, per_thread = 4, 500
    with Server(EXAMPLE, 10, num_buffers=4) as server:
        writer = server.writer()

        def produce(t: int) -> None:
            for i in range(t * per_thread, (t + 1) * per_thread):
                writer(*leaves(i))

        workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        seen: list[int] = []
        while len(seen) < threads * per_thread:
            batch, _ = server.sample(timeout=20)
            ids = batch["meta"]["id"].astype(np.int64)
            np.testing.assert_array_equal(batch["action"], ids % 7)
            np.testing.assert_array_equal(batch["obs"], np.arange(5)[None, :] + ids[:, None])
            seen.extend(int(i) for i in ids)
        for w in workers:
            w.join()
    assert sorted(seen) == list(range(threads * per_thread))


def test_a_replay_table_takes_the_writers_samples_with_the_default_priority() -> None:
    with Server(EXAMPLE, 4, max_size=8, sampler=echo.Prioritized(1.0)) as server:
        writer = server.writer()
        for i in range(8):
            writer(*leaves(i))
        sample = server.sample(timeout=5)
        assert sample is not None
        assert sample.probabilities is not None
        # Every item has the default priority (1.0), so each is drawn with probability 1/8.
        np.testing.assert_allclose(sample.probabilities, np.full(4, 0.125))


def test_wrong_leaves_are_refused_naming_the_leaf() -> None:
    with Server(EXAMPLE, 2) as server:
        writer = server.writer()
        with pytest.raises(
            ValueError, match=r"expected 3 leaves \(\['action'\], \['meta'\]\['id'\], \['obs'\]\)"
        ):
            writer(*leaves(0)[:2])
        action, ident, obs = leaves(0)
        with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected dtype float32, got float64"):
            writer(action, ident, obs.astype(np.float64))
        with pytest.raises(ValueError, match=r"leaf \['obs'\]: expected shape \(5,\), got \(4,\)"):
            writer(action, ident, obs[:4])
        with pytest.raises(TypeError, match=r"leaf \['action'\]: expected a numpy.ndarray"):
            writer("seven", ident, obs)
        # Nothing of the refused calls went in; a good one does.
        writer(action, ident, obs)
        writer(*leaves(1))
        batch, _ = server.sample(timeout=5)
        np.testing.assert_array_equal(batch["meta"]["id"], [0, 1])


def test_a_full_ring_times_out_and_a_closed_server_refuses() -> None:
    server = Server(EXAMPLE, 1, num_buffers=2)
    writer = server.writer(timeout=0.05)
    writer(*leaves(0))
    writer(*leaves(1))
    with pytest.raises(TimeoutError):
        writer(*leaves(2))
    server.close()
    with pytest.raises(ServerClosedError):
        writer(*leaves(3))


def test_a_sequence_table_and_a_negative_timeout_are_refused() -> None:
    sequence = Server(EXAMPLE, 2, max_size=16, sampler=Uniform(), sequence=echo.Sequence(2))
    with sequence, pytest.raises(ValueError, match=r"writer\(\) takes samples of a FIFO or replay"):
        sequence.writer()
    fifo = Server(EXAMPLE, 2)
    with fifo, pytest.raises(ValueError, match=r"timeout must be None or a number of seconds"):
        fifo.writer(timeout=-1)
