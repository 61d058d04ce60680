"""The scenarios of the TCP benchmark (:mod:`benches.suites.core_tcp`) and what its learner,
workers and driver share: the sample shapes (small, large, nested over TCP and over shared
memory), a worker's arguments, the limits and constants of a round, and small helpers. Only
API that both our ``echo`` and the published ``id-echo`` 0.2.1 have.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

import echo
from benches import common as h
from echo import TcpClient

ID_MOD = 2**24  # element 0 of each f32 leaf holds seq % ID_MOD (exact in float32)
MARKER_WID = -1.0  # worker id of the padding samples the learner submits itself
MAX_WORKERS = 1000
LAUNCHERS = ("process", "ray")
MAX_INFLIGHT = 32  # TcpClient's default window, set explicitly
BLOCK_BATCHES = 4096  # received rows are recorded in blocks of this many batches
MAX_ROWS = 64_000_000  # recording stops beyond this (never reached at loopback speeds)
LOOPBACK_CHUNK = 64 * 1024  # the reference
LOOPBACK_BULK_CHUNK = 1024 * 1024  # a second reference with fewer, larger syscalls
STALL_S = 3.0  # once every worker reported: this long without a batch is a stall
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Scenario:
    name: str
    batch_size: int
    leaves: tuple[tuple[str, tuple[int, ...]], ...]  # float32 leaves besides "meta"
    # "tcp": our clients pass shared_memory=False (where the installed echo has it);
    # "shm": shared_memory=True (the row is skipped for an echo without it).
    path: str = "tcp"
    # Leaves keyed "group/name" go into nested dicts {"group": {"name": ...}}.
    nested: bool = False

    def example(self) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for k, s in self.leaves:
            if self.nested:
                group, name = k.split("/")
                tree.setdefault(group, {})[name] = np.zeros(s, np.float32)
            else:
                tree[k] = np.zeros(s, np.float32)
        tree["meta"] = np.zeros(3, np.float64)
        return tree

    def leaf(self, tree: Any, key: str) -> np.ndarray:
        """The leaf `key` of a sample or a batch of this scenario."""
        if self.nested:
            group, name = key.split("/")
            return tree[group][name]
        return tree[key]

    @property
    def sample_bytes(self) -> int:
        return sum(int(np.prod(s)) * 4 for _, s in self.leaves) + 3 * 8


# The large nested sample: 40 float32 leaves in 4 nested dicts of 10, 195,864 B with "meta".
_NESTED = tuple((f"g{i // 10}/x{i:02d}", (1224,)) for i in range(40))
SCENARIOS = (
    Scenario("small", 32, (("obs", (4,)), ("reward", (1,)))),
    Scenario("large", 64, tuple((f"x{i:02d}", (1280,)) for i in range(40))),
    Scenario("nest-tcp", 64, _NESTED, path="tcp", nested=True),
    Scenario("nest-shm", 64, _NESTED, path="shm", nested=True),
)
SCENARIO_BY_NAME = {sc.name: sc for sc in SCENARIOS}


@dataclass(frozen=True)
class WorkerArgs:
    wid: int
    port: int
    scenario: str
    max_count: int
    warmup_s: float
    seconds: float
    go_timeout_s: float
    flush_timeout_s: float
    echo_file: str


# --------------------------------------------------------------------------- helpers


log = h.logger("bench_tcp")


def worker_watchdog(max_seconds: float, who: str) -> None:
    h.start_watchdog(max_seconds, f"bench_tcp: {who}")


def has_shared_memory() -> bool:
    """Whether the installed echo's TcpClient takes `shared_memory=` (0.2.1's does not)."""
    return "shared_memory" in inspect.signature(TcpClient).parameters


def learner_echo_file() -> str:
    return os.path.realpath(echo.__file__ or "")


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
