"""The parameter channel under load: 64 workers (each its own `TcpClient`, a thread of this
process) fetch a 10 MB pytree back to back while the learner publishes a new version at each
tick of a 10 Hz clock for 3 s; once over TCP (1 MiB chunks through the socket), once on
shared-memory connections (copies out of the learner's shared-memory slots under their
sequence locks). Every fetched copy is bit for bit its version (a sha256 per version,
recorded by the publisher before it publishes), no worker's versions go back, every worker
fetched while the learner published, and every worker ends on the last version.

The full 10 MB, 64 workers and 10 Hz, not a smaller stand-in: on 2 cores a run moves 5 to
15 GB in about 10 s. Version v is the same random leaves plus v, so two versions differ in
every element and a copy mixing them cannot hash like either. The versions and their hashes
are made before the workers start, so that the publisher does not wait on its own work. With
64 threads fetching and hashing (they hold the GIL in turn), one `publish()` can take most of
a second on 2 cores: a tick missed meanwhile is skipped, not made up in a burst, so fewer
than 30 versions may be published (about 10 here); the publisher goes on past the 3 s until
it has published 3. Every loop is bounded in count and time.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from echo import Server, TcpClient, TcpTransport

LOCALHOST = "127.0.0.1"
EXAMPLE = {"id": np.zeros((), np.int64)}
WORKERS = 64
PUBLISH_HZ = 10.0
TICKS = 30  # publishes at most: 3 s at 10 Hz
MIN_PUBLISHES = 3  # past the 3 s if need be (a slow machine)
VERSIONS = TICKS + 1  # at most, version 1 published before the workers start
FETCH_S = 60.0  # the longest one fetch may take (64 workers share two cores)
DEADLINE_S = 45.0  # the workers' whole run, publishing included


def layout() -> dict[str, Any]:
    """10 MB (9,999,872 bytes) in 8 float32 leaves of different sizes, zeros."""
    rows = (6250, 4688, 3125, 2344, 1562, 781, 586, 195)
    names = (("torso", "w0"), ("torso", "w1"), ("lstm", "w_ih"), ("lstm", "w_hh"))
    names += (("policy", "w"), ("policy", "b"), ("value", "w"), ("value", "b"))
    tree: dict[str, Any] = {}
    for (group, name), n in zip(names, rows, strict=True):
        tree.setdefault(group, {})[name] = np.zeros((n, 128), np.float32)
    return tree


def flat_leaves(tree: dict[str, Any]) -> list[np.ndarray]:
    return [leaf for group in sorted(tree) for _, leaf in sorted(tree[group].items())]


def version_of(tree: dict[str, Any], base: list[np.ndarray], version: int) -> None:
    """Writes version `version` into `tree`: each leaf of `base` plus `version`."""
    for leaf, b in zip(flat_leaves(tree), base, strict=True):
        np.add(b, np.float32(version), out=leaf)


def digest(tree: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for leaf in flat_leaves(tree):
        h.update(np.ascontiguousarray(leaf).data)
    return h.hexdigest()


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_64_workers_fetching_10_mb_while_the_learner_publishes_at_10_hz(path: str) -> None:
    params = layout()
    rng = np.random.default_rng(7)
    base = [rng.standard_normal(leaf.shape, dtype=np.float32) for leaf in flat_leaves(params)]
    assert sum(leaf.nbytes for leaf in flat_leaves(params)) == 9_999_872
    expected: dict[int, str] = {}
    for version in range(1, VERSIONS + 1):
        version_of(params, base, version)
        expected[version] = digest(params)
    assert len(set(expected.values())) == VERSIONS
    with Server(EXAMPLE, 4, transport=TcpTransport(port=0, host=LOCALHOST)) as learner:
        version_of(params, base, 1)
        assert learner.publish(params) == 1
        clients = [
            TcpClient(
                LOCALHOST,
                learner.port,
                EXAMPLE,
                params_example=layout(),
                shared_memory=path == "shm",
            )
            for _ in range(WORKERS)
        ]
        assert {client.transport_path for client in clients} == {path}
        seen: list[list[int]] = [[] for _ in clients]
        during: list[int] = [0] * WORKERS  # fetches a worker began before the last publish
        errors: list[str] = []
        published_all = threading.Event()
        final = [0]  # the last version, set before `published_all`
        deadline = time.monotonic() + DEADLINE_S

        def fetch(k: int) -> None:
            try:
                for _ in range(10_000):
                    if time.monotonic() > deadline:
                        errors.append(f"worker {k}: past the deadline at {seen[k][-1:]}")
                        return
                    began_during = not published_all.is_set()
                    version, tree = clients[k].params(timeout=FETCH_S)
                    if digest(tree) != expected.get(version):
                        errors.append(f"worker {k}: version {version} is not bit for bit")
                    seen[k].append(version)
                    during[k] += began_during
                    if published_all.is_set() and version == final[0]:
                        return
                errors.append(f"worker {k}: 10,000 fetches without the last version")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"worker {k}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=fetch, args=(k,)) for k in range(WORKERS)]
        for t in threads:
            t.start()
        # A new version at each tick of a 10 Hz clock for 3 s (and until MIN_PUBLISHES); a
        # tick missed while a slow publish ran is skipped, not made up in a burst.
        started = time.monotonic()
        publish_s: list[float] = []
        version = 1
        for _ in range(TICKS):
            tick = math.floor((time.monotonic() - started) * PUBLISH_HZ) + 1
            if tick > TICKS and version > MIN_PUBLISHES:
                break
            time.sleep(max(0.0, started + tick / PUBLISH_HZ - time.monotonic()))
            version += 1
            version_of(params, base, version)
            t0 = time.monotonic()
            assert learner.publish(params) == version
            publish_s.append(time.monotonic() - t0)
        final[0] = version
        published_all.set()
        publishing_s = time.monotonic() - started
        for t in threads:
            t.join(timeout=max(1.0, deadline + FETCH_S - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a worker is still fetching"
        assert not errors, errors[:5]
        assert learner.params_version == version > MIN_PUBLISHES
        fetches = sum(len(versions) for versions in seen)
        print(
            f"{path}: {fetches} fetches of 10 MB, {version} versions in {publishing_s:.1f} s, "
            f"publish() median {1e3 * float(np.median(publish_s)):.1f} ms, "
            f"max {1e3 * max(publish_s):.1f} ms; fetches per worker while publishing: "
            f"min {min(during)}, median {float(np.median(during)):.0f}"
        )
        for k, versions in enumerate(seen):
            assert versions, f"worker {k} fetched nothing"
            assert versions == sorted(versions), f"worker {k} went back: {versions}"
            assert versions[-1] == version, f"worker {k} ended on {versions[-1]}"
            assert during[k] >= 1, f"worker {k} fetched nothing while the learner published"
        for client in clients:
            assert client.close(timeout=10.0)
