"""Wire protocol v2 (issue #12): negotiation next to v1, typed layouts, priorities, tokens,
sessions with reconnect and exactly-once resends, heartbeats, and their counters.

Everything runs over loopback on ephemeral ports, every wait is bounded. Samples are
conftest's `example` (`make_sample(i)` encodes id `i` in every value, so `batch_ids` reads the
ids of a batch and checks that no slot is torn). `_proxy.py` runs in its own process between a
client and a server: it drops connections at random points (seeded), resets or stalls them on
command, and records every byte. Learners and workers that must be killed or that stand for
other machines run as child processes, killed at teardown by their PID. Tests that need the
published id-echo 0.2.1 are marked `peer` (its virtualenv comes from `test_tcp.py`).

The wire format itself is in docs/design/transport.md; the raw-socket tests here follow it
byte by byte, so they pin it down independently of `echo.TcpClient`.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import math
import random
import re
import secrets
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_tcp as _tcp_tests
from _blocked import after
from conftest import (
    assert_blocked,
    assert_ctrl_c_interrupts_promptly,
    child_env,
    poll,
    read_line,
)
from testkit.net import recv_exact, take

import echo
from echo import ConnectionClosedError, Server, TcpClient, TcpTransport

HERE = Path(__file__).resolve().parent
PROXY = HERE / "_proxy.py"
LOCALHOST = "127.0.0.1"
WAIT_S = 10.0
LineReader = _tcp_tests.LineReader
PEER_PRELUDE = _tcp_tests.PEER_PRELUDE
peer_env = _tcp_tests._peer_env
peer_python = _tcp_tests.peer_python  # the session fixture, registered here too

EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
# conftest's example on the wire: the v1 handshake (29 bytes), a sample (20 bytes), and the
# same layout as v2 describes it (path name, byte order, kind, itemsize, shape).
V1_HANDSHAKE = _tcp_tests.HANDSHAKE
PAYLOAD = 20
V2_LEAVES = [("['id']", b"<", b"i", 8, ()), ("['obs']", b"<", b"f", 4, (3,))]
OFFER_LEN = 38
ACK, BEAT, ERROR = 0x01, 0x02, 0x03
SAMPLE, SAMPLE_PRIORITY, HEARTBEAT, BYE = 0x10, 0x11, 0x20, 0x30
ID_STRIDE = 10_000  # worker w's sample seq has id w * ID_STRIDE + seq (exact in float32)


def make_sample(i: int) -> dict[str, np.ndarray]:
    return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}


def raw_sample(i: int) -> bytes:
    return np.array(i, np.int64).tobytes() + np.full((3,), i, np.float32).tobytes()


@pytest.fixture(autouse=True)
def _no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$ECHO_TOKEN of whoever runs the tests must not leak into them (or their children)."""
    monkeypatch.delenv("ECHO_TOKEN", raising=False)


def _transport(**kwargs: Any) -> TcpTransport:
    return TcpTransport(port=0, host=LOCALHOST, **kwargs)


def _serve(
    make_server: Callable[..., Server],
    *,
    batch_size: int = 10,
    transport: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Server:
    """A started server on 127.0.0.1 whose ring holds 120 samples unless told otherwise
    (`transport`: TcpTransport's keyword arguments)."""
    if "sampler" not in kwargs:
        kwargs.setdefault("num_buffers", 12)
    server = make_server(batch_size=batch_size, transport=_transport(**(transport or {})), **kwargs)
    server.start()
    assert isinstance(server.port, int)
    return server


def _assert_nothing_more(server: Server) -> None:
    with pytest.raises(TimeoutError):
        server.sample(timeout=0.1)


def _stats(server: Server, done: Callable[[Any], bool], what: str, timeout: float = WAIT_S) -> Any:
    return poll(server.stats, done, what, timeout)


def _recv_until_eof(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    data = b""
    for _ in range(limit):
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        data += chunk
        if len(data) >= limit:
            break
    return data


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection((LOCALHOST, port), timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# --- child processes: the proxy, learners, workers, 0.2.1 peers --------------------------------


class Child:
    """A child process whose stdout lines are read on a thread (so each wait is bounded) and
    whose stderr goes to a file; stopped (SIGKILL by PID) by `stop()` if still running."""

    def __init__(
        self,
        name: str,
        args: list[str],
        logdir: Path,
        *,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.stderr_path = logdir / f"{name}.stderr"
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=child_env() if env is None else env,
            cwd=cwd,
        )
        self._reader = LineReader(self.proc)
        self.lines: list[str] = []  # every line read so far
        self.eof = False

    def stderr(self) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text()[-3000:]
        return ""

    def next_line(self, timeout: float) -> str | None:
        """The next line ("" at EOF), or None if none came within `timeout`."""
        if self.eof:
            return ""
        line = self._reader.get(timeout)
        if line == "":
            self.eof = True
        elif line is not None:
            self.lines.append(line)
        return line

    def drain(self) -> None:
        """Reads every line that is already there, without waiting."""
        for _ in range(1_000_000):
            if self.next_line(0) in ("", None):
                return

    def read_to_eof(self, timeout: float = WAIT_S) -> None:
        """Reads every line up to the end of stdout (the process has ended or is ending)."""
        deadline = time.monotonic() + timeout
        for _ in range(1_000_000):
            if self.next_line(max(deadline - time.monotonic(), 0.0)) in ("", None):
                return

    def expect(self, prefix: str, timeout: float = 3 * WAIT_S) -> str:
        """Reads lines until one starts with `prefix`; fails (with stderr) at EOF or timeout."""
        deadline = time.monotonic() + timeout
        for _ in range(1_000_000):
            left = deadline - time.monotonic()
            line = self.next_line(max(left, 0.0)) if left > 0 else None
            if line is None or line == "":
                what = "timed out" if line is None else "ended"
                pytest.fail(
                    f"{self.name} {what} waiting for {prefix!r}; rc={self.proc.poll()} "
                    f"last lines {self.lines[-5:]!r}\nstderr:\n{self.stderr()}"
                )
            if line.startswith(prefix):
                return line
        raise AssertionError("unreachable")

    def send_line(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL, by PID
        self.proc.wait(WAIT_S)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reader.join()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    """`children(name, args, **kwargs)`: starts a `Child`; every one is stopped at teardown."""
    started: list[Child] = []

    def start(name: str, args: list[str], **kwargs: Any) -> Child:
        child = Child(name, args, tmp_path, **kwargs)
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop()


class Proxy:
    """`_proxy.py` in front of `target_port`; `port` is where clients connect."""

    def __init__(self, children: Callable[..., Child], target_port: int, *args: str) -> None:
        cmd = [sys.executable, str(PROXY), "--target-port", str(target_port), *args]
        self.child = children(f"proxy-{target_port}", cmd, stdin=True)
        self.port = int(self.child.expect("port ").split()[1])

    def command(self, line: str) -> str:
        self.child.send_line(line)
        word = line.split()[0]
        answer = self.child.expect("ok " if word != "stats" else "stats ", timeout=WAIT_S)
        assert answer.split()[:2] in (["ok", word], ["stats", answer.split()[1]]), answer
        return answer

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = json.loads(self.command("stats").split(" ", 1)[1])
        return stats


@pytest.fixture
def proxy(children: Callable[..., Child]) -> Callable[..., Proxy]:
    return lambda target_port, *args: Proxy(children, target_port, *args)


# --- a v2 peer on a raw socket, exactly as docs/design/transport.md describes it --------------


def v2_hello(
    nonce: bytes,
    *,
    session: bytes = b"\x00" * 16,
    first_seq: int = 0,
    heartbeat_ms: int = 0,
    client_nonce: bytes = b"\x11" * 16,
    leaves: list[tuple[str, bytes, bytes, int, tuple[int, ...]]] = V2_LEAVES,
    token: bytes | None = None,
) -> bytes:
    body = bytes([1 if token is not None else 0]) + session
    body += struct.pack("<QI", first_seq, heartbeat_ms) + client_nonce
    body += struct.pack("<I", len(leaves))
    for name, order, kind, itemsize, shape in leaves:
        raw = name.encode()
        body += struct.pack("<H", len(raw)) + raw + order + kind
        body += struct.pack("<II", itemsize, len(shape))
        body += b"".join(struct.pack("<I", d) for d in shape)
    if token is not None:
        body += hmac.new(token, b"echo-v2-client" + nonce + body, hashlib.sha256).digest()
    return nonce + b"ECHO\x02" + struct.pack("<I", len(body)) + body


def read_offer(sock: socket.socket, *, after_v1: bool) -> tuple[bytes, bytes]:
    """Reads the greeting: (mode byte, nonce). An open server sends the v1 handshake first."""
    if after_v1:
        assert recv_exact(sock, len(V1_HANDSHAKE)) == V1_HANDSHAKE
    offer = recv_exact(sock, OFFER_LEN)
    assert len(offer) == OFFER_LEN, offer
    assert offer[:5] == b"ECHO\x02", offer
    assert ACK not in offer, "an OFFER must hold no 0x01 byte"
    nonce = offer[6:]
    assert re.fullmatch(rb"[0-9a-f]{32}", nonce), nonce
    return offer[5:6], nonce


def read_reply(sock: socket.socket) -> tuple[int, str, tuple[int, int, int, bytes | None] | None]:
    """(status, message, (flags, resume_seq, heartbeat_ms, mac) if accepted)."""
    head = recv_exact(sock, 10)
    assert len(head) == 10, f"reply cut short: {head!r}"
    magic, version, status, msg_len = struct.unpack("<4sBBI", head)
    assert (magic, version) == (b"ECHO", 2), head
    message = recv_exact(sock, msg_len).decode()
    if status != 0:
        return status, message, None
    flags, resume_seq, heartbeat_ms = struct.unpack("<BQI", recv_exact(sock, 13))
    mac = recv_exact(sock, 32) if flags & 2 else None
    return status, message, (flags, resume_seq, heartbeat_ms, mac)


def read_acks(sock: socket.socket, n: int) -> int:
    """Reads until `n` acks came (heartbeats skipped); returns the heartbeats seen."""
    acks = beats = 0
    for _ in range(10 * n + 1000):
        if acks == n:
            break
        chunk = sock.recv(n - acks)
        assert chunk, f"closed after {acks} of {n} acks"
        for byte in chunk:
            assert byte in (ACK, BEAT), f"unexpected byte {byte:#04x} among acks"
            acks += byte == ACK
            beats += byte == BEAT
    assert acks == n
    return beats


# --- negotiation: the interop matrix ---------------------------------------------------------

TOKEN = "matrix-token-" + "7f3a" * 4

PEER_SERVER = PEER_PRELUDE + textwrap.dedent(
    """
    server = echo.Server(EXAMPLE, 10, transport=echo.TcpTransport(0))
    server.start()
    print("port", server.port, flush=True)
    for _ in range(int(sys.argv[1])):
        batch = server.sample().batch
        print("ids", json.dumps(batch["id"].tolist(), separators=(",", ":")),
              json.dumps(batch["obs"].tolist(), separators=(",", ":")), flush=True)
    server.close()
    print("done", flush=True)
    """
)

PEER_CLIENT = PEER_PRELUDE + textwrap.dedent(
    """
    port, first, count = (int(a) for a in sys.argv[1:4])
    try:
        client = echo.TcpClient("127.0.0.1", port, EXAMPLE, max_inflight_msgs=8)
    except Exception as exc:
        print("refused", type(exc).__name__, json.dumps(str(exc)), flush=True)
        sys.exit(0)
    for i in range(first, first + count):
        client.send(make_sample(i))
    client.wait()
    print("sent", count, flush=True)
    sys.stdin.read()  # stay connected until the test has seen every batch (see _send_from)
    client.close()
    """
)

# What each pair does: ("ok", negotiated protocol) or ("refused", exception types, pattern).
MATRIX: dict[tuple[str, str], tuple[Any, ...]] = {
    ("peer", "peer"): ("ok", 1),
    ("peer", "open"): ("ok", 1),
    ("peer", "token"): ("refused", ("ValueError",), r"Unsupported echo wire version 2"),
    ("v1", "peer"): ("ok", 1),
    ("v1", "open"): ("ok", 1),
    ("v1", "token"): ("refused", ("PermissionError", "ValueError"), r"(?i)token|v2|version 2"),
    ("auto", "peer"): ("ok", 1),
    ("auto", "open"): ("ok", 2),
    ("auto", "token"): ("ok", 2),
    ("v2", "peer"): ("refused", ("ValueError",), r""),
    ("v2", "open"): ("ok", 2),
    ("v2", "token"): ("ok", 2),
}
PROTOCOL_ARG = {"v1": 1, "auto": "auto", "v2": 2}


def _matrix_params() -> list[Any]:
    params = []
    for client, server in MATRIX:
        marks = [pytest.mark.peer] if "peer" in (client, server) else []
        params.append(pytest.param(client, server, marks=marks, id=f"{client}-to-{server}"))
    return params


def _send_from(
    kind: str,
    port: int,
    first: int,
    count: int,
    *,
    token: str | None,
    peer: str | None,
    cwd: Path,
    hold: Callable[[], object] | None = None,
) -> tuple[str, Any]:
    """Sends `make_sample(first..first+count)` from a client of `kind`: ("ok", protocol) or
    ("refused", (exception type name, message)). Once every sample is acknowledged, calls
    `hold()` before the client closes: id-echo 0.2.1's server may drop the last acknowledged
    samples of a connection that closes right away (test_tcp.py's peer tests stay connected
    for the same reason), so a test reading from a 0.2.1 server reads inside `hold`."""
    if kind == "peer":
        assert peer is not None
        proc = subprocess.Popen(
            [peer, "-c", PEER_CLIENT, str(port), str(first), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=peer_env(),
        )
        try:
            line = read_line(proc, 6 * WAIT_S)
            words = line.split(maxsplit=2)
            if words[:1] == ["sent"] and hold is not None:
                hold()
            _, err = proc.communicate(input="", timeout=3 * WAIT_S)  # stdin closed: it ends
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err
        if words[:1] == ["sent"]:
            return "ok", 1
        assert words[:1] == ["refused"], (line, err)
        return "refused", (words[1], json.loads(words[2]))
    kwargs: dict[str, Any] = {"protocol": PROTOCOL_ARG[kind], "token": token}
    try:
        client = TcpClient(LOCALHOST, port, EXAMPLE, max_inflight_msgs=8, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return "refused", (type(exc).__name__, str(exc))
    try:
        protocol = client.protocol
        for i in range(first, first + count):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=3 * WAIT_S)
        if hold is not None:
            hold()
    finally:
        flushed = client.close(timeout=WAIT_S)
    assert flushed is True
    assert client.sent == client.acked == count
    return "ok", protocol


def _peer_batches(child: Child, num_batches: int) -> list[int]:
    """Reads `num_batches` batches printed by PEER_SERVER, checking every payload."""
    ids: list[int] = []
    for _ in range(num_batches):
        _, id_json, obs_json = child.expect("ids ").split(" ", 2)
        batch = json.loads(id_json)
        assert json.loads(obs_json) == [[float(i)] * 3 for i in batch], "a torn sample"
        ids += batch
    child.expect("done")
    return ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("client_kind", "server_kind"), _matrix_params())
def test_interop_matrix(
    request: pytest.FixtureRequest,
    make_server: Any,
    batch_ids: Any,
    children: Callable[..., Child],
    tmp_path: Path,
    client_kind: str,
    server_kind: str,
) -> None:
    """{0.2.1 client, echo protocol=1, echo "auto" (and protocol=2)} x {0.2.1 server, echo
    server, echo server with a token}: each pair works, with the documented protocol, or is
    refused at connect; either way nothing but whole samples of well-behaved clients is ever
    stored, in order."""
    uses_peer = "peer" in (client_kind, server_kind)
    peer = request.getfixturevalue("peer_python") if uses_peer else None
    expected = MATRIX[(client_kind, server_kind)]
    server: Server | None = None
    peer_server: Child | None = None
    if server_kind == "peer":
        assert peer is not None
        peer_server = children(
            "peer-server", [peer, "-c", PEER_SERVER, "10"], env=peer_env(), cwd=tmp_path
        )
        port = int(peer_server.expect("port ").split()[1])
    else:
        server_token = TOKEN if server_kind == "token" else None
        server = _serve(make_server, transport={"token": server_token} if server_token else {})
        port = server.port
        assert port is not None
    received: list[int] = []  # what the 0.2.1 server handed out, read while connected

    def hold() -> None:
        if peer_server is not None:
            received.extend(_peer_batches(peer_server, 10))

    client_token = TOKEN if (server_kind == "token" and client_kind in ("auto", "v2")) else None
    outcome, detail = _send_from(
        client_kind, port, 0, 100, token=client_token, peer=peer, cwd=tmp_path, hold=hold
    )

    if expected[0] == "ok":
        assert (outcome, detail) == expected, f"expected {expected}, got {outcome}: {detail}"
        first_good = 0
    else:
        assert outcome == "refused", f"expected a refusal, the client negotiated v{detail}"
        kind, message = detail
        assert kind in expected[1], f"{kind}: {message}"
        assert re.search(expected[2], message), message
        assert TOKEN not in message
        # Whoever was refused wrote nothing the server stored; a good client still works.
        if server is not None:
            _assert_nothing_more(server)
            assert server.stats().samples_inserted_total == 0
        good = "auto"
        good_token = TOKEN if server_kind == "token" else None
        first_good = 1000
        outcome, _ = _send_from(
            good, port, first_good, 100, token=good_token, peer=peer, cwd=tmp_path, hold=hold
        )
        assert outcome == "ok"

    want = list(range(first_good, first_good + 100))
    if peer_server is not None:
        assert received == want
        return
    assert server is not None
    assert take(server, 10, batch_ids) == want
    _assert_nothing_more(server)
    if expected[0] == "ok":
        v1, v2 = (1, 0) if expected[1] == 1 else (0, 1)
        info = _stats(
            server,
            lambda s: (s.v1_connections_total, s.v2_connections_total) == (v1, v2),
            f"v1/v2 connections == {(v1, v2)}",
        )
        assert info.samples_inserted_total == 100


@pytest.mark.peer
def test_auto_waits_the_offer_grace_before_speaking_v1_to_a_v1_only_server(
    peer_python: str, children: Callable[..., Child], tmp_path: Path
) -> None:
    child = children(
        "peer-server", [peer_python, "-c", PEER_SERVER, "1"], env=peer_env(), cwd=tmp_path
    )
    port = int(child.expect("port ").split()[1])
    started = time.monotonic()
    client = TcpClient(LOCALHOST, port, EXAMPLE)
    elapsed = time.monotonic() - started
    try:
        assert client.protocol == 1
        assert elapsed >= 0.09, f"decided on v1 after {elapsed:.3f}s, before the 100 ms grace"
        with pytest.raises(ValueError, match=r"(?i)priorit"):
            client.send(make_sample(0), priority=1.0)
        for i in range(10):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        assert _peer_batches(child, 1) == list(range(10))  # read while still connected
    finally:
        assert client.close(timeout=WAIT_S) is True
    assert client.reconnects == 0


@pytest.mark.peer
def test_a_client_with_a_token_refuses_a_v1_only_server(
    peer_python: str, children: Callable[..., Child], tmp_path: Path
) -> None:
    child = children(
        "peer-server", [peer_python, "-c", PEER_SERVER, "1"], env=peer_env(), cwd=tmp_path
    )
    port = int(child.expect("port ").split()[1])
    with pytest.raises(PermissionError) as refused:
        TcpClient(LOCALHOST, port, EXAMPLE, token=TOKEN)
    assert TOKEN not in str(refused.value)
    # The server saw no byte of it: a good client fills the one batch it waits for.
    received: list[int] = []
    hold = lambda: received.extend(_peer_batches(child, 1))  # noqa: E731
    assert _send_from("auto", port, 0, 10, token=None, peer=None, cwd=tmp_path, hold=hold) == (
        "ok",
        1,
    )
    assert received == list(range(10))


class FakeV1Server:
    """A v1-only server on a raw socket: sends the v1 handshake (and, if `late_offer_s` is
    set, an OFFER that long afterwards), then acknowledges every whole sample and records
    every byte it receives."""

    def __init__(self, late_offer_s: float | None = None) -> None:
        self.listener = socket.create_server((LOCALHOST, 0))
        self.listener.settimeout(WAIT_S)
        self.port = self.listener.getsockname()[1]
        self.late_offer_s = late_offer_s
        self.received = b""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(WAIT_S)
                conn.sendall(V1_HANDSHAKE)
                if self.late_offer_s is not None:
                    time.sleep(self.late_offer_s)  # the lost segment this simulates
                    conn.sendall(b"ECHO\x02o" + b"0123456789abcdef" * 2)
                acked = 0
                for _ in range(100_000):
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    self.received += chunk
                    whole = len(self.received) // PAYLOAD
                    if whole > acked:
                        conn.sendall(b"\x01" * (whole - acked))
                        acked = whole
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc

    def close(self) -> None:
        self.listener.close()
        self.thread.join(WAIT_S)


@pytest.mark.parametrize("late_offer_s", [None, 0.3], ids=["no-offer", "offer-after-300ms"])
def test_auto_never_writes_a_v2_byte_to_a_server_that_did_not_offer_v2_in_time(
    late_offer_s: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A v1-only server gets exactly the samples' bytes. An echo server whose OFFER came after
    the 100 ms grace (a lost TCP segment) is spoken to in v1 too: it works, the late OFFER is
    skipped, and a warning says so."""
    fake = FakeV1Server(late_offer_s)
    caplog.set_level(logging.WARNING)
    echo.reset_log_cache()
    try:
        client = TcpClient(LOCALHOST, fake.port, EXAMPLE)
        assert client.protocol == 1
        for i in range(5):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        time.sleep(late_offer_s or 0.0)  # let the late OFFER arrive while connected
        for i in range(5, 10):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        assert client.close(timeout=WAIT_S) is True
    finally:
        fake.close()
    assert fake.error is None, fake.error
    assert fake.received == b"".join(raw_sample(i) for i in range(10))
    if late_offer_s is not None:
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(r.name.startswith("echo") for r in warned), caplog.records


def test_protocol_2_refuses_a_v1_only_server_without_writing_to_it() -> None:
    fake = FakeV1Server()
    try:
        with pytest.raises(ValueError, match=r"(?i)v2|version|offer|protocol"):
            TcpClient(LOCALHOST, fake.port, EXAMPLE, protocol=2)
    finally:
        fake.close()
    assert fake.error is None, fake.error
    assert fake.received == b""


def test_protocol_argument_is_checked(make_server: Any) -> None:
    server = _serve(make_server)
    for bad in (3, 0, "v2", "2"):
        with pytest.raises((ValueError, TypeError), match="protocol"):
            TcpClient(LOCALHOST, server.port, EXAMPLE, protocol=bad)


def test_a_v1_client_that_writes_before_reading_is_served(make_server: Any, batch_ids: Any) -> None:
    server = _serve(make_server, batch_size=2)
    with _connect(server.port) as sock:
        sock.sendall(raw_sample(7) + raw_sample(8))  # v1 data first: no byte of the nonce
        read_offer(sock, after_v1=True)  # the greeting still comes, in full
        assert recv_exact(sock, 2) == b"\x01\x01"
    assert take(server, 1, batch_ids) == [7, 8]
    _stats(server, lambda s: s.v1_connections_total == 1, "one v1 connection")


def test_v1_data_that_starts_like_the_nonce_is_taken_as_v1_after_the_stall(
    make_server: Any,
) -> None:
    """A v1 sample whose bytes happen to be a strict prefix of the hello (here: the nonce's
    first 20 bytes) is v1 data once it has stalled for 200 ms; it arrives byte for byte."""
    server = _serve(make_server, batch_size=1)
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        payload = nonce[:PAYLOAD]
        sent = time.monotonic()
        sock.sendall(payload)
        assert recv_exact(sock, 1) == b"\x01"
        elapsed = time.monotonic() - sent
    assert elapsed >= 0.15, f"acked after {elapsed:.3f}s, before the 200 ms stall"
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    stored = got.batch["id"][0].tobytes() + got.batch["obs"][0].tobytes()
    assert stored == payload


# --- the v2 wire, byte by byte ---------------------------------------------------------------


def test_a_raw_v2_client_following_the_documented_bytes_is_served(
    make_server: Any, batch_ids: Any
) -> None:
    server = _serve(make_server, batch_size=4)
    with _connect(server.port) as sock:
        mode, nonce = read_offer(sock, after_v1=True)
        assert mode == b"o"
        sock.sendall(v2_hello(nonce, session=secrets.token_bytes(16)))
        status, message, accepted = read_reply(sock)
        assert (status, message) == (0, "")
        assert accepted is not None
        flags, resume_seq, heartbeat_ms, mac = accepted
        assert (flags, resume_seq, heartbeat_ms, mac) == (0, 0, 10_000, None)
        sock.sendall(b"".join(bytes([SAMPLE]) + raw_sample(i) for i in range(4)))
        read_acks(sock, 4)
        sock.sendall(bytes([HEARTBEAT]))  # answered by nothing, and harmless
        sock.sendall(bytes([SAMPLE]) + raw_sample(4))
        read_acks(sock, 1)
        sock.sendall(bytes([BYE]))
        sock.shutdown(socket.SHUT_WR)
        assert set(_recv_until_eof(sock)) <= {BEAT}
    assert take(server, 1, batch_ids) == [0, 1, 2, 3]
    _stats(server, lambda s: s.samples_inserted_total == 5, "5 inserted")
    assert server.stats().v2_connections_total == 1


def test_a_raw_v2_client_proves_the_token_and_checks_the_servers_proof(
    make_server: Any, batch_ids: Any
) -> None:
    token = b"raw-token-" + secrets.token_hex(8).encode()
    server = _serve(make_server, batch_size=2, transport={"token": token.decode()})
    client_nonce = secrets.token_bytes(16)
    with _connect(server.port) as sock:
        mode, nonce = read_offer(sock, after_v1=False)  # a token server sends no v1 handshake
        assert mode == b"t"
        sock.sendall(v2_hello(nonce, first_seq=7, client_nonce=client_nonce, token=token))
        status, message, accepted = read_reply(sock)
        assert (status, message) == (0, "")
        assert accepted is not None
        flags, resume_seq, _, mac = accepted
        assert flags & 2, "a token server proves it"
        assert resume_seq == 7  # an unknown session resumes where the client says
        proof = b"echo-v2-server" + client_nonce + nonce + struct.pack("<Q", resume_seq)
        assert mac == hmac.new(token, proof, hashlib.sha256).digest()
        sock.sendall(b"".join(bytes([SAMPLE]) + raw_sample(i) for i in range(2)))
        read_acks(sock, 2)
        sock.sendall(bytes([BYE]))
    assert take(server, 1, batch_ids) == [0, 1]


@pytest.mark.parametrize(
    ("case", "status"),
    [("no-mac", 2), ("wrong-token", 2), ("mac-of-another-nonce", 2), ("layout", 3)],
)
def test_a_raw_v2_hello_that_fails_is_refused_with_its_status_and_a_reason(
    make_server: Any, case: str, status: int
) -> None:
    token = b"the-right-token"
    server = _serve(make_server, transport={"token": token.decode()})
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=False)
        hello = {
            "no-mac": lambda: v2_hello(nonce),
            "wrong-token": lambda: v2_hello(nonce, token=b"the-wrong-token"),
            "mac-of-another-nonce": lambda: v2_hello(b"f" * 32, token=token)[32:],
            "layout": lambda: v2_hello(
                nonce, token=token, leaves=[V2_LEAVES[0], ("['obs']", b"<", b"i", 4, (3,))]
            ),
        }[case]()
        if case == "mac-of-another-nonce":  # a replayed hello: signed for another offer
            hello = nonce + hello
        sock.sendall(hello)
        got_status, message, accepted = read_reply(sock)
        assert (got_status, accepted) == (status, None)
        assert message
        assert "the-right-token" not in message
        with contextlib.suppress(OSError):
            sock.sendall(bytes([SAMPLE]) + raw_sample(1))
        rest = _recv_until_eof(sock)  # then the server closes
        assert ACK not in rest
    field = {2: "handshakes_refused_auth_total", 3: "handshakes_refused_layout_total"}[status]
    _stats(server, lambda s: getattr(s, field) == 1, f"{field} == 1")
    assert server.stats().samples_inserted_total == 0


def test_an_unknown_frame_gets_an_error_frame_and_the_connection_closes(
    make_server: Any, batch_ids: Any
) -> None:
    server = _serve(make_server, batch_size=1)
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        sock.sendall(v2_hello(nonce))
        assert read_reply(sock)[0] == 0
        sock.sendall(bytes([SAMPLE]) + raw_sample(3) + b"\x7f" + raw_sample(4))
        rest = _recv_until_eof(sock)
    assert rest[: rest.find(bytes([ERROR]))].count(ACK) <= 1, rest  # sample 3's ack, maybe
    assert _error_frame(rest)
    assert take(server, 1, batch_ids) == [3]
    _assert_nothing_more(server)


def _error_frame(rest: bytes) -> str:
    """The message of the error frame in `rest` (bytes after the reply), which ends it."""
    start = rest.find(bytes([ERROR]))
    assert start >= 0, f"no error frame in {rest!r}"
    assert set(rest[:start]) <= {ACK, BEAT}, rest
    (length,) = struct.unpack("<I", rest[start + 1 : start + 5])
    assert 0 < length == len(rest) - start - 5, rest
    return rest[start + 5 :].decode()


@pytest.mark.parametrize(
    ("kind", "priority"),
    [("fifo", 1.0), ("replay", -1.0), ("replay", math.nan), ("replay", math.inf)],
)
def test_a_raw_priority_frame_the_server_cannot_take_gets_an_error_frame(
    make_server: Any, kind: str, priority: float
) -> None:
    """The client checks priorities, but the server does not trust it to."""
    replay = {"sampler": echo.Uniform(), "max_size": 16} if kind == "replay" else {}
    server = _serve(make_server, batch_size=1, **replay)
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        sock.sendall(v2_hello(nonce))
        _, _, accepted = read_reply(sock)
        assert accepted is not None
        assert accepted[0] & 1 == (kind == "replay")
        sock.sendall(bytes([SAMPLE_PRIORITY]) + struct.pack("<d", priority) + raw_sample(5))
        message = _error_frame(_recv_until_eof(sock))
    assert "priorit" in message.lower(), message
    assert server.stats().samples_inserted_total == 0


@pytest.mark.serial
def test_the_server_sends_heartbeats_at_a_quarter_of_the_shorter_timeout(
    make_server: Any,
) -> None:
    server = _serve(make_server, transport={"heartbeat_timeout": 5.0})
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        sock.sendall(v2_hello(nonce, heartbeat_ms=400))
        _, _, accepted = read_reply(sock)
        assert accepted is not None
        assert accepted[2] == 5000
        started = time.monotonic()
        beats = b""
        for _ in range(100):
            # The client keeps the server's timeout from firing; we count the server's beats.
            sock.sendall(bytes([HEARTBEAT]))
            beats += sock.recv(16)
            if len(beats) >= 4:
                break
        elapsed = time.monotonic() - started
        assert set(beats) == {BEAT}, beats
        # min(5 s, 0.4 s) / 4 = 100 ms apart: four within ~0.4 s, never all at once.
        assert 0.2 <= elapsed <= 3.0, elapsed


def test_a_session_resumes_with_the_servers_count_and_is_forgotten_after_bye(
    make_server: Any, batch_ids: Any
) -> None:
    server = _serve(make_server, batch_size=5)
    session = secrets.token_bytes(16)
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        sock.sendall(v2_hello(nonce, session=session))
        assert read_reply(sock)[2] is not None
        sock.sendall(b"".join(bytes([SAMPLE]) + raw_sample(i) for i in range(3)))
        read_acks(sock, 3)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # Reconnect claiming only one acknowledged sample: the server knows it queued three.
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        sock.sendall(v2_hello(nonce, session=session, first_seq=1))
        _, _, accepted = read_reply(sock)
        assert accepted is not None
        assert accepted[1] == 3, "resume_seq must be the session's count"
        sock.sendall(b"".join(bytes([SAMPLE]) + raw_sample(i) for i in range(3, 5)))
        read_acks(sock, 2)
        sock.sendall(bytes([BYE]))
        sock.shutdown(socket.SHUT_WR)
        _recv_until_eof(sock)
    info = _stats(server, lambda s: s.sessions_resumed_total == 1, "one resumed session")
    assert info.samples_deduplicated_total == 2
    # After BYE the session is unknown: the server takes the client's word.
    with _connect(server.port) as sock:
        _, nonce = read_offer(sock, after_v1=True)
        sock.sendall(v2_hello(nonce, session=session, first_seq=40))
        _, _, accepted = read_reply(sock)
        assert accepted is not None
        assert accepted[1] == 40
        sock.sendall(bytes([BYE]))
    assert take(server, 1, batch_ids) == [0, 1, 2, 3, 4]
    assert server.stats().sessions_resumed_total == 1


# --- typed layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client_example", "patterns"),
    [
        ({"id": EXAMPLE["id"], "obs": np.zeros((3,), np.int32)}, [r"\['obs'\]", "float32.*int32"]),
        ({"id": EXAMPLE["id"], "obs": np.zeros((3,), ">f4")}, [r"\['obs'\]", "(?i)big|>f4|order"]),
        (
            {"id": EXAMPLE["id"], "obs": np.zeros((4,), np.float32)},
            [r"\['obs'\]", r"\(3,\).*\(4,\)"],
        ),
        ({"id": EXAMPLE["id"], "obz": EXAMPLE["obs"]}, [r"\['obs'\]", r"\['obz'\]"]),
        (
            {"id": np.zeros((), np.uint64), "obs": EXAMPLE["obs"]},
            [r"\['id'\]", r"(?<!u)int64.*uint64"],
        ),
    ],
    ids=["int32-for-float32", "big-endian", "shape", "renamed-key", "uint64-for-int64"],
)
def test_a_layout_mismatch_is_refused_naming_the_leaf_and_both_sides(
    make_server: Any, client_example: Any, patterns: list[str]
) -> None:
    """Server's side first, then the client's (`.*` in the patterns)."""
    server = _serve(make_server)
    with pytest.raises(ValueError, match=r"\[") as refused:
        TcpClient(LOCALHOST, server.port, client_example)
    message = str(refused.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    _stats(server, lambda s: s.handshakes_refused_layout_total == 1, "one layout refusal")
    # The same client works once its example is right.
    with TcpClient(LOCALHOST, server.port, EXAMPLE) as client:
        assert client.protocol == 2


def test_a_renamed_key_deep_in_a_nested_example_is_named(make_server: Any) -> None:
    example = {"policy": {"logits": np.zeros(4, np.float32), "value": np.zeros((), np.float32)}}
    renamed = {"policy": {"logits": np.zeros(4, np.float32), "values": np.zeros((), np.float32)}}
    server = _serve(make_server, ex=example)
    with pytest.raises(ValueError, match=r"\['policy'\]\['value'\]"):
        TcpClient(LOCALHOST, server.port, renamed)


def test_protocol_1_cannot_tell_dtypes_apart_as_documented(make_server: Any) -> None:
    """Wire v1 carries element sizes only: an int32 client passes a float32 server's check.
    This is why "auto" prefers v2 whenever the server offers it."""
    server = _serve(make_server)
    wrong = {"id": EXAMPLE["id"], "obs": np.zeros((3,), np.int32)}
    with TcpClient(LOCALHOST, server.port, wrong, protocol=1) as client:
        assert client.protocol == 1
    assert server.stats().handshakes_refused_layout_total == 0


# --- priorities --------------------------------------------------------------------------------


def test_priorities_sent_over_the_wire_land_in_a_replay_table(make_server: Any) -> None:
    server = _serve(make_server, batch_size=4, sampler=echo.Prioritized(1.0), max_size=64)
    priorities: list[float | None] = [0.5, 3.0, 1.25, None, 0.0, 2.5, None, 7.0]
    with TcpClient(LOCALHOST, server.port, EXAMPLE) as client:
        assert client.protocol == 2
        for i, p in enumerate(priorities):
            client.send(make_sample(i), priority=p, timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
    _stats(server, lambda s: s.samples_inserted_total == len(priorities), "all inserted")
    # A sample sent without a priority gets the largest seen so far, as submit() does.
    expected = [0.5, 3.0, 1.25, 3.0, 0.0, 2.5, 3.0, 7.0]
    assert [server._core.priority(k) for k in range(len(expected))] == expected
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    for key, probability in zip(got.keys, got.probabilities, strict=True):
        assert probability == pytest.approx(expected[int(key)] / sum(expected))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "high"])
def test_a_bad_priority_is_refused_before_anything_is_sent(make_server: Any, bad: Any) -> None:
    server = _serve(make_server, batch_size=1, sampler=echo.Uniform(), max_size=16)
    with TcpClient(LOCALHOST, server.port, EXAMPLE) as client:
        with pytest.raises((ValueError, TypeError), match=r"(?i)priority"):
            client.send(make_sample(0), priority=bad)
        assert client.sent == 0
        client.send(make_sample(1), priority=2.0, timeout=WAIT_S)  # still usable
        client.wait(timeout=WAIT_S)
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert int(got.batch["id"][0]) == 1
    assert server.stats().samples_inserted_total == 1


def test_a_fifo_server_and_a_v1_connection_refuse_priorities(
    make_server: Any, batch_ids: Any
) -> None:
    fifo = _serve(make_server, batch_size=2)
    with TcpClient(LOCALHOST, fifo.port, EXAMPLE) as client:
        with pytest.raises(ValueError, match=r"(?i)priority.*FIFO|FIFO.*priority"):
            client.send(make_sample(0), priority=1.0)
        assert client.sent == 0
        client.send_many(make_sample(i) for i in (1, 2))
    assert take(fifo, 1, batch_ids) == [1, 2]
    replay = _serve(make_server, batch_size=1, sampler=echo.Uniform(), max_size=16)
    with TcpClient(LOCALHOST, replay.port, EXAMPLE, protocol=1) as client:
        with pytest.raises(ValueError, match=r"(?i)priorit"):
            client.send(make_sample(0), priority=1.0)
        client.send(make_sample(3), timeout=WAIT_S)
    _stats(replay, lambda s: s.samples_inserted_total == 1, "one inserted")


# --- tokens ------------------------------------------------------------------------------------


def test_the_token_never_crosses_the_wire(
    make_server: Any, batch_ids: Any, proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    token = "wire-secret-" + secrets.token_hex(12)
    wrong = "wrong-secret-" + secrets.token_hex(12)
    server = _serve(make_server, batch_size=10, transport={"token": token})
    record = tmp_path / "wire"
    relay = proxy(server.port, "--record-dir", str(record))
    with pytest.raises(PermissionError) as refused:
        TcpClient(LOCALHOST, relay.port, EXAMPLE, token=wrong)
    assert token not in str(refused.value)
    assert wrong not in str(refused.value)
    # TCP (the relay stands for the network between two hosts), so that the samples are in
    # the capture too.
    with TcpClient(LOCALHOST, relay.port, EXAMPLE, token=token, shared_memory=False) as client:
        assert client.protocol == 2
        client.send_many(make_sample(i) for i in range(20))
        client.wait(timeout=WAIT_S)
    assert take(server, 2, batch_ids) == list(range(20))
    relay.command("quit")
    relay.child.proc.wait(WAIT_S)
    captured = {p.name: p.read_bytes() for p in sorted(record.iterdir())}
    assert set(captured) >= {"conn0.c2s", "conn0.s2c", "conn1.c2s", "conn1.s2c"}, captured.keys()
    # The capture is the real conversation: each hello echoes its connection's nonce.
    for conn in ("conn0", "conn1"):
        s2c, c2s = captured[f"{conn}.s2c"], captured[f"{conn}.c2s"]
        assert s2c[:6] == b"ECHO\x02t", s2c[:6]
        assert c2s[:32] == s2c[6:38]
    assert len(captured["conn1.c2s"]) >= 20 * (1 + PAYLOAD)
    for secret in (token, wrong):
        raw = secret.encode()
        forms = [raw, raw.hex().encode(), base64.b64encode(raw), raw[:8], raw[-8:]]
        for name, data in captured.items():
            for form in forms:
                assert form not in data, f"{form!r} found in {name}"


def test_tokens_missing_wrong_and_unproven_are_permission_errors(make_server: Any) -> None:
    token = "perm-" + secrets.token_hex(8)
    server = _serve(make_server, transport={"token": token})
    with pytest.raises(PermissionError, match=r"(?i)token") as missing:
        TcpClient(LOCALHOST, server.port, EXAMPLE)
    with pytest.raises(PermissionError) as wrong:
        TcpClient(LOCALHOST, server.port, EXAMPLE, token=token + "x")
    for exc in (missing, wrong):
        assert token not in str(exc.value)
    # A client without a token refuses a token server's offer itself, without a hello, so
    # the server may not see that one; the wrong token it does see.
    _stats(server, lambda s: s.handshakes_refused_auth_total in (1, 2), "auth refusals")
    assert server.stats().samples_inserted_total == 0
    # A client that has a token refuses a server that cannot prove it has it too.
    open_server = _serve(make_server)
    with pytest.raises(PermissionError):
        TcpClient(LOCALHOST, open_server.port, EXAMPLE, token=token)


def test_echo_token_comes_from_the_environment_and_an_empty_one_means_none(
    make_server: Any, batch_ids: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "env-" + secrets.token_hex(8)
    monkeypatch.setenv("ECHO_TOKEN", token)
    transport = _transport()
    assert token not in repr(transport)
    assert token not in repr(_transport(token=token))
    server = make_server(batch_size=2, transport=transport)
    server.start()
    with TcpClient(LOCALHOST, server.port, EXAMPLE) as client:  # token from $ECHO_TOKEN
        client.send_many(make_sample(i) for i in range(2))
    assert take(server, 1, batch_ids) == [0, 1]
    monkeypatch.setenv("ECHO_TOKEN", "")  # set but empty: no token, on both sides
    with pytest.raises(PermissionError):
        TcpClient(LOCALHOST, server.port, EXAMPLE)
    open_server = _serve(make_server)
    with TcpClient(LOCALHOST, open_server.port, EXAMPLE) as client:
        assert client.protocol == 2


def test_a_v1_peer_is_refused_by_a_token_server_before_any_sample(
    make_server: Any,
) -> None:
    server = _serve(make_server, transport={"token": "v1-refused"})
    with _connect(server.port) as sock:
        read_offer(sock, after_v1=False)
        sock.sendall(raw_sample(1) * 3)  # v1 data: the nonce is not there
        rest = _recv_until_eof(sock)
    assert b"\x01" * 3 not in rest
    info = _stats(
        server,
        lambda s: s.handshakes_refused_protocol_total + s.handshakes_refused_auth_total == 1,
        "one refused handshake",
    )
    assert info.samples_inserted_total == 0
    assert info.v1_connections_total == 0
    with pytest.raises((PermissionError, ValueError), match=r"(?i)token|v2|version 2"):
        TcpClient(LOCALHOST, server.port, EXAMPLE, protocol=1, token="v1-refused")


# --- reconnect ---------------------------------------------------------------------------------


def _sent_and_acked(client: TcpClient, n: int) -> None:
    assert (client.sent, client.acked) == (n, n)


def test_a_dropped_connection_resumes_with_exact_counts(
    make_server: Any, batch_ids: Any, proxy: Callable[..., Proxy]
) -> None:
    """Deterministic drops through the proxy: an ack lost in a drop is not resent (the server
    deduplicates), a sample lost in a drop is resent once; every sample is stored once."""
    server = _serve(make_server, batch_size=5, num_buffers=8)
    relay = proxy(server.port)
    # TCP: the blackholes cut samples and acks on the relay, which shared memory goes around
    # (test_a_shared_memory_client_resumes_through_a_dropped_connection_exactly_once).
    client = TcpClient(
        LOCALHOST, relay.port, EXAMPLE, reconnect=True, reconnect_timeout=20.0, shared_memory=False
    )
    try:
        for i in range(10):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        _sent_and_acked(client, 10)
        assert client.resumed_from is None
        # 1. The server queues 5 more, but their acks are lost in the drop.
        relay.command("blackhole s2c")
        for i in range(10, 15):
            client.send(make_sample(i), timeout=WAIT_S)
        _stats(server, lambda s: s.samples_inserted_total == 15, "15 inserted")
        assert client.acked == 10
        relay.command("drop")
        client.wait(timeout=3 * WAIT_S)
        _sent_and_acked(client, 15)
        assert (client.reconnects, client.resent, client.resumed_from) == (1, 0, 15)
        info = _stats(server, lambda s: s.sessions_resumed_total == 1, "one resumed session")
        assert info.samples_deduplicated_total == 5
        # 2. The next 5 never reach the server: they are resent after the drop.
        relay.command("blackhole c2s")
        for i in range(15, 20):
            client.send(make_sample(i), timeout=WAIT_S)
        assert server.stats().samples_inserted_total == 15
        relay.command("drop")
        client.wait(timeout=3 * WAIT_S)
        _sent_and_acked(client, 20)
        assert (client.reconnects, client.resent, client.resumed_from) == (2, 5, 15)
    finally:
        assert client.close(timeout=WAIT_S) is True
    assert take(server, 4, batch_ids) == list(range(20))
    _assert_nothing_more(server)
    info = _stats(server, lambda s: s.sessions_resumed_total == 2, "two resumed sessions")
    assert info.samples_deduplicated_total == 5
    assert info.samples_inserted_total == 20
    assert info.v2_connections_total == 3


def test_without_reconnect_a_drop_is_a_connection_closed_error(
    make_server: Any, proxy: Callable[..., Proxy]
) -> None:
    server = _serve(make_server)
    relay = proxy(server.port)
    client = TcpClient(LOCALHOST, relay.port, EXAMPLE)
    try:
        client.send(make_sample(0), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        relay.command("drop")

        def keep_sending() -> None:
            # Until the client notices the drop: a count of sends is no bound here, as on a
            # busy machine (or on the shared-memory path, where samples do not cross the
            # relay) many can complete before it reads the reset. Bounded in time instead.
            deadline = time.monotonic() + 3 * WAIT_S
            for i in range(1, 10_000_000):
                if time.monotonic() > deadline:
                    return
                client.send(make_sample(i), timeout=WAIT_S)
                client.wait(timeout=WAIT_S)

        with pytest.raises(ConnectionClosedError):
            keep_sending()
        assert client.reconnects == 0
    finally:
        client.close(timeout=1.0)


@pytest.mark.serial
def test_reconnect_gives_up_after_reconnect_timeout_with_the_gil_released(
    make_server: Any, spawn: Any
) -> None:
    server = _serve(make_server)
    client = TcpClient(LOCALHOST, server.port, EXAMPLE, reconnect=True, reconnect_timeout=1.5)
    try:
        client.send(make_sample(0), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        # Said to come back, so the worker keeps trying: every reconnect attempt is refused.
        server.close(restarting=True)
        closed = time.monotonic()

        def send_and_wait() -> None:
            client.send(make_sample(1), timeout=3 * WAIT_S)
            client.wait(timeout=3 * WAIT_S)

        worker = spawn(send_and_wait)
        # This thread runs meanwhile, so the waiting one does not hold the GIL.
        assert_blocked(worker, after(0.5), "send()/wait() during a reconnect")
        with pytest.raises(ConnectionClosedError):
            worker.finish(3 * WAIT_S)
        elapsed = time.monotonic() - closed
        assert 1.2 <= elapsed <= 8.0, f"gave up after {elapsed:.2f}s, reconnect_timeout 1.5s"
    finally:
        client.close(timeout=1.0)


@pytest.mark.serial
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_interrupts_a_send_blocked_in_a_reconnect() -> None:
    code = "from _blocked import after, announce_when\n" + textwrap.dedent(
        """
        import numpy as np
        import echo

        EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
        sample = {"id": np.array(1, np.int64), "obs": np.ones(3, np.float32)}
        server = echo.Server(EXAMPLE, 4, transport=echo.TcpTransport(0, host="127.0.0.1"))
        server.start()
        client = echo.TcpClient("127.0.0.1", server.port, EXAMPLE, reconnect=True,
                                reconnect_timeout=60.0)
        client.send(sample)
        client.wait(timeout=10)
        server.close(restarting=True)  # the client keeps trying to reconnect
        announce_when(after(0.5))
        for _ in range(1000):
            client.send(sample)
            client.wait()
        """
    )
    assert_ctrl_c_interrupts_promptly(code)


def test_a_new_learner_on_the_same_port_gets_every_unacknowledged_sample_once(
    make_server: Any, batch_ids: Any
) -> None:
    """In-process restart: the first server is closed with samples acknowledged but not yet
    sampled (lost, as documented) and samples never acknowledged (the ring was full); a new
    server on the same port receives exactly the unacknowledged ones, in order."""
    first = _serve(make_server, batch_size=1, num_buffers=2, producer_queue_size=1, num_drainers=1)
    port = first.port
    # TCP: the third sample is acknowledged from the ingress queue while the ring of 2 is
    # full (over shared memory it would wait, unacknowledged, in the segment).
    client = TcpClient(
        LOCALHOST,
        port,
        EXAMPLE,
        max_inflight_msgs=32,
        reconnect=True,
        reconnect_timeout=20.0,
        shared_memory=False,
    )
    try:
        for i in range(3):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        assert take(first, 3, batch_ids) == [0, 1, 2]
        for i in range(3, 30):  # nobody samples: only a few fit
            client.send(make_sample(i), timeout=WAIT_S)
        # The first server stops acknowledging once full: wait until the count is settled.
        acked = poll(
            lambda: (client.acked, time.sleep(0.3), client.acked),
            lambda t: t[0] == t[2] and 3 < t[0] < 30,
            "acks settled",
        )[0]
        first.close(restarting=True)
        second = make_server(
            batch_size=1, num_buffers=64, transport=TcpTransport(port=port, host=LOCALHOST)
        )
        second.start()
        client.wait(timeout=3 * WAIT_S)
        assert client.reconnects == 1
        assert client.resent == 30 - acked
        _sent_and_acked(client, 30)
    finally:
        assert client.close(timeout=WAIT_S) is True
    assert take(second, 30 - acked, batch_ids) == list(range(acked, 30))
    _assert_nothing_more(second)
    info = second.stats()
    assert (info.sessions_resumed_total, info.samples_deduplicated_total) == (0, 0)


WORKER = textwrap.dedent(
    """
    import json, signal, sys, threading, time
    import numpy as np
    import echo

    port, w, n, window = (int(a) for a in sys.argv[1:5])
    shared_memory = {"auto": None, "true": True, "false": False}[sys.argv[5]]
    # Optional (the multi-host tests): the learner's host, seconds between sends, the
    # heartbeat timeout, the id stride, and the alarm.
    host, pace, heartbeat, STRIDE, alarm = "127.0.0.1", 0.0, 10.0, 10_000, 170
    if len(sys.argv) > 6:
        host, pace, heartbeat = sys.argv[6], float(sys.argv[7]), float(sys.argv[8])
        STRIDE, alarm = int(sys.argv[9]), int(sys.argv[10])
    signal.alarm(alarm)  # never outlive a broken test for long
    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
    lock = threading.Lock()

    def say(line):
        with lock:
            sys.stdout.write(line + "\\n")
            sys.stdout.flush()

    def make_sample(i):
        return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}

    # The proxy may cut the very first handshake too; only a new client helps then.
    client = None
    for attempt in range(50):
        try:
            client = echo.TcpClient(host, port, EXAMPLE, max_inflight_msgs=window,
                                    reconnect=True, reconnect_timeout=40.0,
                                    shared_memory=shared_memory, heartbeat_timeout=heartbeat)
            break
        except (ConnectionError, TimeoutError) as exc:
            say(f"connect-failed {type(exc).__name__}: {exc}")
            time.sleep(0.05)
    assert client is not None
    done = threading.Event()

    def watch():
        # "s TIME RECONNECTS ACKED SENT", read before TIME: on every change, and every 0.1 s.
        last, last_t = None, 0.0
        while not done.is_set():
            state = (client.reconnects, client.acked, client.sent)
            now = time.monotonic()
            if state != last or now - last_t > 0.1:
                say(f"s {now!r} {state[0]} {state[1]} {state[2]}")
                last, last_t = state, now
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    error = None
    flushed = False
    try:
        for seq in range(n):
            client.send(make_sample(w * STRIDE + seq), timeout=90)
            if pace:
                time.sleep(pace)
        client.wait(timeout=90)
        flushed = client.close(timeout=30)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    done.set()
    watcher.join(5)
    say("result " + json.dumps({
        "w": w, "sent": client.sent, "acked": client.acked, "reconnects": client.reconnects,
        "resent": client.resent, "protocol": client.protocol, "flushed": flushed,
        "error": error, "path": client.transport_path,
    }))
    """
)


def _start_workers(
    children: Callable[..., Child],
    port: int,
    num: int,
    n: int,
    rng: random.Random,
    shared_memory: str = "false",
) -> list[Child]:
    """`num` reconnecting workers (`shared_memory`: "false" by default: a relay between them
    and the learner stands for the network, which shared memory would go around)."""
    return [
        children(
            f"worker{w}",
            [
                sys.executable,
                "-c",
                WORKER,
                str(port),
                str(w),
                str(n),
                str(rng.choice((1, 4, 32))),
                shared_memory,
            ],
        )
        for w in range(num)
    ]


def _results(workers: list[Child], timeout: float) -> list[dict[str, Any]]:
    results = []
    for worker in workers:
        # A worker may have printed its result while an earlier drain() read its lines.
        done = [ln for ln in worker.lines if ln.startswith("result ")]
        line = done[0] if done else worker.expect("result ", timeout)
        result = json.loads(line.split(" ", 1)[1])
        assert result["error"] is None, (result, worker.stderr())
        assert result["flushed"] is True, result
        results.append(result)
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [12, 34])
def test_eight_workers_through_a_proxy_that_drops_at_random_points_store_each_sample_once(
    make_server: Any,
    batch_ids: Any,
    children: Callable[..., Child],
    proxy: Callable[..., Proxy],
    seed: int,
) -> None:
    # Each worker's connection carries about 8.5 KB one way (a hello, 400 frames of 21 bytes)
    # and 0.5 KB the other (greeting, reply, 400 acks): most connections are cut somewhere,
    # in the greeting, the hello, a frame or the acks, until 40 drops are used up.
    num_workers, n, batch_size = 8, 400, 10
    server = _serve(make_server, batch_size=batch_size, num_buffers=8)
    relay = proxy(
        server.port,
        "--seed", str(seed),
        "--drop-prob", "0.8",
        "--c2s-bytes", "1:4000",
        "--s2c-bytes", "1:300",
        "--max-drops", "40",
    )  # fmt: skip
    workers = _start_workers(children, relay.port, num_workers, n, random.Random(seed))
    ids = take(server, num_workers * n // batch_size, batch_ids, timeout=45.0)
    results = _results(workers, 60.0)
    per_worker: dict[int, list[int]] = collections.defaultdict(list)
    for i in ids:
        per_worker[i // ID_STRIDE].append(i % ID_STRIDE)
    for w in range(num_workers):
        seqs = per_worker[w]
        dups = [s for s, c in collections.Counter(seqs).items() if c > 1]
        assert not dups, f"worker {w}: samples stored twice: {dups[:10]}"
        assert seqs == list(range(n)), f"worker {w}: out of order or missing: {seqs[:20]}..."
    _assert_nothing_more(server)
    assert all(r["protocol"] == 2 for r in results), results
    assert all(r["sent"] == r["acked"] == n for r in results), results
    drops = relay.stats()["drops"]
    reconnects = sum(r["reconnects"] for r in results)
    assert drops >= 5, f"the proxy dropped only {drops} connections"
    assert reconnects >= 1, results
    info = _stats(server, lambda s: s.active_connections == 0, "every connection closed")
    assert info.samples_inserted_total == num_workers * n
    assert info.sessions_resumed_total >= 1
    assert info.v2_connections_total >= num_workers + info.sessions_resumed_total
    resent = sum(r["resent"] for r in results)
    print(
        f"{drops} drops, {reconnects} reconnects, {resent} resent,"
        f" {info.sessions_resumed_total} resumed, {info.samples_deduplicated_total} deduplicated"
    )


LEARNER = textwrap.dedent(
    """
    import json, signal, sys, threading, time
    import numpy as np
    import echo

    signal.alarm(170)
    port, delay = int(sys.argv[1]), float(sys.argv[2])
    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
    # A queue of 8 per connection (not the default 64 KiB of samples, 256 of these): workers
    # stay at most a few samples ahead of what this slow learner takes, so most of them are
    # still sending when it is killed.
    server = echo.Server(EXAMPLE, 1, num_buffers=2, producer_queue_size=8,
                         transport=echo.TcpTransport(port=port, host="127.0.0.1"))
    listening = time.monotonic()  # before start(): no connection was accepted before it
    server.start()
    print("port", server.port, repr(listening), flush=True)

    def commands():
        for line in sys.stdin:
            if line.strip() == "drain":
                server.close(drain=True)
                return

    threading.Thread(target=commands, daemon=True).start()
    for _ in range(10**7):
        sample = server.sample(timeout=150)
        if sample is None:
            break
        i = int(sample.batch["id"][0])
        intact = bool((sample.batch["obs"][0] == np.float32(i)).all())
        sys.stdout.write(f"id {i} {int(intact)}\\n")
        sys.stdout.flush()
        if delay:
            time.sleep(delay)
    stats = server.stats().as_dict()
    print("stats", json.dumps({k: v for k, v in stats.items() if isinstance(v, int)}), flush=True)
    print("done", flush=True)
    """
)


def _learner_ids(child: Child) -> list[int]:
    ids = []
    for line in child.lines:
        match = re.fullmatch(r"id (\d+) ([01])", line)
        if match:
            assert match.group(2) == "1", f"{child.name}: torn sample {line!r}"
            ids.append(int(match.group(1)))
    return ids


def _snapshots(worker: Child) -> list[tuple[float, int, int, int]]:
    out = []
    for line in worker.lines:
        if line.startswith("s "):
            _, t, r, a, s = line.split()
            out.append((float(t), int(r), int(a), int(s)))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_a_learner_killed_and_restarted_on_the_same_port_gets_every_unacknowledged_sample_once(
    children: Callable[..., Child], path: str
) -> None:
    """8 worker processes send while the learner process is SIGKILLed at a random point and a
    new one starts on the same port. For each worker, with `acked` its count of samples the
    old learner acknowledged (read by the worker just before the new learner listened): the
    new learner receives exactly its samples `acked..n`, once each, in order. The old learner
    handed out a prefix `0..c` of each worker's samples; those between `c` and `acked` were
    acknowledged but not yet trained on, and are lost, as documented. Over TCP, and over
    same-host shared memory (a new segment from the new learner; what the old one had not
    taken from the old segment is resent into the new one)."""
    rng = random.Random(20260412)
    num_workers, n = 8, 300
    old = children("learner-old", [sys.executable, "-c", LEARNER, "0", "0.001"], stdin=True)
    port = int(old.expect("port ").split()[1])
    shared_memory = "true" if path == "shm" else "false"
    workers = _start_workers(children, port, num_workers, n, rng, shared_memory)
    kill_after = rng.randint(300, 900)
    deadline = time.monotonic() + 60
    for _ in range(10**6):
        old.drain()
        if len(_learner_ids(old)) >= kill_after:
            break
        assert time.monotonic() < deadline, "the old learner did not get far enough"
        time.sleep(0.005)
    killed = time.monotonic()
    old.kill()
    old.read_to_eof()
    # A worker that was already done is not part of the restart (unlikely: each has n).
    for worker in workers:
        worker.drain()
    finished = {
        w for w, wk in enumerate(workers) if any(ln.startswith("result ") for ln in wk.lines)
    }
    running = [wk for w, wk in enumerate(workers) if w not in finished]
    assert running, "every worker finished before the kill: kill earlier"
    # Every running worker's watcher reports after the kill before the new learner starts, so
    # its last report before the new learner listened is what the old learner acknowledged.
    poll(
        lambda: [wk.drain() or (_snapshots(wk) or [(0.0,)])[-1][0] for wk in running],
        lambda ts: all(t > killed for t in ts),
        "every running worker reported after the kill",
    )
    new = children("learner-new", [sys.executable, "-c", LEARNER, str(port), "0"], stdin=True)
    _, new_port, listening = new.expect("port ").split()
    assert int(new_port) == port
    results = _results(workers, 90.0)
    new.send_line("drain")
    new.expect("done", 3 * WAIT_S)
    stats = json.loads(next(ln for ln in new.lines if ln.startswith("stats ")).split(" ", 1)[1])

    old_ids, new_ids = _learner_ids(old), _learner_ids(new)
    lost = 0
    for w, (worker, result) in enumerate(zip(workers, results, strict=True)):
        old_seqs = [i % ID_STRIDE for i in old_ids if i // ID_STRIDE == w]
        new_seqs = [i % ID_STRIDE for i in new_ids if i // ID_STRIDE == w]
        assert old_seqs == list(range(len(old_seqs))), f"worker {w}: old learner out of order"
        if w in finished:
            assert (new_seqs, result["reconnects"]) == ([], 0), result
            continue
        before = [snap for snap in _snapshots(worker) if snap[0] < float(listening)]
        assert before, f"worker {w} reported nothing before the new learner listened"
        _, reconnects_then, acked, sent = before[-1]
        assert reconnects_then == 0
        if acked == n:  # finished between the kill and `finished` above: nothing to resume
            assert (new_seqs, result["resent"]) == ([], 0), result
            continue
        assert new_seqs == list(range(acked, n)), (
            f"worker {w}: the new learner got {new_seqs[:5]}..{new_seqs[-5:]} "
            f"({len(new_seqs)}), expected {acked}..{n - 1}"
        )
        assert result["reconnects"] >= 1, result
        assert result["resent"] == sent - acked, (result, sent, acked)
        assert result["path"] == path, result
        lost += max(0, acked - len(old_seqs))
    assert stats["sessions_resumed_total"] == 0
    assert stats["samples_deduplicated_total"] == 0
    assert stats["v2_connections_total"] >= len(running)
    print(f"killed after {kill_after} samples; {lost} acknowledged but never trained on")


def test_a_shared_memory_client_resumes_through_a_dropped_connection_exactly_once(
    make_server: Any, batch_ids: Any, proxy: Callable[..., Proxy]
) -> None:
    # A ring of 40, nobody sampling: of 60 samples the learner takes 40, and 20 wait in the
    # worker's segment. The relay in front of the learner then resets the TCP connection
    # (shared memory itself goes around the relay: only the connection's liveness passes
    # it). The client reconnects to the same learner, gets a new segment, and resends the 20
    # it was never acknowledged; the old segment's untaken samples go with the old one.
    server = _serve(make_server, batch_size=10, num_buffers=4)
    relay = proxy(server.port)
    client = TcpClient(
        LOCALHOST,
        relay.port,
        EXAMPLE,
        reconnect=True,
        reconnect_timeout=WAIT_S,
        shared_memory=True,
    )
    assert client.transport_path == "shm"
    for i in range(60):
        client.send(make_sample(i), timeout=WAIT_S)
    poll(lambda: (server.stats().store_size, client.acked), lambda s: s == (40, 40), "a full ring")
    relay.command("drop")
    # The next call that waits notices the drop and reconnects (samples written before the
    # client noticed would go into the old segment, which the old connection's task still
    # drains until the new connection takes the session over).
    for _ in range(100):
        with contextlib.suppress(TimeoutError):  # the ring is still full
            client.wait(timeout=0.05)
        if client.reconnects:
            break
    assert (client.reconnects, client.resent, client.transport_path) == (1, 20, "shm")
    for i in range(60, 70):  # 30 in flight: within the client's window of 32
        client.send(make_sample(i), timeout=WAIT_S)
    assert take(server, 7, batch_ids) == list(range(70))
    client.wait(timeout=WAIT_S)
    assert client.reconnects == 1
    stats = server.stats()
    assert (stats.sessions_resumed_total, stats.shm_connections_total) == (1, 2)
    assert client.close(timeout=WAIT_S)


# --- heartbeats --------------------------------------------------------------------------------


@pytest.mark.serial
def test_a_client_detects_a_silent_server_within_its_heartbeat_timeout(
    make_server: Any, proxy: Callable[..., Proxy]
) -> None:
    server = _serve(make_server)
    relay = proxy(server.port)
    # TCP: the relay stands for the network between two hosts (on shared memory, samples
    # still get through a stalled relay; test_shm.py covers that path's liveness).
    client = TcpClient(LOCALHOST, relay.port, EXAMPLE, heartbeat_timeout=1.0, shared_memory=False)
    try:
        client.send(make_sample(0), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        relay.command("stall")  # sockets stay open; nothing gets through any more
        stalled = time.monotonic()

        def send_and_wait() -> None:
            client.send(make_sample(1), timeout=WAIT_S)
            client.wait(timeout=3 * WAIT_S)

        with pytest.raises(ConnectionClosedError):
            send_and_wait()
        elapsed = time.monotonic() - stalled
        assert 0.5 <= elapsed <= 5.0, f"noticed after {elapsed:.2f}s with a 1 s timeout"
    finally:
        client.close(timeout=1.0)


def test_a_server_drops_a_silent_client_within_its_heartbeat_timeout(
    make_server: Any, proxy: Callable[..., Proxy]
) -> None:
    server = _serve(make_server, transport={"heartbeat_timeout": 1.0})
    relay = proxy(server.port)
    client = TcpClient(LOCALHOST, relay.port, EXAMPLE)  # its own timeout: 10 s
    try:
        client.send(make_sample(0), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        _stats(server, lambda s: s.active_connections == 1, "connected")
        relay.command("stall")
        stalled = time.monotonic()
        _stats(server, lambda s: s.active_connections == 0, "the silent client dropped", 5.0)
        assert time.monotonic() - stalled >= 0.5
    finally:
        client.close(timeout=1.0)


def test_heartbeats_keep_an_idle_v2_connection_and_v1_connections_have_none(
    make_server: Any, batch_ids: Any
) -> None:
    server = _serve(make_server, batch_size=2, transport={"heartbeat_timeout": 1.0})
    v2 = TcpClient(LOCALHOST, server.port, EXAMPLE, heartbeat_timeout=1.0)
    v1 = TcpClient(LOCALHOST, server.port, EXAMPLE, protocol=1)
    try:
        assert (v2.protocol, v1.protocol) == (2, 1)
        for i, client in enumerate((v2, v1)):  # (a v1 connection is served once it sends)
            client.send(make_sample(i), timeout=WAIT_S)
            client.wait(timeout=WAIT_S)
        _stats(server, lambda s: s.active_connections == 2, "both connections served")
        time.sleep(3.0)  # three heartbeat timeouts of silence from the user's code
        assert server.stats().active_connections == 2
        v2.send(make_sample(2), timeout=WAIT_S)
        v1.send(make_sample(3), timeout=WAIT_S)
        v2.wait(timeout=WAIT_S)
        v1.wait(timeout=WAIT_S)
        assert v2.reconnects == 0
    finally:
        assert v2.close(timeout=WAIT_S) is True
        assert v1.close(timeout=WAIT_S) is True
    assert sorted(take(server, 2, batch_ids)) == [0, 1, 2, 3]


def test_backpressure_is_not_mistaken_for_a_dead_peer(
    make_server: Any, batch_ids: Any, spawn: Any
) -> None:
    """A learner that stops sampling stops reading, not heartbeating: a worker held back by
    backpressure for several heartbeat timeouts carries on once the learner samples again,
    without a reconnect, and the server keeps the silent, blocked worker."""
    server = _serve(
        make_server,
        batch_size=2,
        num_buffers=2,
        producer_queue_size=1,
        num_drainers=1,
        transport={"heartbeat_timeout": 1.0},
    )
    client = TcpClient(LOCALHOST, server.port, EXAMPLE, max_inflight_msgs=4, heartbeat_timeout=1.0)
    total = 40

    def produce() -> None:
        for i in range(total):
            client.send(make_sample(i), timeout=3 * WAIT_S)
        client.wait(timeout=3 * WAIT_S)

    try:
        producer = spawn(produce)
        _stats(server, lambda s: s.push_blocked_count > 0, "the worker is held back")
        time.sleep(3.5)  # three heartbeat timeouts of backpressure
        assert producer.is_alive()
        assert server.stats().active_connections == 1
        assert take(server, total // 2, batch_ids) == list(range(total))
        producer.finish(3 * WAIT_S)
        assert client.reconnects == 0
    finally:
        assert client.close(timeout=WAIT_S) is True


def test_heartbeat_and_session_timeouts_are_checked() -> None:
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="heartbeat_timeout"):
            _transport(heartbeat_timeout=bad)
        with pytest.raises(ValueError, match="session_timeout"):
            _transport(session_timeout=bad)


def test_client_timeouts_are_checked(make_server: Any) -> None:
    server = _serve(make_server)
    for name in ("heartbeat_timeout", "reconnect_timeout"):
        for bad in (-1.0, math.nan):
            with pytest.raises(ValueError, match=name):
                TcpClient(LOCALHOST, server.port, EXAMPLE, reconnect=True, **{name: bad})


# --- counters ----------------------------------------------------------------------------------


def test_connection_counters_by_protocol_and_in_as_dict(make_server: Any) -> None:
    server = _serve(make_server)
    for i, protocol in enumerate((1, "auto", 2, 1)):
        # A v1 connection counts once the server has seen its first bytes (a sample).
        with TcpClient(LOCALHOST, server.port, EXAMPLE, protocol=protocol) as client:
            client.send(make_sample(i), timeout=WAIT_S)
    with _connect(server.port) as sock:  # a raw v1 client that sends one sample
        read_offer(sock, after_v1=True)
        sock.sendall(raw_sample(0))
        assert recv_exact(sock, 1) == b"\x01"
    info = _stats(
        server,
        lambda s: (s.v1_connections_total, s.v2_connections_total) == (3, 2),
        "3 v1 and 2 v2 connections",
    )
    fields = [
        "sessions_resumed_total",
        "samples_deduplicated_total",
        "handshakes_refused_protocol_total",
        "handshakes_refused_auth_total",
        "handshakes_refused_layout_total",
        "v1_connections_total",
        "v2_connections_total",
    ]
    as_dict = info.as_dict()
    for name in fields:
        assert isinstance(getattr(info, name), int), name
        assert as_dict[name] == getattr(info, name), name
    assert (as_dict["v1_connections_total"], as_dict["v2_connections_total"]) == (3, 2)
    assert info.sessions_resumed_total == info.samples_deduplicated_total == 0
    with pytest.raises(AttributeError):
        info.v2_connections_total = 0  # type: ignore[misc]


def test_client_counters_start_at_zero_and_repr_hides_the_token(make_server: Any) -> None:
    token = "repr-" + secrets.token_hex(8)
    server = _serve(make_server, transport={"token": token})
    with TcpClient(LOCALHOST, server.port, EXAMPLE, token=token, reconnect=True) as client:
        assert (client.reconnects, client.resent, client.protocol) == (0, 0, 2)
        assert token not in repr(client)
    transport = _transport(token=token)
    assert token not in repr(transport)
    assert token not in str(transport)
