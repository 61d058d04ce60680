"""Ragged workers compress on the wire: over TCP, the leaves the learner's `compress=` names
go compressed (each worker compresses on its own thread), and the learner checks each one
(decompressed into exactly its size) and stores the bytes as they came; through shared memory,
or with `wire_compression=False`, they go raw. A frame kept to resend goes to a learner that
agreed on other codecs as the plain frame of the same samples. A hostile compressed frame is
refused naming the leaf, and nothing of it is stored."""

from __future__ import annotations

import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_ragged_tcp import _handshake  # pyright: ignore[reportPrivateUsage]

import echo
from echo import Ragged

SHM = pytest.mark.skipif(sys.platform != "linux", reason="shared memory needs Linux")
COMPRESS = {"tokens": echo.Zstd(1), "logp": echo.Lz4(force=True)}


def example() -> dict[str, Any]:
    return {
        "tokens": Ragged(300, np.int32, group="completion"),
        "logp": Ragged(300, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }


def make(i: int) -> dict[str, Any]:
    n = (i * 53) % 301  # 0 rows too
    return {
        "tokens": (np.arange(n, dtype=np.int32) + i) % 11,
        "logp": np.full(n, -float(i % 9), np.float32),
        "id": np.int64(i),
    }


def raw_bytes(i: int) -> int:
    return 8 * ((i * 53) % 301)


def learner(**options: Any) -> echo.Server:
    options.setdefault("num_buffers", 8)  # FIFO: room for 64 samples before a read
    server = echo.Server(
        example(), 8, transport=echo.TcpTransport(port=0, host="127.0.0.1"), **options
    )
    server.start()
    return server


def drain(server: echo.Server, n: int, done: Callable[[], bool] = lambda: True) -> list[int]:
    """The ids of `n` samples a FIFO server hands out, each checked intact; once `done()`
    (the workers sent everything), the server closes handing out its last partial batch."""
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        try:
            s = server.sample(timeout=0.5)
        except TimeoutError:
            if done() and not server.closed:
                server.close(drain=True)
            continue
        if s is None:
            break
        cu = s.batch["tokens"].cu_seqlens
        for k, i in enumerate(s.batch["id"].tolist()):
            want = make(i)
            np.testing.assert_array_equal(
                s.batch["tokens"].values[cu[k] : cu[k + 1]], want["tokens"]
            )
            np.testing.assert_array_equal(s.batch["logp"].values[cu[k] : cu[k + 1]], want["logp"])
            seen.append(i)
    return seen


def test_workers_compress_what_the_learner_names_and_every_sample_arrives_once_intact() -> None:
    server = learner(compress=COMPRESS)
    assert server.port is not None
    workers, each = 4, 150
    clients = [
        echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=False)
        for _ in range(workers)
    ]
    named = {k: type(v).__name__ for k, v in clients[0].wire_compression_leaves.items()}
    assert named == {"tokens": "Zstd", "logp": "Lz4"}
    failures: list[BaseException] = []

    def send(w: int) -> None:
        try:
            ids = [w * each + k for k in range(each)]
            k = 0
            while k < len(ids):
                if k % 5 == 0:  # a group of three among single samples
                    clients[w].send_group([make(i) for i in ids[k : k + 3]], timeout=30)
                    k += 3
                else:
                    clients[w].send(make(ids[k]), timeout=30)
                    k += 1
            clients[w].wait(30)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=send, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    seen = drain(server, workers * each, lambda: not any(t.is_alive() for t in threads))
    for t in threads:
        t.join(30)
    assert not failures, failures
    assert sorted(seen) == list(range(workers * each)), "every sample once"
    stats = server.stats()
    assert stats.samples_received_compressed_total == workers * each
    raw = sum(raw_bytes(i) + 8 for i in range(workers * each))
    assert 0 < stats.compressed_bytes_received_total < raw / 2
    for client in clients:
        client.close()
    server.close()
    # A closed server's totals stay (a training script reads them at its end).
    after = server.stats()
    assert after.samples_inserted_total == workers * each
    assert after.samples_received_compressed_total == workers * each


@pytest.mark.parametrize("how", ["off", pytest.param("shm", marks=SHM)])
def test_raw_through_shared_memory_or_with_wire_compression_off(how: str) -> None:
    server = learner(compress=COMPRESS)
    assert server.port is not None
    client = echo.TcpClient(
        "127.0.0.1", server.port, example(), shared_memory=how == "shm",
        wire_compression=how != "off",
    )  # fmt: skip
    assert client.transport_path == ("shm" if how == "shm" else "tcp")
    assert client.wire_compression_leaves == {}
    for i in range(40):
        client.send(make(i), timeout=10)
    client.wait(10)
    assert sorted(drain(server, 40)) == list(range(40))
    assert server.stats().samples_received_compressed_total == 0
    client.close()
    server.close()


def test_kept_frames_go_plain_to_a_learner_without_those_codecs(tmp_path: Path) -> None:
    """A durable worker's frames, compressed for a learner with `compress=`, are resent to
    the learner that replaces it, which has none, as plain frames of the same samples."""
    first = learner(compress=COMPRESS)
    port = first.port
    assert port is not None
    client = echo.TcpClient("127.0.0.1", port, example(), durable=True, reconnect_timeout=30,
                            shared_memory=False)  # fmt: skip
    assert set(client.wire_compression_leaves) == {"tokens", "logp"}
    for i in range(30):
        client.send(make(i), timeout=30)
    client.wait(30)
    assert client.persisted == 0
    assert client.retained_bytes > 0
    first.close(restarting=True)  # nothing of it was persisted: the worker keeps all 30
    again = echo.TcpTransport(port=port, host="127.0.0.1")
    second = echo.Server(example(), 8, transport=again, num_buffers=8)
    second.start()
    try:
        for i in range(30, 40):
            client.send(make(i), timeout=30)
        client.wait(30)
        assert client.reconnects >= 1
        assert client.resent == 30
        assert client.wire_compression_leaves == {}
        assert sorted(drain(second, 40)) == list(range(40)), "every sample once, intact"
        assert second.stats().samples_received_compressed_total == 0
        second.checkpoint(tmp_path / "ckpt")
        assert client.close(timeout=30)
    finally:
        second.close()


def test_a_hostile_compressed_frame_is_refused_naming_the_leaf() -> None:
    server = echo.Server(
        example(), 8, transport=echo.TcpTransport(port=0, host="127.0.0.1"),
        sampler=echo.Uniform(), max_size=100, compress={"tokens": echo.Zstd(1)},
    )  # fmt: skip
    server.start()
    assert server.port is not None
    sample = make(7)
    n = len(sample["tokens"])
    head = struct.pack("<HII", 1, n, n)  # the count, then logp's and tokens' rows

    def answer_to(frame: bytes, codecs: bool = True) -> bytes:
        sock = _handshake(server.port or 0, codecs=codecs)
        sock.sendall(frame)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        sock.close()
        return answer

    # Bytes that are no zstd frame where the tokens should be.
    plain = sample["id"].tobytes() + sample["logp"].tobytes()
    garbage = bytes([0xAB] * 16)
    answer = answer_to(bytes([0x1A]) + head + struct.pack("<I", 16) + plain + garbage)
    assert answer[:1] == b"\x03"
    assert b"leaf ['tokens']" in answer
    assert b"zstd" in answer
    # A length far above the worst case for the leaf: refused before the body is read.
    answer = answer_to(bytes([0x1A]) + head + struct.pack("<I", 2**31))
    assert b"leaf ['tokens']: 2147483648 compressed bytes" in answer
    # A compressed frame from a connection that agreed on no codecs.
    answer = answer_to(bytes([0x1A]) + head + struct.pack("<I", 16), codecs=False)
    assert b"agreed on no codecs" in answer
    assert server.stats().store_size == 0, "nothing of them was stored"
    server.close()
