"""echo on Ray: several learners' servers (shards) found by name, and workers that follow them.

Ray is the control plane, echo's TCP and shared memory stay the data plane:

- A **registry** per service: a detached, named Ray actor that records each shard's address,
  port, layout and generation (and the counters its learner reports), and which shard each
  worker holds a lease on. It outlives the driver that created it; `shutdown_service`
  removes it. It never holds a token, and is started without the environment variables
  that carry it.
- **Learners** start a `Server` as usual and `serve(server, service, shard)` it, or let
  `shard_server` build one that restores itself from its newest periodic checkpoint, which is
  what a learner actor restarted by Ray (`max_restarts`) needs. Either way the learner
  holds its `Server` and publishes its parameters with `server.publish(params)`.
- **Workers** `connect(service, example)`: a `ShardClient`, which is a `TcpClient` that asks
  the registry where its shard is before every connection attempt. When the shard's learner
  restarts (another node, another port) it finds the new address and resends what was not
  acknowledged; when the shard is deregistered for good it moves to another shard. With
  `params_example=`, `client.params()` fetches the parameters its shard's learner published.

With a token (the learners' `TcpTransport(token=)` or `ECHO_TOKEN`), a service is bound to
it: the registry is created holding only a verifier derived from the token, refuses any
registration, report or deregistration that does not prove the token, and every registration
is signed with a key derived from it, which workers check with their own token before they
send anything. Without a token, Ray's own trust model applies: any task that can run in the
cluster can register a shard and receive the workers' samples. See the threat model guide.

The shard rule: a worker that does not pin one (`shard=`) gets the registered shard with the
fewest workers attached, ties going to the lowest shard number, so workers that attach one
after another are spread across the shards to within one. It keeps that shard while the shard
is registered, restarts included, and moves (by the same rule) only when it is deregistered.
A worker's place is a lease that its client renews; a worker that dies without closing
(killed, its node lost) stops renewing, and its place is freed once the lease runs out
(`DEFAULT_LEASE_S`). See the guide "Scaling past one learner" for what can be lost in each
failure.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import secrets
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from typing_extensions import Self
from echo._ragged_client import RaggedTcpClient
from echo._ray_layout import Record as _Record
from echo._ray_layout import example_record as _example_record
from echo._ray_layout import layout_mismatch as _layout_mismatch
from echo._ray_layout import server_record as _server_record
from echo._ray_registry import DEFAULT_LEASE_S
from echo._ray_registry import TOKEN_VAR as _TOKEN_VAR
from echo._ray_registry import Registry as _Registry
from echo._ray_registry import ServiceKey as _ServiceKey
from echo._ray_registry import registry_runtime_env as _registry_runtime_env
from echo._ray_registry import service_key as _service_key
from echo._ray_registry import sign as _sign
from echo._ray_registry import token_from_env as _token_from_env
from echo._ray_registry import which_token as _which_token
from echo._validate import check_int, check_seconds, check_token
from echo.checkpoint import periodic_checkpoints
from echo.client import TcpClient
from echo.ragged import has_ragged_leaves
from echo.server import Server
from echo.transport import TcpTransport

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_NAMESPACE",
    "RaggedShardClient",
    "Registration",
    "ShardClient",
    "ShardStatus",
    "UnknownServiceError",
    "connect",
    "create_service",
    "registration",
    "serve",
    "services",
    "shard_server",
    "shutdown_service",
    "status",
]

_log = logging.getLogger("echo")

DEFAULT_NAMESPACE = "echo"
"""The Ray namespace registries live in unless told otherwise."""

# A registry's actor name: this prefix and the service's name.
_PREFIX = "echo-registry:"
# How long a call to the registry may take before it counts as unanswered.
_REGISTRY_CALL_S = 30.0
# Registry calls a threaded registry actor serves at once (each is a dict lookup).
_REGISTRY_CONCURRENCY = 64
# Interfaces that mean "every interface": never registered as an address.
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})

# Pauses between looks for a registry that does not exist yet: doubling up to the longest.
_FIRST_LOOK_S = 0.05
_LONGEST_LOOK_S = 1.0


def _ray() -> Any:
    """The `ray` module, or an `ImportError` naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "echo.ray needs Ray, which is not installed: pip install 'id-echo[distributed]' "
            "(the `distributed` extra)"
        ) from e
    return ray


class UnknownServiceError(LookupError):
    """No registry of that name in that namespace (for `connect()`: none appeared within its
    `connect_timeout`); the message lists the services there are."""


@dataclasses.dataclass(frozen=True)
class ShardStatus:
    """One shard as `status()` reports it: where it is, and its server's counters as its
    learner last reported them (`stats_age_s` ago; `None` before the first report)."""

    shard: int
    host: str
    port: int
    generation: int
    node_id: str
    pid: int
    workers: int
    """Workers the registry assigned to this shard (attached `ShardClient`s)."""
    connections: int | None
    """`stats().active_connections`: TCP connections the server has open now."""
    size: int | None
    """`stats().store_size`: items (FIFO: samples committed, not yet handed out) stored."""
    capacity: int | None
    """`Server.max_size` (replay, sequence) or `batch_size * num_buffers` (FIFO)."""
    inserted: int | None
    """`stats().samples_inserted_total`."""
    sampled: int | None
    """`stats().items_sampled_total`."""
    stats_age_s: float | None
    metrics_url: str | None
    """Where the shard's Prometheus endpoint is, when its learner gave one to `serve()`."""


def _registry(
    service: str,
    namespace: str,
    *,
    create: bool,
    token: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    wait_s: float = 0.0,
) -> Any:
    """The handle of `service`'s registry. `create`: created (detached, bound to `token`'s
    verifier when there is one) if missing. Otherwise looked up, for `wait_s` seconds if it
    does not exist yet, and then `UnknownServiceError`."""
    ray = _ray()
    if not isinstance(service, str) or not service:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"service must be a non-empty str, got {service!r}")
    if not ray.is_initialized():
        ray.init()
    name = _PREFIX + service
    if create:
        verifier = None if token is None else _ServiceKey.of(token, service).verifier
        actor = ray.remote(_Registry).options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=_REGISTRY_CONCURRENCY,
            runtime_env=_registry_runtime_env(ray, token),
        )
        return actor.remote(service, verifier, lease_s)
    started = time.monotonic()
    pause = _FIRST_LOOK_S
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            pass
        left = started + wait_s - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(pause, left))
        pause = min(2 * pause, _LONGEST_LOOK_S)
    waited = time.monotonic() - started
    known = services(namespace)
    there = ", ".join(repr(s) for s in known) if known else "none"
    if wait_s > 0:
        raise UnknownServiceError(
            f"no echo service {service!r} appeared in Ray namespace {namespace!r} within "
            f"connect_timeout={wait_s:g}s: waited {waited:.1f}s for its "
            f"registry (the named actor {name!r}, which a learner's serve() or "
            f"create_service() creates); the services there are: {there}"
        )
    raise UnknownServiceError(
        f"no echo service {service!r} in Ray namespace {namespace!r}; the services there "
        f"are: {there} (a learner's serve() or create_service() makes one)"
    )


def _call(method: Any, *args: Any, timeout: float = _REGISTRY_CALL_S) -> Any:
    ray = _ray()
    return ray.get(method.remote(*args), timeout=timeout)


def create_service(
    service: str,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    token: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
) -> None:
    """Creates `service`'s registry if it does not exist (a detached actor that outlives this
    driver), so that workers started before any learner can `connect()` and wait for one.

    Args:
        service: The service's name.
        namespace: The Ray namespace of the registry.
        token: The token the service is bound to: the registry then accepts registrations
            only from learners that prove it, and workers check every registration with
            it. The registry gets a verifier derived from it, never the token. `None`:
            `ECHO_TOKEN` of this process or, where that is unset (a driver), the
            `ECHO_TOKEN` its job's `runtime_env` gives every worker; unset or empty
            everywhere: an open service (Ray's trust model: any task may register a shard).
        lease_s: How long a worker's place on a shard lasts without a renewal (clients
            renew every third of it): a worker that dies without closing frees its place
            within this time.

    Raises:
        PermissionError: The service exists already and is bound to another token (or to
            none while this call has one, or the reverse).
        ValueError: The service exists already with another `lease_s`; `lease_s` is not a
            positive number of seconds.
    """
    seconds = check_seconds("lease_s", lease_s, optional=False)
    assert seconds is not None
    ray = _ray()
    if not ray.is_initialized():
        ray.init()
    token = check_token("token", token)
    if token is None:
        token = _token_from_env() or _job_token(ray)
    registry = _registry(service, namespace, create=True, token=token, lease_s=seconds)
    info = _call(registry.info)  # returns once the actor is up
    ours = None if token is None else _ServiceKey.of(token, service).verifier
    if info["verifier"] != ours:
        raise PermissionError(
            f"echo service {service!r} exists already with {_which_token(info['verifier'])}; "
            f"this call has {_which_token(ours)}"
        )
    if info["lease_s"] != seconds:
        raise ValueError(
            f"echo service {service!r} exists already with lease_s={info['lease_s']:g}, "
            f"not {seconds:g} (shut it down first to change it)"
        )


def _job_token(ray: Any) -> str | None:
    """The `ECHO_TOKEN` this process's runtime_env sets (a driver's: its job's), if any."""
    try:
        env_vars: dict[str, Any] = ray.get_runtime_context().runtime_env.get("env_vars") or {}
    except Exception as e:  # noqa: BLE001 (then there is none to read; say why)
        _log.debug("echo.ray: reading this process's runtime_env failed: %s", e)
        return None
    return str(env_vars.get(_TOKEN_VAR) or "") or None


def shutdown_service(service: str, *, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Removes `service`'s registry (its learners and workers keep running; workers that lose
    their connection then cannot find it again). Raises `UnknownServiceError` if there is none."""
    ray = _ray()
    ray.kill(_registry(service, namespace, create=False))


def services(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """The services with a registry in `namespace`, sorted."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init()
    actors: list[dict[str, str]] = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"].removeprefix(_PREFIX)
        for a in actors
        if a["name"].startswith(_PREFIX) and a.get("namespace") == namespace
    )


def status(service: str, *, namespace: str = DEFAULT_NAMESPACE) -> list[ShardStatus]:
    """The registered shards of `service`, by shard number, with their learners' last
    reported counters (see `ShardStatus`)."""
    registry = _registry(service, namespace, create=False)
    now = time.time()
    out: list[ShardStatus] = []
    for record in _call(registry.shards):
        stats: dict[str, Any] = record["stats"] or {}
        at = record["stats_unix_s"]
        out.append(
            ShardStatus(
                shard=record["shard"],
                host=record["host"],
                port=record["port"],
                generation=record["generation"],
                node_id=record["node_id"],
                pid=record["pid"],
                workers=record["workers"],
                connections=stats.get("active_connections"),
                size=stats.get("store_size"),
                capacity=record.get("capacity"),
                inserted=stats.get("samples_inserted_total"),
                sampled=stats.get("items_sampled_total"),
                stats_age_s=None if at is None else max(0.0, now - at),
                metrics_url=record.get("metrics_url"),
            )
        )
    return out


def _stats_dict(server: Server) -> dict[str, Any]:
    stats = server.stats()
    return {
        "active_connections": stats.active_connections,
        "store_size": stats.store_size,
        "samples_inserted_total": stats.samples_inserted_total,
        "items_sampled_total": stats.items_sampled_total,
        "shm_connections_total": stats.shm_connections_total,
        "sessions_resumed_total": stats.sessions_resumed_total,
    }


class Registration:
    """A server registered as a shard of a service (what `serve()` returns).

    A thread reports the server's counters to the registry every `report_every` seconds (what
    `status()` shows). `deregister()`, or the server's `close()`, takes the shard out of the
    registry for good: its workers move to other shards. A learner that dies without either
    (killed, preempted, a crash), or closes with `close(restarting=True)`, stays registered,
    so its workers wait for it to come back: a restarted learner that serves the same shard
    again gets the next generation.
    """

    def __init__(
        self,
        server: Server,
        registry: Any,
        service: str,
        shard: int,
        generation: int,
        proof: bytes | None = None,
    ) -> None:
        self.service = service
        self.shard = shard
        self.generation = generation
        self._registry = registry
        # What proves the service's token to the registry (`None`: an open service).
        self._proof = proof
        self._server = weakref.ref(server)
        self._stop = threading.Event()
        self._done = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _start_reports(self, every: float) -> None:
        def report() -> None:
            while not self._stop.wait(every):
                server = self._server()
                if server is None or server.closed:
                    return
                try:
                    stats = _stats_dict(server)
                    current = _call(
                        self._registry.report, self.shard, self.generation, stats, self._proof
                    )
                except Exception as e:  # noqa: BLE001 (a report is best effort; say why)
                    _log.warning(
                        "echo.ray: shard %d: reporting to the registry failed: %s", self.shard, e
                    )
                    continue
                if isinstance(current, str):
                    _log.warning(
                        "echo.ray: shard %d: the registry refused a report (%s); stopping reports",
                        self.shard,
                        current,
                    )
                    return
                if not current:
                    _log.warning(
                        "echo.ray: shard %d generation %d is no longer registered (a newer "
                        "learner took the shard, or it was deregistered); stopping reports",
                        self.shard,
                        self.generation,
                    )
                    return

        self._thread = threading.Thread(
            target=report, name=f"echo-ray-report-{self.shard}", daemon=True
        )
        self._thread.start()

    def _closing(self, restarting: bool) -> None:
        """The server's close hook: for good, deregister; restarting, stay registered (the
        learner comes back, and its workers wait for it)."""
        if restarting:
            self._stop.set()
        else:
            self.deregister()

    @property
    def registered(self) -> bool:
        """Whether `deregister()` (or the server's `close()`) has not run yet."""
        return not self._done

    def deregister(self) -> bool:
        """Takes the shard out of the registry for good (idempotent). Returns whether this
        generation was still the registered one."""
        with self._lock:
            if self._done:
                return False
            self._done = True
        self._stop.set()
        try:
            done = _call(self._registry.deregister, self.shard, self.generation, self._proof)
        except Exception as e:  # noqa: BLE001 (close() must go on; say why)
            _log.warning("echo.ray: shard %d: deregistering failed: %s", self.shard, e)
            return False
        if isinstance(done, str):
            _log.warning(
                "echo.ray: shard %d: the registry refused to deregister: %s", self.shard, done
            )
            return False
        return bool(done)

    def __repr__(self) -> str:
        return (
            f"Registration(service={self.service!r}, shard={self.shard}, "
            f"generation={self.generation}, registered={self.registered})"
        )


# The registration of each served server (for `registration()`).
_registrations: weakref.WeakKeyDictionary[Server, Registration] = weakref.WeakKeyDictionary()


def registration(server: Server) -> Registration | None:
    """The `Registration` of `server` (from `serve()` or `shard_server()`), or `None`."""
    return _registrations.get(server)


def _reachable_host(server: Server, host: str | None) -> str:
    if host is not None:
        if host in _WILDCARDS:
            raise ValueError(f"host={host!r} is not an address workers can reach")
        return host
    transport = server._transport  # pyright: ignore[reportPrivateUsage]
    bound = transport.host if transport is not None else ""
    if bound in _WILDCARDS:
        return str(_ray().util.get_node_ip_address())
    return bound


def serve(
    server: Server,
    service: str,
    shard: int,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    host: str | None = None,
    report_every: float = 1.0,
    metrics_url: str | None = None,
) -> Registration:
    """Registers a started `server` as shard `shard` of `service` (creating the registry if
    needed) and deregisters it when the server is closed.

    The server's token (its `TcpTransport(token=)`, or `ECHO_TOKEN`, as the server reads it)
    binds the registration: a registry this call creates holds only a verifier derived from
    it; the registration proves the token to the registry and is signed with a key derived
    from it, which workers check with their own token before they send. Without a token the
    service is open: any Ray task may register a shard (see the threat model guide).

    Args:
        server: A `Server` with a `TcpTransport`, already started (its port is bound).
        service: The service's name: workers `connect()` to it.
        shard: This server's shard number (>= 0). Serving a shard that is registered already
            replaces it (a learner coming back after a crash): the registration gets the next
            generation, and the old one's deregistration no longer applies.
        namespace: The Ray namespace of the registry.
        host: The address workers connect to. `None`: the transport's host, or, when it binds
            every interface ("0.0.0.0", the default), this node's address as Ray knows it.
            Never a wildcard.
        report_every: Seconds between reports of the server's counters (`status()`).
        metrics_url: Where this shard's Prometheus endpoint is, listed by `status()`.

    Raises:
        ValueError: The server has no transport or is not started, `shard` < 0, or `host`
            is a wildcard.
        PermissionError: The registry refused the registration: the service is bound to
            another token, or to one while this server has none, or it is open while this
            server has a token (the message says which, by the tokens' verifiers).
        ImportError: Ray is not installed.
    """
    if server.closed:
        raise ValueError("serve() needs an open server; this one is closed")
    if server.port is None:
        raise ValueError(
            "serve() needs a started server with a TcpTransport (workers reach it over TCP): "
            "Server(..., transport=TcpTransport(port=0)) and server.start() first"
        )
    shard = check_int("shard", shard, 0)
    if not report_every > 0:
        raise ValueError(f"report_every must be > 0 seconds, got {report_every!r}")
    ray = _ray()
    reachable = _reachable_host(server, host)
    transport = server._transport  # pyright: ignore[reportPrivateUsage]
    token = (transport.token if transport is not None else None) or _token_from_env()
    key = None if token is None else _ServiceKey.of(token, service)
    registry = _registry(service, namespace, create=True, token=token)
    context = ray.get_runtime_context()
    record: dict[str, Any] = {
        "service": service,
        "shard": shard,
        "host": reachable,
        "port": server.port,
        "layout": _server_record(server),
        "batch_size": server.batch_size,
        "capacity": server.capacity,
        "node_id": context.get_node_id(),
        "pid": os.getpid(),
        "metrics_url": metrics_url,
        "nonce": secrets.token_hex(16),
        "issued_unix_ns": time.time_ns(),
    }
    tag = None if key is None else _sign(key, record)
    answer = _call(registry.register, record, tag, None if key is None else key.proof)
    if isinstance(answer, str):
        raise PermissionError(
            f"the registry of echo service {service!r} refused shard {shard} at "
            f"{reachable}:{server.port}: {answer}"
        )
    generation = int(answer)
    served = Registration(
        server, registry, service, shard, generation, None if key is None else key.proof
    )
    server._close_hooks.append(served._closing)  # pyright: ignore[reportPrivateUsage]
    _registrations[server] = served
    served._start_reports(report_every)  # pyright: ignore[reportPrivateUsage]
    _log.info(
        "echo.ray: %s:%d serves shard %d of %r (generation %d)",
        record["host"],
        record["port"],
        shard,
        service,
        generation,
    )
    return served


def shard_server(
    service: str,
    shard: int,
    example: Any,
    batch_size: int,
    *,
    checkpoint_dir: str | os.PathLike[str],
    checkpoint_every: float = 60.0,
    checkpoint_keep: int = 3,
    transport: TcpTransport | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    host: str | None = None,
    report_every: float = 1.0,
    metrics_port: int | None = None,
    **server_options: Any,
) -> Server:
    """A started, registered server for shard `shard` of `service`, in this process (the
    learner's: it samples in-process, zero-copy), restored from its newest periodic
    checkpoint when there is one. Call it in a learner actor's `__init__`: when Ray restarts
    the actor (`max_restarts`), on this node or another, the new one comes back with the
    replay of the last checkpoint and registers again with the next generation, and the
    shard's workers reconnect to it.

    Args:
        service: As `serve()`.
        shard: As `serve()`.
        example: As `Server`'s (when restoring, checked against the checkpoint's layout).
        batch_size: As `Server`'s (when restoring, checked against the checkpoint's).
        checkpoint_dir: Where this shard's periodic checkpoints go and are restored from; on
            storage every node that may run the learner can read (one per shard).
        checkpoint_every: As `Server`'s.
        checkpoint_keep: As `Server`'s.
        namespace: As `serve()`.
        host: As `serve()`.
        report_every: As `serve()`.
        transport: Where workers connect; default `TcpTransport(port=0)` (every interface,
            a free port, registered under this node's address).
        metrics_port: Also serve this shard's Prometheus metrics (`echo.serve_metrics`, the
            `metrics` extra) on this port (0: a free one), on the interface the transport
            binds; `status()` lists its URL. Closed with the server. `None`: no endpoint.
        **server_options: Other `Server` settings (`sampler`, `max_size`, `rate_limiter`,
            `num_drainers`, `checkpoint_extra`, `name`, ...). A restored server keeps the
            checkpoint's data settings, and `Server.restore` raises `ValueError` if one given
            here differs (a shard cannot come back as another kind of table); the others
            are taken as given. The learner's own state saved with `checkpoint_extra` comes
            back as the server's `restored_extra`.

    Raises:
        ValueError: A bad setting (as `Server` and `serve()` raise it), or a data setting
            that differs from the checkpoint's (as `Server.restore` raises it).
        CheckpointError: The newest checkpoint is damaged (as `Server.restore` raises it).
        OSError: The transport's port cannot be bound.
        ImportError: Ray is not installed (or, with `metrics_port`, prometheus_client).
    """
    transport = TcpTransport(port=0) if transport is None else transport
    newest = periodic_checkpoints(checkpoint_dir)
    if newest:
        _log.info("echo.ray: shard %d restores %s", shard, newest[-1])
        server = Server.restore(
            newest[-1],
            example,
            transport=transport,
            batch_size=batch_size,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            **server_options,
        )
    else:
        server = Server(
            example,
            batch_size,
            transport,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            **server_options,
        )
    try:
        server.start()
        metrics_url = None
        if metrics_port is not None:
            from echo.metrics import serve_metrics

            endpoint = serve_metrics(server, port=metrics_port, host=transport.host)
            server._close_hooks.append(lambda _restarting: endpoint.close())  # pyright: ignore[reportPrivateUsage]
            reachable = _reachable_host(server, host)
            metrics_url = f"http://{reachable}:{endpoint.port}/metrics"
        serve(
            server,
            service,
            shard,
            namespace=namespace,
            host=host,
            report_every=report_every,
            metrics_url=metrics_url,
        )
    except BaseException:
        server.close()
        raise
    return server


class _ShardResolver:
    """A `ShardClient`'s resolver: the cached shard's address, asked of the registry again
    after a failed attempt (the learner may have moved or gone). With a token (`key`), every
    registration the registry hands out must carry the learner's signature, or it is refused
    before anything is sent to its address."""

    def __init__(
        self,
        service: str,
        registry: Any,
        layout: _Record,
        shard: int | None,
        client: str,
        key: _ServiceKey | None,
    ) -> None:
        self.service = service
        self.registry = registry
        self.layout = layout
        self.pinned = shard
        self.client = client
        self.key = key
        self.record: dict[str, Any] | None = None
        self.moves = 0

    def __call__(self, last: tuple[str, int, str] | None) -> tuple[str, int] | None:
        record = self.record
        if record is not None and last is None:
            return record["host"], record["port"]
        try:
            if record is None:
                found = _call(self.registry.assign, self.client, self.pinned, None)
            else:
                found = _call(self.registry.lookup, record["shard"])
                if found is None and self.pinned is None:
                    # Deregistered for good: another shard, by the same rule.
                    found = _call(self.registry.assign, self.client, None, record["shard"])
        except Exception as e:
            if record is None:
                raise
            _log.warning(
                "echo.ray: the registry of %r did not answer (%s); trying shard %d at %s:%d",
                self.service,
                e,
                record["shard"],
                record["host"],
                record["port"],
            )
            return record["host"], record["port"]
        if found is None:
            return None
        self._check_signature(found)
        mismatch = _layout_mismatch(found["layout"], self.layout)
        if mismatch is not None:
            raise ValueError(
                f"shard {found['shard']} of service {self.service!r} stores samples of "
                f"another layout: {mismatch}"
            )
        if record is not None and found["shard"] != record["shard"]:
            self.moves += 1
            _log.warning(
                "echo.ray: shard %d of %r is gone; moving to shard %d",
                record["shard"],
                self.service,
                found["shard"],
            )
        self.record = found
        return found["host"], found["port"]

    def _check_signature(self, found: dict[str, Any]) -> None:
        """Refuses a registration its learner did not sign with this service's token. The
        registry refuses such registrations itself; this check is what holds when the
        registry was replaced or tampered with (any Ray task can run code in an actor)."""
        if self.key is None:
            return
        where = f"shard {found.get('shard')!r} at {found.get('host')}:{found.get('port')}"
        if found.get("service") != self.service:
            raise PermissionError(
                f"the registry of echo service {self.service!r} handed out a registration of "
                f"service {found.get('service')!r} ({where}); refusing to send to it"
            )
        if self.pinned is not None and found.get("shard") != self.pinned:
            raise PermissionError(
                f"the registry of echo service {self.service!r} handed out {where} for "
                f"pinned shard {self.pinned}; refusing to send to it"
            )
        tag = found.get("tag")
        if not isinstance(tag, str) or not hmac.compare_digest(tag, _sign(self.key, found)):
            # Never show the tag that would have been right: it would sign this record.
            got = "none" if not isinstance(tag, str) else f"a tag beginning {tag[:12]!r}"
            raise PermissionError(
                f"the registry of echo service {self.service!r} handed out {where}, whose "
                f"registration is not signed with this service's token (expected an "
                f"HMAC-SHA256 tag made with a key derived from the token, got {got}): "
                f"refusing to send to it. A task without the token registered it, or the "
                f"registry was tampered with"
            )


def _renew_leases(resolver: _ShardResolver, every: float, stop: threading.Event) -> None:
    """A `ShardClient`'s renewals (its own thread, holding no reference to the client):
    every `every` seconds, the lease on the shard it uses now, until `stop`. The lease lasts
    three intervals, so one failed renewal costs nothing; failures are logged."""
    failing = False
    while not stop.wait(every):
        record = resolver.record
        if record is None:
            continue
        try:
            _call(resolver.registry.renew, resolver.client, record["shard"], timeout=3 * every)
        except Exception as e:  # noqa: BLE001 (the next renewal tries again; say why)
            level = logging.DEBUG if failing else logging.WARNING
            _log.log(
                level, "echo.ray: renewing the lease on shard %d failed: %s", record["shard"], e
            )
            failing = True
        else:
            failing = False


class ShardClient(TcpClient):
    """A `TcpClient` to a shard of an echo service on Ray (see `connect()`); it has
    `TcpClient`'s API, `shard` and `generation` besides. A thread renews its lease on the
    shard every third of the service's lease time until `close()`. With an example of
    `echo.Ragged` leaves it is a `RaggedShardClient` (`send_group()` too)."""

    def __new__(  # pyright: ignore[reportInconsistentConstructor]
        cls, service: str = "", data_sample: Any = None, *args: Any, **kwargs: Any
    ) -> Self:
        """A `RaggedShardClient` when `data_sample` has `echo.Ragged` leaves."""
        if cls is ShardClient and has_ragged_leaves(data_sample):
            return cast("Self", object.__new__(RaggedShardClient))
        return object.__new__(cls)

    def __init__(  # pyright: ignore[reportInconsistentConstructor]
        self,
        service: str,
        data_sample: Any,
        max_inflight_msgs: int = 32,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        shard: int | None = None,
        connect_timeout: float = 60.0,
        protocol: Literal["auto", 2] = 2,
        token: str | None = None,
        reconnect: bool = True,
        reconnect_timeout: float = 60.0,
        heartbeat_timeout: float | None = 10.0,
        shared_memory: bool | None = None,
        name: str | None = None,
        durable: bool = False,
        durable_bytes: int = 256 * 2**20,
        params_example: Any = None,
    ) -> None:
        if reconnect is not True:
            raise ValueError(
                "echo.ray clients always reconnect (that is how they follow a restarted or "
                f"moved shard); got reconnect={reconnect!r}"
            )
        if shard is not None:
            shard = check_int("shard", shard, 0)
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        token = check_token("token", token)
        started = time.monotonic()
        registry = _registry(service, namespace, create=False, wait_s=connect_timeout)
        info = _call(registry.info)
        key = _service_key(service, info, token if token is not None else _token_from_env())
        self._service = service
        self._client_id = uuid.uuid4().hex
        self._resolver = _ShardResolver(
            service, registry, _example_record(data_sample), shard, self._client_id, key
        )
        self._renewing = threading.Event()
        weakref.finalize(self, self._renewing.set)  # no renewals for a client collected unclosed
        self._renewals = threading.Thread(
            target=_renew_leases,
            args=(self._resolver, float(info["lease_s"]) / 3, self._renewing),
            name=f"echo-ray-lease-{service}",
            daemon=True,
        )
        self._renewals.start()
        left = max(connect_timeout - (time.monotonic() - started), 0.001)
        try:
            self._open(
                "",
                0,
                data_sample,
                max_inflight_msgs,
                connect_timeout=min(left, 10.0),
                protocol=protocol,
                token=token,
                reconnect=True,
                reconnect_timeout=reconnect_timeout,
                heartbeat_timeout=heartbeat_timeout,
                shared_memory=shared_memory,
                name=name,
                durable=durable,
                durable_bytes=durable_bytes,
                params_example=params_example,
                dial_timeout=left,
                resolver=self._resolver,
            )
        except TimeoutError as e:
            self._release()
            which = "no shard" if shard is None else f"shard {shard}"
            raise TimeoutError(
                f"{which} of echo service {service!r} could be reached within "
                f"{connect_timeout}s: {e}"
            ) from None
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Stops the renewals and gives the lease back (after the last renewal, so that it
        cannot take the lease again)."""
        self._renewing.set()
        if self._renewals.is_alive() and self._renewals is not threading.current_thread():
            self._renewals.join(timeout=5.0)
        try:
            self._resolver.registry.release.remote(self._client_id)
        except Exception as e:  # noqa: BLE001 (the registry may be gone; nothing to undo then)
            _log.debug("echo.ray: releasing a client failed: %s", e)

    @property
    def service(self) -> str:
        """The service this client sends to."""
        return self._service

    @property
    def shard(self) -> int | None:
        """The shard this client sends to (the last it connected to)."""
        record = self._resolver.record
        return None if record is None else int(record["shard"])

    @property
    def generation(self) -> int | None:
        """The generation of that shard's registration when this client last asked."""
        record = self._resolver.record
        return None if record is None else int(record["generation"])

    @property
    def moves(self) -> int:
        """Times this client moved to another shard (its shard was deregistered)."""
        return self._resolver.moves

    def close(self, timeout: float | None = 30.0) -> bool:
        """As `TcpClient.close()`; also tells the registry this worker left its shard."""
        was_closed = self._closed
        flushed = super().close(timeout)
        if not was_closed:
            self._release()
        return flushed

    def __repr__(self) -> str:
        return (
            f"ShardClient(service={self._service!r}, shard={self.shard}, "
            f"generation={self.generation}, path={self.transport_path!r}, sent={self.sent}, "
            f"acked={self.acked}, closed={self._closed})"
        )


class RaggedShardClient(ShardClient, RaggedTcpClient):
    """A `ShardClient` whose example has `echo.Ragged` leaves: `RaggedTcpClient`'s sends
    (`send()`, `send_group()`), to the shard the registry names, following it when its
    learner restarts or the shard moves (resending what was not stored)."""


def connect(
    service: str,
    example: Any,
    max_inflight_msgs: int = 32,
    **options: Any,
) -> ShardClient:
    """A client that sends samples shaped like `example` to a shard of `service`.

    It asks the registry for a shard (the one with the fewest workers, ties to the lowest
    number; `shard=k` pins one) and connects to it over TCP, or same-host shared memory as
    `TcpClient` does. It reconnects by itself (`reconnect=True` is implied): when the shard's
    learner restarts, possibly on another node and port, it finds the new address in the
    registry and resends every sample not acknowledged; when the shard is deregistered for
    good it moves to another shard and resends them there. A worker started before any
    learner, or before the service's registry exists at all (actors start in any order),
    waits up to `connect_timeout` (default 60 s) for one. Its place on the shard is a
    lease that a thread of the client renews (every third of the service's `lease_s`)
    until `close()`.

    With a token (`token=` or `ECHO_TOKEN`), the client sends only to shards whose learner
    signed its registration with the same token, and it is the TCP token too.

    Args:
        service: The service's name.
        example: A pytree like the learners' examples.
        max_inflight_msgs: As `TcpClient`'s.
        **options: `namespace`, `shard`, `connect_timeout`, and `TcpClient`'s `token`,
            `reconnect_timeout`, `heartbeat_timeout`, `shared_memory`, `name`, `protocol`
            (2 or "auto"), `reconnect` (only `True`), `durable` and `durable_bytes` (a shard
            restored from its checkpoint, on whatever node and port, resumes a durable
            client's session where the checkpoint stands; a client that moves to another
            shard resends there what was not persisted, except after a final close, whose
            learner took what it acknowledged). A pinned `shard` that is deregistered
            is waited for (up to `reconnect_timeout`), not left. The token is never stored in
            the registry: pass it here or in `ECHO_TOKEN` (e.g. in the actor's
            `runtime_env`). `params_example` (a pytree like the parameters the learners
            publish): `params()` and `params_version` then fetch and follow what the
            learner of the shard this client sends to publishes (`Server.publish`).

    Raises:
        UnknownServiceError: No registry of that name appeared within `connect_timeout` (the
            message says how long it waited and lists the services there are).
        PermissionError: The service is bound to another token than this worker's, or to
            one while this worker has none, or is open while this worker has one; or a
            registration it was handed is not signed with the token (then nothing is sent).
        ValueError: The shard stores samples of another layout (the message names the leaf).
        TimeoutError: No shard could be reached within `connect_timeout`.
        ImportError: Ray is not installed.
    """
    return ShardClient(service, example, max_inflight_msgs, **options)
