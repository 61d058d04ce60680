"""Vectorized inserts: `Server.submit_batch` and `TcpClient.send_batch` take one sample per
row of every leaf, in order, exactly once, checked as a whole before anything is written."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import echo
from echo import Prioritized, Server, TcpClient, TcpTransport

WAIT_S = 10.0
LOCALHOST = "127.0.0.1"

# A nested example: the batch has the same structure with a leading N on every leaf.
EXAMPLE = {
    "id": np.zeros((), np.int64),
    "obs": {"pixels": np.zeros((2, 3), np.uint8), "state": np.zeros((4,), np.float32)},
    "reward": np.zeros((), np.float32),
}


def rows(ids: list[int]) -> dict[str, Any]:
    """A batch whose row k is the sample with id ids[k] (every leaf derived from the id)."""
    a = np.asarray(ids, np.int64)
    return {
        "id": a,
        "obs": {
            "pixels": (a[:, None, None] + np.arange(6).reshape(1, 2, 3)).astype(np.uint8),
            "state": (a[:, None] * 10 + np.arange(4)).astype(np.float32),
        },
        "reward": (a * 0.5).astype(np.float32),
    }


def check_batch(batch: dict[str, Any]) -> list[int]:
    """The ids of a sampled batch, after checking every leaf of every row against its id."""
    ids = [int(i) for i in batch["id"]]
    want = rows(ids)
    np.testing.assert_array_equal(batch["obs"]["pixels"], want["obs"]["pixels"])
    np.testing.assert_array_equal(batch["obs"]["state"], want["obs"]["state"])
    np.testing.assert_array_equal(batch["reward"], want["reward"])
    return ids


def take(server: Server, batches: int) -> list[int]:
    out: list[int] = []
    for _ in range(batches):
        got = server.sample(timeout=WAIT_S)
        assert got is not None
        out += check_batch(got.batch)
    return out


def test_submit_batch_inserts_every_row_once_in_order() -> None:
    server = Server(EXAMPLE, batch_size=16, num_buffers=8)
    server.start()
    assert server.submit_batch(rows(list(range(64)))) == 64
    assert take(server, 4) == list(range(64))
    server.close()


def test_submit_batch_from_threads_keeps_each_threads_order() -> None:
    server = Server(EXAMPLE, batch_size=32, num_buffers=4)
    server.start()
    threads_n, per_thread, n = 4, 256, 32

    def produce(t: int) -> None:
        for start in range(0, per_thread, n):
            server.submit_batch(rows([t * 1_000_000 + start + k for k in range(n)]))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(threads_n)]
    for thread in threads:
        thread.start()
    got = take(server, threads_n * per_thread // 32)
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(got) == sorted(
        t * 1_000_000 + i for t in range(threads_n) for i in range(per_thread)
    )
    for t in range(threads_n):
        mine = [i for i in got if i // 1_000_000 == t]
        assert mine == sorted(mine), f"thread {t}: rows out of order"
    server.close()


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        (
            {**rows([1, 2]), "id": np.zeros((2, 1), np.int64)},
            ValueError,
            r"\['id'\]: expected shape \(N,\)",
        ),
        (
            {**rows([1, 2]), "obs": {**rows([1, 2])["obs"], "state": np.zeros((2, 5), np.float32)}},
            ValueError,
            r"\['obs'\]\['state'\]: expected shape \(N, 4\) .* got \(2, 5\)",
        ),
        (
            {**rows([1, 2]), "reward": np.zeros(3, np.float32)},
            ValueError,
            r"\['reward'\] has 3 rows, leaf \['id'\] has 2",
        ),
        (
            {**rows([1, 2]), "reward": np.zeros(2, np.float64)},
            TypeError,
            r"\['reward'\]: expected dtype float32",
        ),
        (
            {**rows([1, 2]), "reward": np.float32(1.0)},
            TypeError,
            r"\['reward'\]: expected a numpy.ndarray with one row",
        ),
        ({"id": np.zeros(2, np.int64)}, ValueError, "structure"),
    ],
    ids=["0d-leaf-with-extra-dim", "row-shape", "row-counts", "dtype", "scalar", "structure"],
)
def test_a_bad_batch_is_refused_whole_and_nothing_is_written(
    batch: dict[str, Any], error: type[Exception], message: str
) -> None:
    server = Server(EXAMPLE, batch_size=2)
    server.start()
    with pytest.raises(error, match=message):
        server.submit_batch(batch)
    assert server.stats().store_size == 0
    server.submit_batch(rows([7, 8]))  # the server is unharmed
    assert take(server, 1) == [7, 8]
    server.close()


def test_an_empty_batch_inserts_nothing_and_a_strided_one_is_copied_right() -> None:
    server = Server(EXAMPLE, batch_size=4)
    server.start()
    assert server.submit_batch(rows([])) == 0
    wide = rows(list(range(8)))
    strided = {  # every other row: views that are not C-contiguous
        "id": wide["id"][::2],
        "obs": {"pixels": wide["obs"]["pixels"][::2], "state": wide["obs"]["state"][::2]},
        "reward": wide["reward"][::2],
    }
    assert not strided["obs"]["state"].flags.c_contiguous
    assert server.submit_batch(strided) == 4
    assert take(server, 1) == [0, 2, 4, 6]
    server.close()


def test_a_timeout_part_way_says_how_many_rows_went_in() -> None:
    # A ring of 2 batches of 4: the first 8 rows fit, the rest wait for a consumer.
    server = Server(EXAMPLE, batch_size=4, num_buffers=2)
    server.start()
    with pytest.raises(TimeoutError, match=r"after inserting 8 of the 12 rows"):
        server.submit_batch(rows(list(range(12))), timeout=0.3)
    assert take(server, 2) == list(range(8))
    server.close()


def test_replay_priorities_one_for_all_or_one_per_row() -> None:
    server = Server(EXAMPLE, batch_size=4, sampler=Prioritized(1.0), max_size=64)
    server.start()
    server.submit_batch(rows([0, 1, 2, 3]), priority=[1.0, 2.0, 3.0, 4.0])
    server.submit_batch(rows([4, 5]), priority=7.5)
    assert [server._core.priority(k) for k in range(6)] == [1.0, 2.0, 3.0, 4.0, 7.5, 7.5]
    with pytest.raises(ValueError, match=r"one number or one per row \(3,\), got shape \(2,\)"):
        server.submit_batch(rows([6, 7, 8]), priority=[1.0, 2.0])
    with pytest.raises(ValueError, match="priority"):
        server.submit_batch(rows([6, 7]), priority=[1.0, -2.0])
    assert server._core.priority(6) is None  # nothing of a refused batch went in
    server.close()


# --- over TCP ---------------------------------------------------------------------------------


def _tcp_server(**kwargs: Any) -> Server:
    server = Server(EXAMPLE, transport=TcpTransport(port=0, host=LOCALHOST), **kwargs)
    server.start()
    return server


@pytest.mark.parametrize("protocol", ["auto", 1])
@pytest.mark.parametrize("window", [1, 5, 64])
def test_send_batch_delivers_every_row_once_in_order(protocol: Any, window: int) -> None:
    server = _tcp_server(batch_size=16, num_buffers=12)  # room for all 160 rows
    assert server.port is not None
    with TcpClient(LOCALHOST, server.port, EXAMPLE, window, protocol=protocol) as client:
        for start in range(0, 160, 40):  # batches larger and smaller than the window
            assert client.send_batch(rows(list(range(start, start + 40)))) == 40
        client.wait(timeout=WAIT_S)
        assert client.sent == client.acked == 160
    assert take(server, 10) == list(range(160))
    server.close()


def test_send_batch_from_several_clients_keeps_each_clients_order() -> None:
    server = _tcp_server(batch_size=32, num_buffers=4)
    assert server.port is not None
    port = server.port

    def send(c: int) -> None:
        with TcpClient(LOCALHOST, port, EXAMPLE, 16) as client:
            for start in range(0, 320, 64):
                client.send_batch(rows([c * 1_000_000 + start + k for k in range(64)]))

    threads = [threading.Thread(target=send, args=(c,)) for c in range(4)]
    for thread in threads:
        thread.start()
    got = take(server, 4 * 320 // 32)
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(got) == sorted(c * 1_000_000 + i for c in range(4) for i in range(320))
    for c in range(4):
        mine = [i for i in got if i // 1_000_000 == c]
        assert mine == sorted(mine), f"client {c}: rows out of order"
    server.close()


def test_send_batch_priorities_reach_a_replay_server_and_fifo_refuses_them() -> None:
    replay = _tcp_server(batch_size=4, sampler=Prioritized(1.0), max_size=64)
    assert replay.port is not None
    with TcpClient(LOCALHOST, replay.port, EXAMPLE) as client:
        client.send_batch(rows([0, 1, 2]), priority=[3.0, 2.0, 1.0])
        client.send_batch(rows([3]), priority=9.0)
        client.wait(timeout=WAIT_S)
    # Acknowledged means queued; the drainer puts them in the table a moment later.
    deadline = time.monotonic() + WAIT_S
    while replay.stats().store_size < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    got = [replay._core.priority(k) for k in range(4)]
    replay.close()
    assert got == [3.0, 2.0, 1.0, 9.0]
    fifo = _tcp_server(batch_size=4)
    assert fifo.port is not None
    with TcpClient(LOCALHOST, fifo.port, EXAMPLE) as client:
        with pytest.raises(ValueError, match="FIFO"):
            client.send_batch(rows([0, 1]), priority=1.0)
        assert client.sent == 0
    fifo.close()


def test_send_batch_with_reconnect_on_and_a_bad_batch() -> None:
    server = _tcp_server(batch_size=8)
    assert server.port is not None
    with TcpClient(LOCALHOST, server.port, EXAMPLE, 4, reconnect=True) as client:
        with pytest.raises(ValueError, match=r"\['obs'\]\['state'\]"):
            client.send_batch(
                {
                    **rows([0]),
                    "obs": {
                        "pixels": np.zeros((1, 2, 3), np.uint8),
                        "state": np.zeros((1, 3), np.float32),
                    },
                }
            )
        assert client.send_batch(rows(list(range(16)))) == 16
        assert client.send_batch(rows([])) == 0
    assert take(server, 2) == list(range(16))
    server.close()


def test_batch_methods_exist_on_the_public_classes() -> None:
    assert callable(echo.Server.submit_batch)
    assert callable(echo.TcpClient.send_batch)
