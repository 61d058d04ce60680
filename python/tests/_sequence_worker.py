"""Rollout workers for test_sequence_tcp.py: one interpreter imports echo once, then forks one
child per worker (fast to start, even 64 of them).

    python _sequence_worker.py PORT FIRST NUM MODE SHM EPISODES ROWS

Every step carries its id `stream * 10**6 + episode * 10**3 + index` (in `id` and in every
element of `obs`), where `stream` is `w` for a worker sending one stream, `w * ROWS + r` for
row `r` of a worker's vector env. Episode `e` of stream `k` has `episode_length(k, e)` steps.

- `send`: worker `w` sends EPISODES episodes with `send`, ending each with `end_episode=True`
  (odd episodes with `truncated=True` instead), then closes.
- `batch`: worker `w` steps a vector env of ROWS rows with `send_batch` for EPISODES * 20
  steps; row `r` ends an episode when it reaches its length (per-row masks), and its last
  episode is left open (the server ends it, truncated, when the worker closes).
- `hold`: worker `w` sends EPISODES steps of one episode that never ends, reports `ready`
  and waits to be killed.

Each worker reports one line when it is done (`done W SENT`), `ready W` (hold), `pid W PID`
(from the parent) or `error W NAME MESSAGE`.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}


def episode_length(stream: int, episode: int) -> int:
    return 1 + (stream * 7 + episode * 13) % 23


def step_id(stream: int, episode: int, index: int) -> int:
    return stream * 10**6 + episode * 10**3 + index


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def run(port: int, w: int, mode: str, shm: bool, episodes: int, rows: int) -> None:
    import echo

    client = echo.TcpClient("127.0.0.1", port, EXAMPLE, shared_memory=shm)
    sent = 0
    if mode == "send":
        for e in range(episodes):
            n = episode_length(w, e)
            for i in range(n):
                v = step_id(w, e, i)
                last = i + 1 == n
                client.send(
                    {"id": np.array(v, np.int64), "obs": np.full((3,), v, np.float32)},
                    end_episode=last and e % 2 == 0,
                    truncated=last and e % 2 == 1,
                )
                sent += 1
    elif mode == "batch":
        streams = [w * rows + r for r in range(rows)]
        episode, index = [0] * rows, [0] * rows
        for _ in range(episodes * 20):
            ids = np.array([step_id(k, episode[r], index[r]) for r, k in enumerate(streams)])
            ends = np.array(
                [index[r] + 1 == episode_length(k, episode[r]) for r, k in enumerate(streams)]
            )
            batch = {"id": ids, "obs": np.repeat(ids[:, None], 3, 1).astype(np.float32)}
            sent += client.send_batch(batch, end_episode=ends)
            for r in range(rows):
                index[r] += 1
                if ends[r]:
                    episode[r], index[r] = episode[r] + 1, 0
    else:
        for i in range(episodes):
            v = step_id(w, 0, i)
            client.send({"id": np.array(v, np.int64), "obs": np.full((3,), v, np.float32)})
        client.wait(timeout=30.0)
        say(f"ready {w}")
        time.sleep(120)  # killed by the test long before
    client.close(timeout=30.0)
    say(f"done {w} {sent}")


def main() -> None:
    port, first, num = (int(a) for a in sys.argv[1:4])
    mode, shm = sys.argv[4], sys.argv[5] == "true"
    episodes, rows = int(sys.argv[6]), int(sys.argv[7])
    import echo  # noqa: F401 - imported once, before forking

    children = []
    for w in range(first, first + num):
        pid = os.fork()
        if pid == 0:
            try:
                run(port, w, mode, shm, episodes, rows)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                say(f"error {w} {type(exc).__name__} {exc}")
            os._exit(0)
        say(f"pid {w} {pid}")
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
