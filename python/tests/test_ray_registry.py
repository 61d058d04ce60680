"""The `echo.ray` registry's bookkeeping, in this process (no Ray needed: the registry actor
is a plain class that Ray runs): the shard rule against a full scan, the cost of an
assignment with many workers, and leases on a clock the test moves."""

from __future__ import annotations

import random
import time
from typing import Any

from echo.ray import DEFAULT_LEASE_S, _Registry  # pyright: ignore[reportPrivateUsage]

SERVICE = "svc"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(shard: int, port: int = 1, service: str = SERVICE) -> dict[str, Any]:
    return {"service": service, "shard": shard, "host": "127.0.0.1", "port": port}


def registry(shards: int, *, lease_s: float = DEFAULT_LEASE_S, clock: Clock | None = None) -> Any:
    made = _Registry(SERVICE, lease_s, clock or Clock())
    for k in range(shards):
        assert made.register(k, record(k)) == 1
    return made


def workers_per_shard(made: Any) -> dict[int, int]:
    return {s["shard"]: s["workers"] for s in made.shards()}


def test_assign_picks_what_a_full_scan_of_the_workers_would() -> None:
    """Random registrations, deregistrations, assignments (free, pinned, excluding a shard),
    releases, renewals and expiries, seeded; after each, the registry's choice and counts
    equal those of a model that counts every worker's lease from scratch."""
    rng = random.Random(20240611)
    clock = Clock()
    made = _Registry(SERVICE, 10.0, clock)
    registered: set[int] = set()
    leases: dict[str, tuple[int, float]] = {}  # the model: client -> (shard, expiry)

    def model_loads() -> dict[int, int]:
        for client in [c for c, (_, t) in leases.items() if t <= clock.now]:
            del leases[client]
        loads: dict[int, int] = {}
        for shard, _ in leases.values():
            loads[shard] = loads.get(shard, 0) + 1
        return loads

    for step in range(4000):
        op = rng.random()
        client = f"c{rng.randrange(60)}"
        if op < 0.08:
            shard = rng.randrange(12)
            made.register(shard, record(shard))
            registered.add(shard)
        elif op < 0.12 and registered:
            shard = rng.choice(sorted(registered))
            generation = made.lookup(shard)["generation"]
            assert made.deregister(shard, generation) is True
            registered.discard(shard)
        elif op < 0.6:
            loads = model_loads()
            pinned = rng.randrange(12) if rng.random() < 0.1 else None
            exclude = rng.randrange(12) if rng.random() < 0.2 else None
            leases.pop(client, None)
            loads = model_loads()
            if pinned is not None:
                want = pinned if pinned in registered else None
            else:
                choices = [s for s in registered if s != exclude]
                want = min(choices, key=lambda s: (loads.get(s, 0), s)) if choices else None
            got = made.assign(client, pinned, exclude)
            assert (None if got is None else got["shard"]) == want, f"step {step}"
            if want is not None:
                leases[client] = (want, clock.now + 10.0)
        elif op < 0.7:
            made.release(client)
            leases.pop(client, None)
        elif op < 0.85 and client in leases:
            shard = leases[client][0]
            model_loads()
            alive = client in leases or shard in registered
            assert made.renew(client, shard) is alive
            if alive:
                leases[client] = (shard, clock.now + 10.0)
        else:
            clock.now += rng.choice([0.5, 1.0, 3.0])
        loads = model_loads()
        assert workers_per_shard(made) == {s: loads.get(s, 0) for s in sorted(registered)}
        assert made._loads == {s: n for s, n in loads.items() if n}  # pyright: ignore[reportPrivateUsage]


def test_workers_that_attach_one_after_another_are_spread_to_within_one() -> None:
    made = registry(7)
    for i in range(100):
        made.assign(f"w{i}", None, None)
        counts = workers_per_shard(made).values()
        assert max(counts) - min(counts) <= 1


def test_an_assignment_costs_the_same_with_twenty_thousand_workers() -> None:
    """20,000 workers over 64 shards: about 0.1 s here. An assignment that counted every
    worker's shard (as the registry once did) took about 28 s for the same."""
    made = registry(64)
    started = time.perf_counter()
    for i in range(20_000):
        made.assign(f"w{i}", None, None)
        if i % 1000 == 0:
            assert time.perf_counter() - started < 5.0, f"{i} assignments took over 5 s"
    assert time.perf_counter() - started < 5.0
    assert set(workers_per_shard(made).values()) == {312, 313}


def test_a_lease_not_renewed_frees_its_place_and_a_renewed_one_stays() -> None:
    clock = Clock()
    made = registry(2, lease_s=3.0, clock=clock)
    assert made.assign("killed", None, None)["shard"] == 0
    assert made.assign("alive", None, None)["shard"] == 1
    for _ in range(4):  # 4 s: past the killed worker's lease, the other one renewing
        clock.now += 1.0
        assert made.renew("alive", 1)
    assert workers_per_shard(made) == {0: 0, 1: 1}
    # The killed worker's place went back: the next worker gets shard 0.
    assert made.assign("next", None, None)["shard"] == 0
    # A worker whose lease ran out (paused, cut off) gets it back on its shard by renewing.
    clock.now += 10.0
    assert workers_per_shard(made) == {0: 0, 1: 0}
    assert made.renew("alive", 1)
    assert workers_per_shard(made) == {0: 0, 1: 1}
    # Not on a shard that is gone.
    assert made.deregister(1, 1) is True
    clock.now += 10.0
    assert made.renew("alive", 1) is False
