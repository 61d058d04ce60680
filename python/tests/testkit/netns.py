"""Several hosts on one machine: Linux network namespaces joined by veth pairs.

`Hosts(n)` makes a learner host and `n` worker hosts, each a network namespace of its own with
one interface and address and no loopback, so traffic between them crosses real (virtual)
interfaces and same-host shared memory cannot be negotiated (an abstract Unix socket lives in
one namespace). Worker host `k` is joined to the learner host by its own veth pair on
10.X.k.0/24: the learner's side is `.1`, the worker's `.2`, so `partition(k)` (the link set
down) cuts exactly that host off, and `heal(k)` brings it back.

Needs root and `ip` (iproute2); `skip_reason()` says why not, for `pytest.skip`. Everything
created is named with this process's id and removed by `close()` (the namespaces and, with
them, their veths). Processes run in a namespace through `ip netns exec`, which execs the
command in place: the PID `Popen` returns is the process's own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

#: Beds made by this process: a bed's names carry its number, so two never share one.
_BEDS = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    probe = f"echo-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        _ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace: its name, and its address on its link to the learner host."""

    netns: str
    address: str

    def run(self, argv: list[str]) -> list[str]:
        """`argv` as it runs inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Hosts:
    """A learner host and `workers` worker hosts (see the module docs)."""

    def __init__(self, workers: int, subnet: int = 213) -> None:
        if not 1 <= workers <= 200:
            raise ValueError(f"workers must be in [1, 200], got {workers}")
        tag = f"{os.getpid() % 100000}{next(_BEDS)}"
        self._namespaces: list[str] = []
        self.learner_ns = f"echo-{tag}-learner"
        self.workers: list[Host] = []
        #: The learner's address on worker host k's link.
        self.learner_addresses: list[str] = []
        self._links: list[str] = []  # worker host k's side of its veth
        try:
            self._add(self.learner_ns)
            for k in range(workers):
                ns = f"echo-{tag}-w{k}"
                self._add(ns)
                near, far = f"el{tag}x{k}", f"ew{tag}x{k}"
                _ip("link", "add", near, "type", "veth", "peer", "name", far)
                _ip("link", "set", near, "netns", self.learner_ns)
                _ip("link", "set", far, "netns", ns)
                learner_addr, worker_addr = f"10.{subnet}.{k}.1", f"10.{subnet}.{k}.2"
                _ip("-n", self.learner_ns, "addr", "add", f"{learner_addr}/24", "dev", near)
                _ip("-n", ns, "addr", "add", f"{worker_addr}/24", "dev", far)
                _ip("-n", self.learner_ns, "link", "set", near, "up")
                _ip("-n", ns, "link", "set", far, "up")
                self.workers.append(Host(ns, worker_addr))
                self.learner_addresses.append(learner_addr)
                self._links.append(far)
            # The learner host's own loopback, for a fault proxy in front of its learner only:
            # the workers still reach it over their links.
            _ip("-n", self.learner_ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        self.learner = Host(self.learner_ns, "0.0.0.0")

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)

    def partition(self, k: int) -> None:
        """Cuts worker host `k` off: its link goes down (packets dropped, no reset)."""
        _ip("-n", self.workers[k].netns, "link", "set", self._links[k], "down")

    def heal(self, k: int) -> None:
        """Brings worker host `k`'s link back up."""
        _ip("-n", self.workers[k].netns, "link", "set", self._links[k], "up")

    def close(self) -> None:
        """Removes every namespace made (their veths go with them). Idempotent."""
        for ns in reversed(self._namespaces):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _ip("netns", "del", ns)
        self._namespaces.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
