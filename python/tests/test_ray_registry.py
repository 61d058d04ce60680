"""The `echo.ray` registry's bookkeeping, in this process (no Ray needed: the registry actor
is a plain class that Ray runs): the shard rule against a full scan, the cost of an
assignment with many workers, leases on a clock the test moves, and the token's proof."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from echo.ray import DEFAULT_LEASE_S, _Registry, _ServiceKey, _sign  # pyright: ignore[reportPrivateUsage]

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
    made = _Registry(SERVICE, None, lease_s, clock or Clock())
    for k in range(shards):
        assert made.register(record(k), None, None) == 1
    return made


def workers_per_shard(made: Any) -> dict[int, int]:
    return {s["shard"]: s["workers"] for s in made.shards()}


def test_assign_picks_what_a_full_scan_of_the_workers_would() -> None:
    """Random registrations, deregistrations, assignments (free, pinned, excluding a shard),
    releases, renewals and expiries, seeded; after each, the registry's choice and counts
    equal those of a model that counts every worker's lease from scratch."""
    rng = random.Random(20240611)
    clock = Clock()
    made = _Registry(SERVICE, None, 10.0, clock)
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
            made.register(record(shard), None, None)
            registered.add(shard)
        elif op < 0.12 and registered:
            shard = rng.choice(sorted(registered))
            generation = made.lookup(shard)["generation"]
            assert made.deregister(shard, generation, None) is True
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
    assert made.deregister(1, 1, None) is True
    clock.now += 10.0
    assert made.renew("alive", 1) is False


def test_a_registry_bound_to_a_token_refuses_what_does_not_prove_it() -> None:
    key = _ServiceKey.of("the token", SERVICE)
    other = _ServiceKey.of("another token", SERVICE)
    made = _Registry(SERVICE, key.verifier, DEFAULT_LEASE_S, Clock())
    legit = {**record(0, port=5000), "nonce": "n", "issued_unix_ns": 1}
    assert made.register(legit, _sign(key, legit), key.proof) == 1
    rogue = record(0, port=6666)
    refusals = [
        made.register(rogue, None, None),
        made.register(rogue, _sign(other, rogue), other.proof),
        made.register(rogue, "00" * 32, key.verifier.encode()),  # the verifier is no proof
        made.register(rogue, None, "not bytes"),
        made.deregister(0, 1, None),
        made.deregister(0, 1, other.proof),
        made.report(0, 1, {"store_size": 10**9}, None),
    ]
    assert all(isinstance(r, str) for r in refusals), refusals
    assert "requires a proof of its token (its verifier begins " + key.verifier[:12] in refusals[0]
    assert f"the registry's verifier begins {key.verifier[:12]}" in refusals[1]
    assert f"the proof's {other.verifier[:12]}" in refusals[1]
    assert "a proof is bytes, got str" in refusals[3]
    # The learner's registration is still the one handed out, unchanged.
    (only,) = made.shards()
    assert (only["port"], only["generation"], only["stats"]) == (5000, 1, None)
    assert made.assign("w", None, None)["port"] == 5000
    # With the proof, the learner deregisters; a registration without a signature is refused.
    assert made.register(rogue, None, key.proof) == (
        "the registration carries no signature, and this service requires one"
    )
    assert made.deregister(0, 1, key.proof) is True


def test_an_open_registry_refuses_a_learner_with_a_token() -> None:
    key = _ServiceKey.of("the token", SERVICE)
    made = _Registry(SERVICE, None, DEFAULT_LEASE_S, Clock())
    refused = made.register(record(0), "tag", key.proof)
    assert isinstance(refused, str)
    assert "created without a token" in refused


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({**record(0), "shard": -1}, "an int >= 0, got -1"),
        ({**record(0), "shard": True}, "an int >= 0, got True"),
        (record(0, service="other"), "for service 'other', this registry's is 'svc'"),
    ],
)
def test_a_malformed_registration_is_refused_saying_why(bad: dict[str, Any], why: str) -> None:
    refused = _Registry(SERVICE).register(bad, None, None)
    assert isinstance(refused, str)
    assert why in refused


def test_the_key_never_shows_its_secrets() -> None:
    key = _ServiceKey.of("the token", SERVICE)
    assert "the token" not in repr(key)
    assert key.proof.hex() not in repr(key)
    assert key.signing.hex() not in repr(key)
    assert key.verifier in repr(key)
