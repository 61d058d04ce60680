"""A fleet of rollout workers for test_shm.py: one interpreter imports echo once, then forks
one child per worker (fast to start, even 64 of them).

    python _shm_worker.py PORT FIRST NUM COUNT SHM [STOP_AT_WORKER STOP_AT_SAMPLE]

Worker `w` (FIRST <= w < FIRST + NUM) connects with `shared_memory=SHM` ("auto", "true" or
"false"), sends samples `w * ID_STRIDE + i` for i in range(COUNT) (COUNT 0: until the
connection fails), closes, and reports one line each, written atomically:

    pid W PID                  (from the parent, once forked)
    path W PATH                (connected; PATH is "shm" or "tcp")
    closed W OK OPEN_FDS LEFT_FDS
                               (OK: close() flushed; OPEN_FDS: shared-memory descriptors,
                               memfd segments and eventfds, while connected; LEFT_FDS: after
                               close())
    error W NAME MESSAGE       (send or connect raised NAME)

With STOP_AT_WORKER/STOP_AT_SAMPLE that worker stops itself (SIGSTOP) half-way through
writing that sample into shared memory, before committing it (echo's test-only hook).
"""

from __future__ import annotations

import os
import sys

import numpy as np

ID_STRIDE = 1_000_000
EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def shm_fds() -> int:
    """Descriptors of this process that are memfd segments or eventfds."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:echo-shm") or target == "anon_inode:[eventfd]":
            count += 1
    return count


def run(port: int, w: int, count: int, shm: bool | None) -> int:
    import echo

    try:
        client = echo.TcpClient("127.0.0.1", port, EXAMPLE, shared_memory=shm)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(f"error {w} {type(exc).__name__} {exc}")
        return 0
    say(f"path {w} {client.transport_path}")
    opened = shm_fds()
    i = 0
    try:
        for i in range(count if count > 0 else 10**9):
            v = w * ID_STRIDE + i
            client.send({"id": np.array(v, np.int64), "obs": np.full((3,), v, np.float32)})
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(f"error {w} {type(exc).__name__} after {i} {exc}")
        client.close(timeout=5.0)
        return 0
    ok = client.close(timeout=30.0)
    say(f"closed {w} {ok} {opened} {shm_fds()}")
    return 0


def main() -> None:
    port, first, num, count = (int(a) for a in sys.argv[1:5])
    shm = {"auto": None, "true": True, "false": False}[sys.argv[5]]
    stop = (int(sys.argv[6]), sys.argv[7]) if len(sys.argv) > 7 else None
    import echo  # noqa: F401 - imported once, before forking

    children = []
    for w in range(first, first + num):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if stop is not None and stop[0] == w:
                    # "N:PID": the library honours it only in the process it names.
                    os.environ["ECHO_SHM_TEST_STOP_AT"] = f"{stop[1]}:{os.getpid()}"
                code = run(port, w, count, shm)
            finally:
                os._exit(code)
        say(f"pid {w} {pid}")
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
