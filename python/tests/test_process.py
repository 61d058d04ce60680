"""Lifetime, interpreter exit and Ctrl-C, each in a fresh interpreter so a crash or a hang
fails one test instead of taking the whole run down."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
from conftest import assert_ctrl_c_interrupts_promptly, child_env

PRELUDE = textwrap.dedent(
    """
    import gc, sys, threading
    import numpy as np
    import echo
    from _blocked import announce_when, blocked, wait_for

    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}

    def make_sample(i):
        return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}
    """
)

CRASH_MARKERS = ("panicked", "PanicException", "Traceback", "Fatal Python error", "Segmentation")


def _assert_clean(proc: subprocess.CompletedProcess[str]) -> None:
    for marker in CRASH_MARKERS:
        assert marker not in proc.stderr, f"{marker!r} in stderr:\n{proc.stderr}"
    assert proc.returncode == 0, f"exit code {proc.returncode}, stderr:\n{proc.stderr}"


def _script(body: str) -> str:
    return PRELUDE + textwrap.dedent(body)


def _run_clean(
    run_python: Any, body: str, stdout: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs `_script(body)`, checks it exited cleanly (and printed `stdout`, if given)."""
    proc = run_python(_script(body))
    _assert_clean(proc)
    if stdout is not None:
        assert proc.stdout.strip() == stdout
    return proc


def test_view_read_after_server_is_deleted_gives_the_old_values(run_python: Any) -> None:
    _run_clean(
        run_python,
        """
            server = echo.Server(EXAMPLE, batch_size=4, num_buffers=2)
            for i in range(4):
                server.submit(make_sample(10 + i))
            batch = server.sample(timeout=10).batch
            del server
            gc.collect()
            # Allocate and free a lot, so freed ring memory would likely be reused.
            junk = [np.full((4, 3), -1.0, np.float32) for _ in range(10_000)]
            del junk
            gc.collect()
            assert batch["id"].tolist() == [10, 11, 12, 13], batch["id"]
            assert batch["obs"].tolist() == [[float(10 + i)] * 3 for i in range(4)], batch["obs"]
            assert batch["id"].base is not None
            print("ok")
        """,
        stdout="ok",
    )


def test_view_outlives_a_closed_and_deleted_server_after_other_views_die(
    run_python: Any,
) -> None:
    _run_clean(
        run_python,
        """
            server = echo.Server(EXAMPLE, batch_size=2)
            for i in range(4):
                server.submit(make_sample(i))
            first = server.sample(timeout=10).batch
            obs = first["obs"]
            del first
            server.close()
            del server
            gc.collect()
            assert obs.tolist() == [[0.0] * 3, [1.0] * 3], obs
            print("ok")
        """,
        stdout="ok",
    )


def test_deleting_an_unclosed_server_prints_nothing(run_python: Any) -> None:
    proc = _run_clean(
        run_python,
        """
            for n in range(20):
                server = echo.Server(EXAMPLE, batch_size=2)
                server.submit(make_sample(0))
                if n % 2:
                    server.submit(make_sample(1))
                    server.sample(timeout=10)
                del server
            gc.collect()
            # and one left for interpreter shutdown to collect
            last = echo.Server(EXAMPLE, batch_size=2)
            last.submit(make_sample(0))
        """,
    )
    assert proc.stderr == ""


def test_interpreter_exit_with_threads_blocked_in_sample_and_submit_is_clean(
    run_python: Any,
) -> None:
    proc = _run_clean(
        run_python,
        """
            waiting = echo.Server(EXAMPLE, batch_size=2)
            full = echo.Server(EXAMPLE, batch_size=1, num_buffers=2)
            full.submit(make_sample(0))
            full.submit(make_sample(1))
            sampler = threading.Thread(target=waiting.sample, daemon=True)
            submitter = threading.Thread(target=full.submit, args=(make_sample(2),), daemon=True)
            sampler.start()
            submitter.start()
            assert wait_for(blocked(waiting, "sample")) and wait_for(blocked(full, "submit"))
            assert sampler.is_alive() and submitter.is_alive()
            print("blocked", flush=True)
        """,
        stdout="blocked",
    )
    assert proc.stderr == ""


def test_interpreter_exit_with_a_blocked_dataset_iter_thread_is_clean(run_python: Any) -> None:
    proc = _run_clean(
        run_python,
        """
            server = echo.Server(EXAMPLE, batch_size=1)
            got = threading.Event()
            def consume():
                for _ in server.dataset_iter():
                    got.set()
            thread = threading.Thread(target=consume, daemon=True)
            thread.start()
            server.submit(make_sample(0))
            assert got.wait(10)
            assert wait_for(blocked(server, "sample"))
            assert thread.is_alive()
            print("blocked", flush=True)
        """,
        stdout="blocked",
    )
    assert proc.stderr == ""


def test_interpreter_exit_while_threads_poll_with_timeouts_is_clean() -> None:
    # Threads that poll sample()/submit() with short timeouts go in and out of the
    # GIL-released wait all the time, so some are always about to re-take the GIL when the
    # interpreter finalises. Several runs, because a bad exit here is a race.
    script = _script(
        """
        waiting = echo.Server(EXAMPLE, batch_size=2)
        full = echo.Server(EXAMPLE, batch_size=1, num_buffers=2)
        full.submit(make_sample(0))
        full.submit(make_sample(1))

        def poll_sample():
            while True:
                try:
                    waiting.sample(timeout=0.001)
                except TimeoutError:
                    pass

        def poll_submit():
            sample = make_sample(2)
            while True:
                try:
                    full.submit(sample, timeout=0.001)
                except TimeoutError:
                    pass

        threads = [threading.Thread(target=f, daemon=True) for f in (poll_sample, poll_submit)]
        threads += [threading.Thread(target=f, daemon=True) for f in (poll_sample, poll_submit)]
        for thread in threads:
            thread.start()
        threads[0].join(0.1)
        assert all(thread.is_alive() for thread in threads)
        print("polling", flush=True)
        """
    )
    failures = []
    for _round in range(3):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env(),
            )
            for _ in range(4)
        ]
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            if proc.returncode != 0 or stderr or stdout.strip() != "polling":
                failures.append((proc.returncode, stderr.strip()[-300:]))
    assert not failures, f"{len(failures)} of 12 runs exited badly: {failures}"


@pytest.mark.serial
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    "blocked_in", ["sample", "submit", "replay_sample", "replay_submit_rate_limited"]
)
def test_ctrl_c_interrupts_a_blocked_call_promptly(blocked_in: str) -> None:
    body = {
        "sample": """
            server = echo.Server(EXAMPLE, batch_size=2)
            announce_when(blocked(server, "sample"))
            server.sample()
            """,
        "submit": """
            server = echo.Server(EXAMPLE, batch_size=1, num_buffers=2)
            server.submit(make_sample(0))
            server.submit(make_sample(1))
            announce_when(blocked(server, "submit"))
            server.submit(make_sample(2))
            """,
        "replay_sample": """
            server = echo.Server(EXAMPLE, batch_size=2, sampler=echo.Uniform(), max_size=8)
            announce_when(blocked(server, "sample"))
            server.sample()
            """,
        "replay_submit_rate_limited": """
            server = echo.Server(
                EXAMPLE, batch_size=1, sampler=echo.Uniform(), max_size=8,
                rate_limiter=echo.Queue(1),
            )
            server.submit(make_sample(0))
            announce_when(blocked(server, "submit"))
            server.submit(make_sample(1))
            """,
    }[blocked_in]
    assert_ctrl_c_interrupts_promptly(_script(body))


def test_an_atexit_handler_registered_before_import_can_still_close_the_server(
    run_python: Any,
) -> None:
    # atexit runs handlers last-registered-first, so this close() runs after echo's own exit
    # hook: the thread running the hooks must still be able to release and re-take the GIL.
    code = textwrap.dedent(
        """
        import atexit
        holder = []
        atexit.register(lambda: [s.close() for s in holder])

        import threading
        import numpy as np
        import echo

        server = echo.Server(
            {"x": np.zeros(3, np.float32)},
            batch_size=2,
            transport=echo.TcpTransport(port=0, host="127.0.0.1"),
        )
        server.start()
        holder.append(server)
        threading.Thread(target=server.sample, daemon=True).start()
        print("ready", flush=True)
        """
    )
    proc = run_python(code, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ready"
    assert proc.stderr == ""
