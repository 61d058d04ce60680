"""Issue #12: the per-sample cost of wire v2 against v1 in instructions, which another
process's load does not move (samples/s on a shared 2-core machine swing by 30 %).

One process runs a learner (``Server`` with ``TcpTransport`` on 127.0.0.1), a thread reading
every batch, and a ``TcpClient`` sending N small samples (a nested dict of 18 leaves, 280
bytes) with ``protocol=1`` or ``protocol=2``, under ``valgrind --tool=callgrind``. The
per-sample cost is the slope between two sample counts, so interpreter start-up and
connecting cancel out: ``(Ir(N2) - Ir(N1)) / (N2 - N1)``, client and server together.

Run: ``python benches/tools/issue12_instructions.py [--n1 4000] [--n2 12000]`` (about 4 minutes;
needs valgrind). ``--child PROTOCOL N`` is the measured program itself.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def child(protocol: int, n: int) -> None:
    import numpy as np

    import echo

    example = {
        "obs": {f"o{i:02d}": np.zeros(4, np.float32) for i in range(16)},
        "a": np.zeros((), np.int64),
        "r": np.zeros((), np.float32),
    }
    server = echo.Server(
        example, batch_size=32, num_buffers=64, transport=echo.TcpTransport(0, host="127.0.0.1")
    )
    server.start()
    assert server.port is not None
    got = [0]

    def learn() -> None:
        while got[0] < n:
            if server.sample(timeout=120) is None:
                return
            got[0] += 32

    learner = threading.Thread(target=learn)
    learner.start()
    sample = {
        "obs": {f"o{i:02d}": np.full(4, i, np.float32) for i in range(16)},
        "a": np.array(1, np.int64),
        "r": np.float32(1),
    }
    with echo.TcpClient("127.0.0.1", server.port, example, 32, protocol=protocol) as client:  # type: ignore[arg-type]
        for _ in range(n):
            client.send(sample)
    learner.join(120)
    server.close()
    assert got[0] >= n, got


def instructions(protocol: int, n: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                str(protocol),
                str(n),
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            check=True,
        )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    assert found, proc.stderr[-2000:]
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n1", type=int, default=4000)
    parser.add_argument("--n2", type=int, default=12000)
    parser.add_argument("--child", nargs=2, type=int, metavar=("PROTOCOL", "N"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    per_sample = {}
    for protocol in (1, 2):
        low, high = instructions(protocol, args.n1), instructions(protocol, args.n2)
        per_sample[protocol] = (high - low) / (args.n2 - args.n1)
        print(
            f"v{protocol}: {low:,} / {high:,} instructions, {per_sample[protocol]:,.0f} per sample"
        )
    print(f"v2/v1 instructions per sample: {per_sample[2] / per_sample[1]:.4f}")


if __name__ == "__main__":
    main()
