"""A rollout-worker process for `test_tcp.py`: the README's worker, with checkable samples.

Usage: `python _worker.py PORT WORKER_ID NUM_SAMPLES MODE`

Sends `NUM_SAMPLES` samples shaped like conftest's `example` to `127.0.0.1:PORT`; sample
`seq` of worker `w` has id `w * ID_STRIDE + seq` in its `id` leaf and in every element of
`obs` (so conftest's `batch_ids` reads and checks it). Then, by `MODE`:

- `stay`: `wait()` for every ack, print `acked`, stay connected until stdin closes, then exit
  without `close()`.
- `close`: `close()` right away (it must flush), print `closed <flushed>`.
- `wait_close`: `wait()`, then `close()`, print `closed <flushed>`.
"""

from __future__ import annotations

import signal
import sys

import numpy as np

from echo import TcpClient

# Ids of worker `w` are `w * ID_STRIDE + seq`: exact in float32 for w < 1000.
ID_STRIDE = 10_000
# A worker never outlives a broken test by more than this.
SELF_DESTRUCT_S = 60
WAIT_S = 30.0


def make_sample(i: int) -> dict[str, np.ndarray]:
    return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}


def main(argv: list[str]) -> int:
    port, worker, num_samples, mode = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    if mode not in ("stay", "close", "wait_close"):
        raise SystemExit(f"unknown mode {mode!r}")
    if hasattr(signal, "alarm"):
        signal.alarm(SELF_DESTRUCT_S)
    example = make_sample(0)
    client = TcpClient("127.0.0.1", port, example)
    for seq in range(num_samples):
        client.send(make_sample(worker * ID_STRIDE + seq))
    if mode == "stay":
        client.wait(timeout=WAIT_S)
        print("acked", flush=True)
        sys.stdin.read()  # stay connected until the test closes our stdin
        return 0
    if mode == "wait_close":
        client.wait(timeout=WAIT_S)
    flushed = client.close(timeout=WAIT_S)
    print(f"closed {flushed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
