"""The registry of an `echo.ray` service, and how it is bound to a token: the named Ray
actor learners register their shards with and workers are assigned shards by (leases in a
heap of shard loads), the keys derived from the token (a proof the registry checks against
its verifier, a signing key it never sees), and the runtime_env it is created with (the
token blanked out). `echo.ray` is the public side."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("echo")

DEFAULT_LEASE_S = 30.0
"""How long a worker's place on a shard lasts without a renewal, in seconds, unless the
service was created with another `lease_s`. Clients renew every third of it; a worker that
dies without closing frees its place within this time."""

# Where learners and workers read the token from when none is given (as `TcpTransport` and
# `TcpClient` do).
TOKEN_VAR = "ECHO_TOKEN"


def _derive(token: str, purpose: bytes, service: str) -> bytes:
    """A key for one `purpose` within one service, derived from the token (HMAC-SHA256)."""
    message = b"echo-ray-" + purpose + b"\0" + service.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def _verifier_of(proof: bytes) -> str:
    """What a registry holds to check a proof: its SHA-256, in hex (one-way, so a verifier
    gives neither the proof nor the token)."""
    return hashlib.sha256(b"echo-ray-verifier\0" + proof).hexdigest()


@dataclasses.dataclass(frozen=True)
class ServiceKey:
    """What a token gives for one service. Learners and workers derive it; the registry gets
    only `verifier`, and `proof` when a learner registers, reports or deregisters."""

    proof: bytes = dataclasses.field(repr=False)
    """Shown to the registry: it checks `_verifier_of(proof) == verifier`."""
    verifier: str
    signing: bytes = dataclasses.field(repr=False)
    """Signs each registration (`sign`); workers check the signature with their own."""

    @classmethod
    def of(cls, token: str, service: str) -> ServiceKey:
        proof = _derive(token, b"registrar", service)
        return cls(proof, _verifier_of(proof), _derive(token, b"record", service))


# The fields of a registration its learner signs: where the shard is and what it stores,
# with a fresh nonce and the time it was made. The registry's own fields (generation,
# counters, workers) are not signed.
_SIGNED_FIELDS = (
    "service",
    "shard",
    "host",
    "port",
    "layout",
    "batch_size",
    "capacity",
    "node_id",
    "pid",
    "metrics_url",
    "nonce",
    "issued_unix_ns",
)


def sign(key: ServiceKey, record: dict[str, Any]) -> str:
    """HMAC-SHA256 of a registration's signed fields (canonical JSON), in hex."""
    fields = {name: record.get(name) for name in _SIGNED_FIELDS}
    message = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=repr)
    return hmac.new(key.signing, message.encode(), hashlib.sha256).hexdigest()


def token_from_env() -> str | None:
    """`$ECHO_TOKEN`, or `None` when it is unset or empty (no token)."""
    return os.environ.get(TOKEN_VAR) or None


class Registry:
    """The registry actor's state. Threaded (`max_concurrency`), so every method holds the
    lock and returns at once: registering is a dict update, assigning a worker O(log shards)
    amortised, and each lease expires once.

    With a `verifier` (a service bound to a token), `register`, `report` and `deregister`
    need a `proof` whose `_verifier_of` is the verifier; the registry never sees the token.
    Refusals are returned as a `str` saying why, for the caller to raise.
    """

    def __init__(
        self,
        service: str,
        verifier: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._verifier = verifier
        self._lease_s = float(lease_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._shards: dict[int, dict[str, Any]] = {}
        # The last generation handed out per shard: it keeps counting across deregistrations.
        self._generations: dict[int, int] = {}
        # Each worker's lease: its shard and when the lease runs out (`clock` seconds).
        self._leases: dict[str, tuple[int, float]] = {}
        # Leases held on each shard, registered or not (a deregistered shard that comes back
        # keeps the workers that still hold it). Always equals the count over `_leases`.
        self._loads: dict[int, int] = {}
        # Min-heap of (load, shard). An entry is current while its shard is registered and
        # `_loads[shard] == load`; every change of a load pushes a new entry, and the stale
        # ones are dropped when they reach the top (or by `_compact`). Every registered shard
        # has a current entry.
        self._by_load: list[tuple[int, int]] = []
        # Min-heap of (expiry, client). An entry is current while `_leases[client]` runs out
        # at that expiry; a renewal pushes a new one, and the old one is dropped when popped.
        self._expiries: list[tuple[float, str]] = []

    # -- proofs ------------------------------------------------------------------------------

    def _refusal(self, proof: object) -> str | None:
        """Why `proof` does not let its caller change this registry, or `None` if it does."""
        if self._verifier is None:
            if proof is None:
                return None
            return (
                "the service's registry was created without a token, so it cannot tell a "
                "learner's registration from any other task's, and this learner has one; "
                "create the service with the same token (create_service(token=...), or "
                f"{TOKEN_VAR} where it is created) or shut the open one down first"
            )
        if proof is None:
            return (
                f"the service's registry requires a proof of its token (its verifier begins "
                f"{self._verifier[:12]}), and none came: pass the token (TcpTransport(token=...) "
                f"or {TOKEN_VAR})"
            )
        if not isinstance(proof, bytes):
            return f"a proof is bytes, got {type(proof).__name__}"
        got = _verifier_of(proof)
        if not hmac.compare_digest(got, self._verifier):
            return (
                f"the proof is of another token: the registry's verifier begins "
                f"{self._verifier[:12]}, the proof's {got[:12]}"
            )
        return None

    def info(self) -> dict[str, Any]:
        """What clients check before they trust this registry: whose token it is bound to
        (`verifier`, or `None`: open), and the lease time."""
        return {"service": self._service, "verifier": self._verifier, "lease_s": self._lease_s}

    # -- shards ------------------------------------------------------------------------------

    def register(self, record: dict[str, Any], tag: str | None, proof: bytes | None) -> int | str:
        """Records `record` as its shard's registration: the next generation, or why not."""
        with self._lock:
            refused = self._refusal(proof)
            if refused is not None:
                return refused
            if not isinstance(record, dict):  # pyright: ignore[reportUnnecessaryIsInstance]
                return f"a registration is a dict, got {type(record).__name__}"
            shard = record.get("shard")
            if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
                return f"a registration names its shard as an int >= 0, got {shard!r}"
            if record.get("service") != self._service:
                return (
                    f"the registration is for service {record.get('service')!r}, this "
                    f"registry's is {self._service!r}"
                )
            if self._verifier is not None and not isinstance(tag, str):
                return "the registration carries no signature, and this service requires one"
            generation = self._generations.get(shard, 0) + 1
            self._generations[shard] = generation
            self._shards[shard] = {
                **record,
                "tag": tag,
                "generation": generation,
                "registered_unix_s": time.time(),
                "stats": None,
                "stats_unix_s": None,
            }
            heapq.heappush(self._by_load, (self._loads.get(shard, 0), shard))
            return generation

    def deregister(self, shard: int, generation: int, proof: bytes | None = None) -> bool | str:
        """Takes `shard` out if `generation` still holds it: whether it did, or why not."""
        with self._lock:
            record = self._held(shard, generation, proof)
            if not isinstance(record, dict):
                return record
            del self._shards[shard]  # its heap entries are stale from now on
            return True

    def report(
        self, shard: int, generation: int, stats: dict[str, Any], proof: bytes | None = None
    ) -> bool | str:
        """Records a learner's counters: whether `generation` still holds `shard`, or why
        the report is refused."""
        with self._lock:
            record = self._held(shard, generation, proof)
            if not isinstance(record, dict):
                return record
            record["stats"] = stats
            record["stats_unix_s"] = time.time()
            return True

    def _held(
        self, shard: int, generation: int, proof: bytes | None
    ) -> dict[str, Any] | bool | str:
        """`shard`'s record if `generation` still holds it and `proof` is accepted; else why
        not (the refusal) or `False` (a newer learner holds the shard now). Under the lock."""
        refused = self._refusal(proof)
        if refused is not None:
            return refused
        record = self._shards.get(shard)
        if record is None or record["generation"] != generation:
            return False
        return record

    def lookup(self, shard: int) -> dict[str, Any] | None:
        with self._lock:
            record = self._shards.get(shard)
            return None if record is None else dict(record)

    def shards(self) -> list[dict[str, Any]]:
        with self._lock:
            self._expire(self._clock())
            return [
                {**record, "workers": self._loads.get(shard, 0)}
                for shard, record in sorted(self._shards.items())
            ]

    # -- workers' leases -----------------------------------------------------------------------

    def assign(self, client: str, shard: int | None, exclude: int | None) -> dict[str, Any] | None:
        """The shard for `client`, on a fresh lease: `shard` when pinned (if registered),
        else the registered shard (other than `exclude`) with the fewest leases, ties to the
        lowest number. `None` (and no lease) when there is none."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._drop(client)
            if shard is not None:
                chosen = shard if shard in self._shards else None
            else:
                chosen = self._least_loaded(exclude)
            if chosen is None:
                return None
            self._grant(client, chosen, now)
            return dict(self._shards[chosen])

    def renew(self, client: str, shard: int) -> bool:
        """Extends `client`'s lease on `shard` by the lease time; a lease that ran out (or
        that this registry never gave: it was created anew) is granted again while `shard`
        is registered. Whether `client` holds a lease on `shard` now."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            lease = self._leases.get(client)
            if lease is not None and lease[0] == shard:
                expiry = now + self._lease_s
                self._leases[client] = (shard, expiry)
                heapq.heappush(self._expiries, (expiry, client))
                return True
            if shard not in self._shards:
                return False
            self._drop(client)
            self._grant(client, shard, now)
            return True

    def release(self, client: str) -> None:
        with self._lock:
            self._drop(client)

    def _grant(self, client: str, shard: int, now: float) -> None:
        """Gives `client` (holding no lease) a lease on `shard`."""
        expiry = now + self._lease_s
        self._leases[client] = (shard, expiry)
        heapq.heappush(self._expiries, (expiry, client))
        self._set_load(shard, self._loads.get(shard, 0) + 1)

    def _drop(self, client: str) -> None:
        """Ends `client`'s lease, if it holds one (its expiry entry goes stale)."""
        lease = self._leases.pop(client, None)
        if lease is not None:
            self._set_load(lease[0], self._loads[lease[0]] - 1)

    def _expire(self, now: float) -> None:
        """Ends every lease that ran out by `now`: each expiry entry is popped once, so
        O(log leases) amortised per renewal."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expiry, client = heapq.heappop(expiries)
            lease = self._leases.get(client)
            if lease is not None and lease[1] == expiry:
                self._drop(client)

    def _set_load(self, shard: int, load: int) -> None:
        if load:
            self._loads[shard] = load
        else:
            self._loads.pop(shard, None)
        if shard in self._shards:
            heapq.heappush(self._by_load, (load, shard))
            self._compact()

    def _compact(self) -> None:
        """Rebuilds the load heap from the current loads once stale entries outnumber the
        shards: O(shards) once every O(shards) pushes, so O(1) amortised."""
        if len(self._by_load) > 2 * len(self._shards) + 64:
            self._by_load = [(self._loads.get(s, 0), s) for s in self._shards]
            heapq.heapify(self._by_load)

    def _least_loaded(self, exclude: int | None) -> int | None:
        """The registered shard other than `exclude` with the fewest leases, ties to the
        lowest number (the heap's order), dropping the stale entries on top."""
        heap = self._by_load
        set_aside: list[tuple[int, int]] = []
        chosen: int | None = None
        while heap:
            load, shard = heap[0]
            if shard not in self._shards or self._loads.get(shard, 0) != load:
                heapq.heappop(heap)  # stale
            elif shard == exclude:
                set_aside.append(heapq.heappop(heap))
            else:
                chosen = shard
                break
        for entry in set_aside:
            heapq.heappush(heap, entry)
        return chosen


def registry_runtime_env(ray: Any, token: str | None) -> dict[str, Any]:
    """The runtime_env a registry is created with: its creator's, except that every
    environment variable that holds the token, and `ECHO_TOKEN` always, is set empty. An
    actor inherits its creator's runtime_env (a learner actor's `env_vars` included), and
    the registry must never hold the token."""
    inherited: dict[str, Any] = {}
    try:
        inherited = dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})
    except Exception as e:  # noqa: BLE001 (only what to blank out depends on it; say why)
        _log.debug("echo.ray: reading this process's runtime_env failed: %s", e)
    names = {TOKEN_VAR}
    if token is not None:
        for name, value in {**os.environ, **inherited}.items():
            text = str(value)
            # A long token is found inside a value too ("Bearer <token>"); a short one only
            # as the whole value, lest it blank out unrelated variables (PATH, PYTHONPATH).
            if text == token or (len(token) >= 16 and token in text):
                names.add(name)
    return {"env_vars": dict.fromkeys(sorted(names), "")}


def which_token(verifier: str | None) -> str:
    """How a message names a token: by its verifier's first hex digits (never the token)."""
    return "no token" if verifier is None else f"the token whose verifier begins {verifier[:12]}"


def service_key(service: str, info: dict[str, Any], token: str | None) -> ServiceKey | None:
    """The key a worker checks registrations with, once its token and the registry agree:
    both without a token (an open service), or the registry's verifier is the token's."""
    theirs = info.get("verifier")
    if token is None:
        if theirs is None:
            return None
        raise PermissionError(
            f"echo service {service!r} is bound to {which_token(theirs)}, and this worker "
            f"has no token: pass token= or set {TOKEN_VAR}"
        )
    key = ServiceKey.of(token, service)
    if theirs is None:
        raise PermissionError(
            f"echo service {service!r} was created without a token, so its registry accepts a "
            f"shard registered by any Ray task, and this worker has a token "
            f"({which_token(key.verifier)}) and sends only to shards registered with it: "
            f"create the service with the token (create_service(token=...), or "
            f"{TOKEN_VAR} where it is created), or connect without one"
        )
    if not hmac.compare_digest(str(theirs), key.verifier):
        raise PermissionError(
            f"echo service {service!r} is bound to {which_token(str(theirs))}; this worker "
            f"has {which_token(key.verifier)}"
        )
    return key
