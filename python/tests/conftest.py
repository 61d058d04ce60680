"""Shared fixtures for the in-process `echo.Server` tests.

Every sample made by `make_sample(i)` encodes its id `i` twice (the 0-d `id` leaf and every
element of `obs`), so `batch_ids` can both read the ids of a batch and check that no slot is
torn or misaligned.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import echo

# Ray (test_ray.py, test_bench_ray.py, the docs' Ray blocks) resolves "127.0.0.1" to this
# machine's outside address unless told it runs one node's worth of loopback. Ray reads this
# when it is first imported, by whichever test module that is, and the children inherit it:
# every byte of the tests stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Bounded, deterministic-enough property tests that leave no `.hypothesis/` folder behind.
settings.register_profile(
    "echo",
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("echo")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "peer: wire compatibility with the published id-echo 0.2.1 (needs $ECHO_PEER_PYTHON "
        "or network access to build a virtualenv with it)",
    )
    config.addinivalue_line(
        "markers",
        "serial: asserts a wall-clock bound (Ctrl-C honoured within 2 s, a timeout noticed in "
        "time); scripts/test_py.sh runs these after the others, in one process, with no other "
        "test beside them",
    )


HERE = Path(__file__).resolve().parent

# How long any single blocking step in a test may take before it counts as a hang.
WAIT_S = 10.0


@pytest.fixture
def example() -> dict[str, np.ndarray]:
    """A small flat-dict example: a 0-d int64 id and a float32 vector."""
    return {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}


@pytest.fixture
def make_sample() -> Callable[[int], dict[str, np.ndarray]]:
    """`make_sample(i)`: a sample matching `example` whose every value encodes id `i`."""

    def make(i: int) -> dict[str, np.ndarray]:
        return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}

    return make


@pytest.fixture
def batch_ids() -> Callable[[Any], list[int]]:
    """`batch_ids(batch)`: the ids of a batch of `make_sample` samples, in slot order.

    Also asserts that every slot is internally consistent (`obs` encodes the same id), which
    catches torn or misaligned slots.
    """

    def ids(batch: Any) -> list[int]:
        id_leaf = np.array(batch["id"])
        obs_leaf = np.array(batch["obs"])
        assert id_leaf.ndim == 1
        np.testing.assert_array_equal(
            obs_leaf, np.repeat(id_leaf.astype(np.float32)[:, None], 3, axis=1)
        )
        return [int(x) for x in id_leaf]

    return ids


def poll(
    probe: Callable[[], Any], done: Callable[[Any], bool], what: str, timeout: float = WAIT_S
) -> Any:
    """Calls `probe` until `done(value)` (at most `timeout` seconds); returns the value.

    How a test waits for another thread or process to reach a state (a counter, a queue
    depth) instead of sleeping and hoping it got there."""
    deadline = time.monotonic() + timeout
    value = probe()
    for _ in range(100_000):
        if done(value):
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
        value = probe()
    raise AssertionError(f"{what}: not reached within {timeout}s, last value {value!r}")


class Worker(threading.Thread):
    """A daemon thread that records its target's return value or exception (never raises,
    so pytest's unhandled-thread-exception warning, an error here, cannot fire)."""

    def __init__(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self._args = args
        self._kwargs = kwargs
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn(*self._args, **self._kwargs)
        except BaseException as exc:  # noqa: BLE001 - recorded and checked by the test
            self.error = exc

    def finish(self, timeout: float = WAIT_S) -> Any:
        """Joins (bounded), asserts the thread ended, re-raises its error, returns its result."""
        self.join(timeout)
        assert not self.is_alive(), f"thread running {self._fn!r} did not finish in {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def assert_blocked(worker: Worker, probe: Callable[[], bool], what: str = "the call") -> None:
    """Waits (bounded) until `probe()` shows `worker`'s call blocked (see `_blocked.blocked`),
    then asserts the worker is still running: nothing could have unblocked it."""
    poll(probe, bool, f"{what} blocking")
    assert worker.is_alive(), f"expected {what} to block, it ended: {worker.error!r}"


def child_env() -> dict[str, str]:
    """The environment of a child interpreter: faulthandler on, and this folder importable
    (for `_blocked`)."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": path}


# The first line of a child that must answer Ctrl-C: Python's SIGINT handler, which raises
# KeyboardInterrupt. A test run started in the background (`cmd &` without job control, as some
# CI runners start their steps) inherits SIGINT ignored, and an interpreter that starts with it
# ignored installs no handler. (Not a `preexec_fn`: that makes subprocess fork the pytest
# process, which JAX, imported by some tests, warns against.)
ANSWER_CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line of `proc`'s stdout, waiting at most `timeout` seconds in all ("" if none came,
    what there was at the end of the stream).

    Reads the pipe's descriptor a byte at a time, never through `proc.stdout`'s buffer: a
    buffered `readline()` reads ahead, and a second line it took along would sit in the
    buffer where `select` cannot see it, so the next call would time out with the line in
    hand. Whatever this leaves in the pipe, `proc.communicate()` still gets."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return ""
            byte = os.read(fd, 1)
            if not byte:
                break
            line += byte
    return line.decode()


def assert_ctrl_c_interrupts_promptly(code: str) -> None:
    """Runs `code` in a fresh interpreter that prints `ready` once its main thread is blocked
    (`_blocked.announce_when`), sends it SIGINT, and checks that it ends within 2 s with a
    KeyboardInterrupt and nothing worse."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ANSWER_CTRL_C + code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        line = read_line(proc, timeout=30)
        assert line.strip() == "ready", f"child did not block: {line!r}"
        assert proc.poll() is None, "child exited before SIGINT"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=5)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "KeyboardInterrupt" in stderr, stderr
    for marker in ("panicked", "PanicException", "Fatal Python error"):
        assert marker not in stderr, stderr
    assert proc.returncode != 0
    assert elapsed < 2.0, f"took {elapsed:.2f}s to honour Ctrl-C"


class _Registry:
    def __init__(self) -> None:
        self.servers: list[echo.Server] = []
        self.workers: list[Worker] = []

    def teardown(self) -> None:
        # Close first: that releases any thread still blocked in sample() or submit().
        for server in self.servers:
            server.close()
        stuck = []
        for worker in self.workers:
            worker.join(WAIT_S)
            if worker.is_alive():
                stuck.append(worker)
        assert not stuck, f"{len(stuck)} worker thread(s) still blocked after close()"


@pytest.fixture
def _registry() -> Iterator[_Registry]:
    registry = _Registry()
    yield registry
    registry.teardown()


@pytest.fixture
def make_server(_registry: _Registry, example: dict[str, np.ndarray]) -> Callable[..., echo.Server]:
    """`make_server(example=..., batch_size=4, **kwargs)`: a Server closed at teardown."""

    def make(ex: Any = None, batch_size: int = 4, **kwargs: Any) -> echo.Server:
        server = echo.Server(example if ex is None else ex, batch_size, **kwargs)
        _registry.servers.append(server)
        return server

    return make


@pytest.fixture
def make_filled(
    make_server: Callable[..., echo.Server], make_sample: Callable[[int], Any]
) -> Callable[..., echo.Server]:
    """`make_filled(n, **kwargs)`: a `make_server(**kwargs)` holding `make_sample(0..n)`, each
    submitted with `timeout=0` (there must be room for them)."""

    def make(n: int, **kwargs: Any) -> echo.Server:
        server = make_server(**kwargs)
        for i in range(n):
            server.submit(make_sample(i), timeout=0)
        return server

    return make


def take(server: echo.Server, **kwargs: Any) -> Any:
    """`server.sample(timeout=WAIT_S, **kwargs)`, asserted to be a batch (not `None`)."""
    sample = server.sample(timeout=WAIT_S, **kwargs)
    assert sample is not None, "sample() returned None: the server is closed"
    return sample


@pytest.fixture
def spawn(_registry: _Registry) -> Callable[..., Worker]:
    """`spawn(fn, *args, **kwargs)`: starts a `Worker`; joined (after closing servers) at
    teardown."""

    def start(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Worker:
        worker = Worker(fn, *args, **kwargs)
        _registry.workers.append(worker)
        worker.start()
        return worker

    return start


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_python(code, timeout=30)`: runs `code` in a fresh interpreter, returns the result."""

    def run(code: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_env(),
            check=False,
        )

    return run
