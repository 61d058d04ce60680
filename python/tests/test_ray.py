"""echo on Ray (`echo.ray`), each test a failure case, on a local two-node Ray cluster
(`ray.cluster_utils.Cluster`) on loopback: the registry outliving its driver, disjoint shards,
a learner killed and restarted by Ray, a shard deregistered for good, a worker waiting for a
learner, and the precise errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="echo.ray needs the `distributed` extra")
from _ray_actors import (  # noqa: E402
    EXAMPLE,
    SERVICE_NAMESPACE,
    Learner,
    Worker,
    params_digest,
    params_of,
    plant_registration,
    registry_insides,
    sample_of,
)
from ray.cluster_utils import Cluster  # noqa: E402
from testkit.checkpoints import wait_for_ragged_checkpoint  # noqa: E402

import echo  # noqa: E402
import echo.ray  # noqa: E402

pytestmark = [
    pytest.mark.timeout(240),
    # Ray forks while starting a cluster; JAX (imported by other test modules) warns at every
    # fork of a process that loaded it, which is harmless here (the child only execs Ray's
    # processes).
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
]

TESTS = Path(__file__).resolve().parent
NS = SERVICE_NAMESPACE
WAIT_S = 120.0
# The token of the services bound to one (never one a test process has in its environment).
TOKEN = "the token of this test's learners and workers"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two nodes (a head and one more) with 2 CPUs each, told apart by custom resources."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    with warnings.catch_warnings():  # see pytestmark: Ray forks, JAX warns
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        made = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                "resources": {"node0": 100},
            },
        )
        try:
            made.add_node(num_cpus=2, node_ip_address="127.0.0.1", resources={"node1": 100})
            ray.init(
                address=made.address, namespace="echo-tests-driver", runtime_env={"env_vars": env}
            )
        except BaseException:
            made.shutdown()
            raise
    try:
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


def learner(node: int, *, restarts: int = 0) -> Any:
    return ray.remote(Learner).options(
        num_cpus=0, resources={f"node{node}": 1}, max_restarts=restarts, max_task_retries=0
    )


def worker(node: int) -> Any:
    return ray.remote(Worker).options(num_cpus=0, resources={f"node{node}": 1})


def get(refs: Any) -> Any:
    return ray.get(refs, timeout=WAIT_S)


def get_restarted(method: Any) -> Any:
    """`method.remote()` of an actor Ray restarted: its calls fail fast (the actor is
    unavailable) until its `__init__` returns, a moment after its server registered."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return get(method.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    return True


def no_duplicates(ids: list[int]) -> None:
    twice = [i for i, n in Counter(ids).items() if n > 1]
    assert not twice, f"{len(twice)} ids stored more than once, e.g. {twice[:5]}"


def test_registry_outlives_the_driver_that_created_it(cluster: Cluster) -> None:
    script = textwrap.dedent(
        f"""
        import ray, echo.ray
        ray.init(address={cluster.address!r})
        echo.ray.create_service("outlives", namespace={NS!r})
        ray.shutdown()
        """
    )
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        assert "outlives" in echo.ray.services(NS)
        assert echo.ray.status("outlives", namespace=NS) == []
    finally:
        echo.ray.shutdown_service("outlives", namespace=NS)
    with pytest.raises(echo.ray.UnknownServiceError, match="no echo service 'outlives'"):
        echo.ray.status("outlives", namespace=NS)


def test_two_learners_get_disjoint_ids_whose_union_is_everything_acknowledged(
    cluster: Cluster, tmp_path: Path
) -> None:
    learners = [
        learner(k).remote("disjoint", k, str(tmp_path / f"shard{k}"), "fifo") for k in (0, 1)
    ]
    get([a.info.remote() for a in learners])
    workers = [worker(w % 2).remote("disjoint") for w in range(8)]
    shards = get([w.shard.remote() for w in workers])
    assert sorted(Counter(shards).values()) == [4, 4], shards  # balanced to within one
    per_worker = 300
    states = get(
        [
            w.send.remote(list(range(i * 100_000, i * 100_000 + per_worker)))
            for i, w in enumerate(workers)
        ]
    )
    assert all(s["acked"] == per_worker for s in states)
    status = {s.shard: s for s in echo.ray.status("disjoint", namespace=NS)}
    assert sorted(status) == [0, 1]
    assert all(s.host == "127.0.0.1" and s.workers == 4 for s in status.values())
    assert get([w.close.remote() for w in workers]) == [True] * 8
    consumed = get([a.retire.remote() for a in learners])
    first, second = (set(c) for c in consumed)
    for c in consumed:
        no_duplicates(c)
    assert not first & second
    everything = {i * 100_000 + j for i in range(8) for j in range(per_worker)}
    assert first | second == everything
    # Each learner got exactly its own workers' samples.
    for i, shard in enumerate(shards):
        assert set(range(i * 100_000, i * 100_000 + per_worker)) <= (first, second)[shard]
    assert echo.ray.status("disjoint", namespace=NS) == []  # retired shards deregistered
    echo.ray.shutdown_service("disjoint", namespace=NS)


@pytest.mark.parametrize("durable", [False, True], ids=["plain", "durable"])
def test_killed_learner_restarts_restores_and_its_workers_resume(
    cluster: Cluster, tmp_path: Path, durable: bool
) -> None:
    """The shard's learner is killed and Ray restarts it, restored from its newest
    checkpoint on another port. Plain workers lose at most what was acknowledged after that
    checkpoint; durable workers (their sessions in the checkpoint) lose nothing."""
    service = f"restart-{'durable' if durable else 'plain'}"
    actor = learner(1, restarts=1).remote(service, 0, str(tmp_path / "shard0"), "replay", 0.3)
    before = get(actor.info.remote())
    assert before["generation"] == 1
    assert not before["restored"]
    workers = [worker(w % 2).remote(service, durable=durable) for w in range(4)]

    def ids(phase: int, w: int) -> list[int]:
        return list(range(phase * 1_000_000 + w * 10_000, phase * 1_000_000 + w * 10_000 + 200))

    # A: acknowledged, then a checkpoint taken after every ack.
    get([w.send.remote(ids(1, i)) for i, w in enumerate(workers)])
    # A checkpoint that may have begun before the last ack could be finishing now: the one
    # after it began after every ack.
    wanted = get(actor.checkpoints_written.remote()) + 2
    deadline = time.monotonic() + WAIT_S
    while get(actor.checkpoints_written.remote()) < wanted:
        assert time.monotonic() < deadline, "no periodic checkpoint after the acks"
        time.sleep(0.1)
    # C: acknowledged after that checkpoint (may be lost with the learner).
    get([w.send.remote(ids(2, i)) for i, w in enumerate(workers)])
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + WAIT_S
    while pid_alive(before["pid"]):  # ray.kill returns before the process is gone
        assert time.monotonic() < deadline, "the killed learner's process is still there"
        time.sleep(0.02)
    # B: sent while the learner is down and after it comes back.
    states = get([w.send.remote(ids(3, i)) for i, w in enumerate(workers)])
    after = get_restarted(actor.info)
    assert after["restored"]
    assert after["generation"] == 2
    assert after["pid"] != before["pid"]
    assert all(s["generation"] == 2 and s["reconnects"] >= 1 for s in states)
    stored = get(actor.stored_ids.remote())
    no_duplicates(stored)
    phase = {p: {i for w in range(4) for i in ids(p, w)} for p in (1, 2, 3)}
    assert phase[1] <= set(stored), "a sample acknowledged before the checkpoint was lost"
    assert phase[3] <= set(stored), "a sample sent after the restart was lost"
    assert set(stored) <= phase[1] | phase[2] | phase[3]
    if durable:
        assert phase[2] <= set(stored), "a durable worker's sample was lost"
    assert get([w.close.remote() for w in workers]) == [True] * 4
    ray.kill(actor, no_restart=True)
    echo.ray.shutdown_service(service, namespace=NS)


def test_workers_fetch_their_shards_parameters_across_a_learner_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A worker connected with `params_example` fetches what its shard's learner publishes,
    bit for bit, and the next version when there is one; the learner killed and restarted by
    Ray publishes its checkpoint's version again, which the reconnected worker fetches."""
    actor = learner(1, restarts=1).remote("params", 0, str(tmp_path / "shard0"), "replay", 0.2)
    before = get(actor.info.remote())
    assert get(actor.publish.remote(3)) == 3
    w = worker(0).remote("params", params_example=params_of(0))
    assert get(w.params.remote(3)) == (3, params_digest(params_of(3)))
    assert get(actor.publish.remote(9)) == 9
    assert get(w.params.remote(9)) == (9, params_digest(params_of(9)))
    assert get(w.params_version.remote()) == 9
    # A periodic checkpoint that began after the publish holds version 9.
    wanted = get(actor.checkpoints_written.remote()) + 2
    deadline = time.monotonic() + WAIT_S
    while get(actor.checkpoints_written.remote()) < wanted:
        assert time.monotonic() < deadline, "no periodic checkpoint after the publish"
        time.sleep(0.05)
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + WAIT_S
    while pid_alive(before["pid"]):
        assert time.monotonic() < deadline, "the killed learner's process is still there"
        time.sleep(0.02)
    assert get_restarted(actor.info)["restored"]
    get(w.send.remote([1]))  # reconnected to the restored learner
    assert get(w.params.remote(9)) == (9, params_digest(params_of(9)))
    assert get(actor.publish.remote(10)) == 10
    assert get(w.params.remote(10)) == (10, params_digest(params_of(10)))
    assert get(w.close.remote())
    ray.kill(actor, no_restart=True)
    echo.ray.shutdown_service("params", namespace=NS)


@pytest.mark.parametrize(
    ("shared_memory", "durable"),
    [(True, False), (False, False), (False, True)],
    ids=["shm", "tcp", "tcp-durable"],
)
def test_deregistered_shards_workers_move_to_another_shard_without_duplicates(
    cluster: Cluster, tmp_path: Path, shared_memory: bool, durable: bool
) -> None:
    """A shard retires (a final close) while its workers stream: they move to the other
    shard and resend only what the retired one had not acknowledged. Durable workers too:
    a learner that closed for good took what it acknowledged, persisted or not."""
    service = f"move-{'shm' if shared_memory else 'tcp'}{'-durable' if durable else ''}"
    every = 0.3 if durable else 3600.0  # durable workers' close() waits for a checkpoint
    learners = [
        learner(0).remote(service, k, str(tmp_path / f"shard{k}"), "fifo", every) for k in (0, 1)
    ]
    get([a.info.remote() for a in learners])
    workers = [
        ray.remote(Worker)
        .options(num_cpus=0, resources={"node0": 1})
        .remote(service, shared_memory=shared_memory, durable=durable)
        for _ in range(4)
    ]
    shards = get([w.shard.remote() for w in workers])
    assert sorted(shards) == [0, 0, 1, 1]
    n = 1_000

    def ids(phase: int, w: int) -> list[int]:
        return list(range(phase * 1_000_000 + w * 10_000, phase * 1_000_000 + w * 10_000 + n))

    get([w.send.remote(ids(1, i)) for i, w in enumerate(workers)])
    # The shard goes away while the workers stream (or just after, on a fast machine) ...
    streaming = [w.send.remote(ids(2, i)) for i, w in enumerate(workers)]
    retired = get(learners[0].retire.remote())
    get(streaming)
    # ... and whatever they send next goes to the shard that is left.
    states = get([w.send.remote(ids(3, i)) for i, w in enumerate(workers)])
    assert all(s["acked"] == 3 * n and s["shard"] == 1 for s in states), states
    assert sum(s["moves"] for s in states) == 2
    assert get([w.close.remote() for w in workers]) == [True] * 4
    kept = get(learners[1].retire.remote())
    no_duplicates(retired + kept)
    assert set(retired + kept) == {i for p in (1, 2, 3) for w in range(4) for i in ids(p, w)}
    echo.ray.shutdown_service(service, namespace=NS)


def test_worker_started_before_any_learner_waits_for_one(cluster: Cluster, tmp_path: Path) -> None:
    echo.ray.create_service("early", namespace=NS)
    early = worker(0).remote("early", connect_timeout=WAIT_S)
    time.sleep(0.5)  # the worker is waiting in connect()
    actor = learner(1).remote("early", 0, str(tmp_path / "shard0"), "replay")
    assert get(early.shard.remote()) == 0
    assert get(early.send.remote([1, 2, 3]))["acked"] == 3
    assert sorted(get(actor.stored_ids.remote())) == [1, 2, 3]
    get(early.close.remote())
    ray.kill(actor)
    echo.ray.shutdown_service("early", namespace=NS)


def test_worker_without_a_learner_times_out_after_connect_timeout(cluster: Cluster) -> None:
    echo.ray.create_service("nobody", namespace=NS)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no shard of echo service 'nobody' could be"):
            echo.ray.connect("nobody", EXAMPLE, namespace=NS, connect_timeout=1.0)
        assert time.monotonic() - started >= 1.0
    finally:
        echo.ray.shutdown_service("nobody", namespace=NS)


def test_unknown_service_lists_the_services_that_exist(cluster: Cluster) -> None:
    echo.ray.create_service("exists", namespace=NS)
    try:
        started = time.monotonic()
        with pytest.raises(
            echo.ray.UnknownServiceError,
            match=r"no echo service 'nope' appeared in Ray namespace 'echo-tests' within "
            r"connect_timeout=0.5s: waited \d+\.\ds for its registry \(the named actor "
            r"'echo-registry:nope'.*the services there are: .*'exists'",
        ):
            echo.ray.connect("nope", EXAMPLE, namespace=NS, connect_timeout=0.5)
        assert time.monotonic() - started >= 0.5
        with pytest.raises(LookupError):
            echo.ray.status("nope", namespace=NS)
    finally:
        echo.ray.shutdown_service("exists", namespace=NS)


def test_worker_started_before_the_service_exists_waits_for_its_registry(
    cluster: Cluster,
) -> None:
    """Actors start in any order: a worker whose service has no registry yet waits for one
    (up to `connect_timeout`) instead of raising `UnknownServiceError` at once."""
    outcome: dict[str, Any] = {}

    def worker_side() -> None:
        try:
            outcome["client"] = echo.ray.connect(
                "late", EXAMPLE, namespace=NS, connect_timeout=WAIT_S
            )
        except BaseException as e:  # noqa: BLE001 (the test reports it)
            outcome["error"] = e

    waiting = threading.Thread(target=worker_side)
    waiting.start()
    time.sleep(0.5)  # the worker looks for the registry meanwhile
    assert waiting.is_alive(), f"connect() returned before the service existed: {outcome}"
    server = echo.Server(EXAMPLE, 1, echo.TcpTransport(port=0, host="127.0.0.1"))
    server.start()
    echo.ray.serve(server, "late", 0, namespace=NS)
    try:
        waiting.join(WAIT_S)
        assert "error" not in outcome, outcome
        client = outcome["client"]
        client.send(sample_of(7))
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        assert int(sample.batch["id"][0]) == 7
        client.close()
    finally:
        server.close()
        echo.ray.shutdown_service("late", namespace=NS)


def test_a_killed_workers_lease_runs_out_and_frees_its_place(cluster: Cluster) -> None:
    """A worker SIGKILLed never releases its place; its lease, no longer renewed, runs out
    after `lease_s`, while a live client's lease is renewed for as long as it runs."""
    echo.ray.create_service("leases", namespace=NS, lease_s=1.5)
    server = echo.Server(EXAMPLE, 1, echo.TcpTransport(port=0, host="127.0.0.1"))
    server.start()
    echo.ray.serve(server, "leases", 0, namespace=NS)
    doomed = worker(0).remote("leases")
    alive = echo.ray.connect("leases", EXAMPLE, namespace=NS, connect_timeout=WAIT_S)

    def workers() -> int:
        (shard,) = echo.ray.status("leases", namespace=NS)
        return shard.workers

    try:
        assert get(doomed.shard.remote()) == 0
        assert workers() == 2
        os.kill(get(doomed.pid.remote()), signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while workers() != 1:
            assert time.monotonic() < deadline, "the killed worker's place was never freed"
            time.sleep(0.05)
        time.sleep(3.0)  # two lease times: the live client renewed meanwhile
        assert workers() == 1
    finally:
        alive.close()
        server.close()
        echo.ray.shutdown_service("leases", namespace=NS)
    assert not alive._renewals.is_alive()  # pyright: ignore[reportPrivateUsage]


def test_a_registration_that_does_not_prove_the_token_is_refused(cluster: Cluster) -> None:
    """A service bound to a token: a learner without it, one with another token, and a task
    calling the registry itself cannot register (or deregister) a shard, so workers keep
    sending to the learner's."""
    service = "guarded"
    tcp = echo.TcpTransport
    learner = echo.Server(EXAMPLE, 1, tcp(port=0, host="127.0.0.1", token=TOKEN), num_buffers=8)
    rogue = echo.Server(EXAMPLE, 1, tcp(port=0, host="127.0.0.1"), num_buffers=8)
    impostor = echo.Server(EXAMPLE, 1, tcp(port=0, host="127.0.0.1", token="another"))
    for server in (learner, rogue, impostor):
        server.start()
    try:
        echo.ray.serve(learner, service, 0, namespace=NS)
        with pytest.raises(
            PermissionError,
            match=rf"the registry of echo service 'guarded' refused shard 0 at "
            rf"127\.0\.0\.1:{rogue.port}: the service's registry requires a proof of its "
            rf"token \(its verifier begins [0-9a-f]{{12}}\), and none came",
        ):
            echo.ray.serve(rogue, service, 0, namespace=NS)
        with pytest.raises(
            PermissionError,
            match=r"the proof is of another token: the registry's verifier begins "
            r"[0-9a-f]{12}, the proof's [0-9a-f]{12}",
        ):
            echo.ray.serve(impostor, service, 0, namespace=NS)
        # A task that calls the registry's methods itself fares no better.
        registry = ray.get_actor("echo-registry:" + service, namespace=NS)
        forged = {"service": service, "shard": 0, "host": "127.0.0.1", "port": rogue.port}
        assert "requires a proof" in get(registry.register.remote(forged, None, None))
        assert "requires a proof" in get(registry.deregister.remote(0, 1, None))
        (shard,) = echo.ray.status(service, namespace=NS)
        assert (shard.port, shard.generation) == (learner.port, 1)
        client = echo.ray.connect(service, EXAMPLE, namespace=NS, token=TOKEN, connect_timeout=10)
        for i in range(5):
            client.send(sample_of(i))
        client.wait(timeout=WAIT_S)
        got = [learner.sample(timeout=WAIT_S) for _ in range(5)]
        assert [int(s.batch["id"][0]) for s in got if s is not None] == [0, 1, 2, 3, 4]
        assert rogue.stats().samples_inserted_total == 0
        client.close()
    finally:
        for server in (learner, rogue, impostor):
            server.close()
        echo.ray.shutdown_service(service, namespace=NS)


@pytest.mark.parametrize("tag", [None, "ab" * 32], ids=["unsigned", "forged"])
def test_workers_refuse_a_registration_not_signed_with_the_token(
    cluster: Cluster, tag: str | None
) -> None:
    """Any Ray task can run code inside an actor (`__ray_call__`) and so put a registration
    into a registry past its checks: workers check each registration's signature with their
    own token and send nothing to one their service's learners did not sign."""
    service = f"tampered-{'forged' if tag else 'unsigned'}"
    rogue = echo.Server(EXAMPLE, 1, echo.TcpTransport(port=0, host="127.0.0.1"), num_buffers=8)
    rogue.start()
    echo.ray.create_service(service, namespace=NS, token=TOKEN)
    try:
        registry = ray.get_actor("echo-registry:" + service, namespace=NS)
        forged = {
            "service": service,
            "shard": 0,
            "host": "127.0.0.1",
            "port": rogue.port,
            "layout": [("['id']", "int64", ()), ("['obs']", "float32", (16,))],
            "tag": tag,
            "generation": 1,
        }
        get(registry.__ray_call__.remote(plant_registration, forged))
        got = "none" if tag is None else "a tag beginning 'abababababab'"
        with pytest.raises(
            PermissionError,
            match=rf"handed out shard 0 at 127\.0\.0\.1:{rogue.port}, whose registration is "
            rf"not signed with this service's token \(expected an HMAC-SHA256 tag made with a "
            rf"key derived from the token, got {got}\): refusing to send to it",
        ):
            echo.ray.connect(service, EXAMPLE, namespace=NS, token=TOKEN, connect_timeout=10)
        stats = rogue.stats()
        assert (stats.active_connections, stats.samples_inserted_total) == (0, 0)
    finally:
        rogue.close()
        echo.ray.shutdown_service(service, namespace=NS)


def test_a_worker_whose_token_differs_from_the_services_is_refused_at_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ECHO_TOKEN", raising=False)
    echo.ray.create_service("bound", namespace=NS, token=TOKEN)
    echo.ray.create_service("open", namespace=NS)
    try:
        started = time.monotonic()
        with pytest.raises(
            PermissionError,
            match=r"echo service 'bound' is bound to the token whose verifier begins "
            r"[0-9a-f]{12}, and this worker has no token: pass token= or set ECHO_TOKEN",
        ):
            echo.ray.connect("bound", EXAMPLE, namespace=NS, connect_timeout=WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2  # refused, not waited out
        with pytest.raises(
            PermissionError,
            match=r"'bound' is bound to the token whose verifier begins [0-9a-f]{12}; this "
            r"worker has the token whose verifier begins [0-9a-f]{12}",
        ):
            echo.ray.connect("bound", EXAMPLE, namespace=NS, token="another")
        with pytest.raises(PermissionError, match="'open' was created without a token"):
            echo.ray.connect("open", EXAMPLE, namespace=NS, token=TOKEN)
        with pytest.raises(
            PermissionError,
            match=r"'open' exists already with no token; this call has the token whose "
            r"verifier begins [0-9a-f]{12}",
        ):
            echo.ray.create_service("open", namespace=NS, token=TOKEN)
    finally:
        echo.ray.shutdown_service("bound", namespace=NS)
        echo.ray.shutdown_service("open", namespace=NS)


def test_a_registry_created_by_a_learner_actor_never_holds_the_token(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The learner actor has the token in its runtime_env (as `ECHO_TOKEN` and under another
    name); the registry it creates has neither the token in its environment nor anything in
    its state that proves or signs with it, and the service works."""
    service = "clean"
    actor = (
        ray.remote(Learner)
        .options(
            num_cpus=0,
            resources={"node1": 1},
            runtime_env={"env_vars": {"ECHO_TOKEN": TOKEN, "RUN_SECRET": TOKEN}},
        )
        .remote(service, 0, str(tmp_path / "shard0"), "replay")
    )
    try:
        get(actor.info.remote())
        registry = ray.get_actor("echo-registry:" + service, namespace=NS)
        env, state = get(registry.__ray_call__.remote(registry_insides))
        assert (env["ECHO_TOKEN"], env["RUN_SECRET"]) == ("", "")
        assert not [name for name, value in env.items() if TOKEN in value]
        key = echo.ray._ServiceKey.of(TOKEN, service)  # pyright: ignore[reportPrivateUsage]
        for secret in (TOKEN.encode(), key.proof, key.signing):
            assert secret not in state
        assert get(registry.info.remote())["verifier"] == key.verifier
        client = echo.ray.connect(service, EXAMPLE, namespace=NS, token=TOKEN, connect_timeout=10)
        for i in (11, 12, 13):
            client.send(sample_of(i))
        client.wait(timeout=WAIT_S)
        client.close()
        assert sorted(get(actor.stored_ids.remote())) == [11, 12, 13]
    finally:
        ray.kill(actor)
        echo.ray.shutdown_service(service, namespace=NS)


def test_a_shard_of_another_layout_is_refused_naming_the_leaf(cluster: Cluster) -> None:
    server = echo.Server(EXAMPLE, 1, echo.TcpTransport(port=0, host="127.0.0.1"))
    server.start()
    echo.ray.serve(server, "layout", 0, namespace=NS)
    try:
        other = {"id": np.zeros((), np.int32), "obs": np.zeros(16, np.float32)}
        with pytest.raises(ValueError, match=r"leaf \"\['id'\]\": the shard stores int64 \(\), "):
            echo.ray.connect("layout", other, namespace=NS, connect_timeout=5.0)
        missing = {"obs": np.zeros(16, np.float32)}
        with pytest.raises(ValueError, match="leaves the example lacks"):
            echo.ray.connect("layout", missing, namespace=NS, connect_timeout=5.0)
    finally:
        server.close()
        echo.ray.shutdown_service("layout", namespace=NS)


def test_serve_needs_a_started_server_with_a_transport(cluster: Cluster) -> None:
    plain = echo.Server(EXAMPLE, 1)
    with pytest.raises(ValueError, match="needs a started server with a TcpTransport"):
        echo.ray.serve(plain, "unstarted", 0, namespace=NS)
    plain.close()
    started = echo.Server(EXAMPLE, 1, echo.TcpTransport(port=0, host="127.0.0.1"))
    started.start()
    try:
        with pytest.raises(ValueError, match=r"shard must be >= 0, got -1"):
            echo.ray.serve(started, "unstarted", -1, namespace=NS)
        with pytest.raises(ValueError, match="not an address workers can reach"):
            echo.ray.serve(started, "unstarted", 0, namespace=NS, host="0.0.0.0")
    finally:
        started.close()
    assert "unstarted" not in echo.ray.services(NS)


def test_status_reports_each_shards_address_workers_and_size(cluster: Cluster) -> None:
    server = echo.Server(
        EXAMPLE,
        1,
        echo.TcpTransport(port=0, host="127.0.0.1"),
        sampler=echo.Uniform(),
        max_size=1000,
    )
    server.start()
    served = echo.ray.serve(server, "watched", 3, namespace=NS, report_every=0.1)
    client = echo.ray.connect("watched", EXAMPLE, namespace=NS, connect_timeout=5.0)
    try:
        for i in range(7):
            client.send({"id": np.array(i), "obs": np.zeros(16, np.float32)})
        client.wait(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:
            (shard,) = echo.ray.status("watched", namespace=NS)
            if shard.size == 7 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (shard.shard, shard.host, shard.port) == (3, "127.0.0.1", server.port)
        assert shard.generation == served.generation == 1
        assert (shard.workers, shard.connections) == (1, 1)
        assert (shard.size, shard.inserted, shard.capacity) == (7, 7, 1000)
        assert shard.stats_age_s is not None
        assert shard.stats_age_s < WAIT_S
    finally:
        client.close()
        server.close()
    assert not served.registered
    assert echo.ray.status("watched", namespace=NS) == []
    echo.ray.shutdown_service("watched", namespace=NS)


def test_without_ray_installed_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"id-echo\[distributed\]"):
        echo.ray.connect("any", EXAMPLE)


def test_the_two_learner_example_runs_and_loses_nothing() -> None:
    """examples/ray_learners.py: 2 learner actors, 8 worker actors, shard 0's learner killed
    and restarted mid-run; the script asserts what it prints (on its own local cluster)."""
    script = TESTS.parent.parent / "examples" / "ray_learners.py"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run(
        [sys.executable, str(script), "--seconds", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "none twice; shard 0 came back restored (generation 2)" in done.stdout
    assert "workers per shard: {0: 4, 1: 4}" in done.stdout


def test_connect_takes_tcp_client_options_and_refuses_reconnect_false(cluster: Cluster) -> None:
    server = echo.Server(EXAMPLE, 1, echo.TcpTransport(port=0, host="127.0.0.1"))
    server.start()
    echo.ray.serve(server, "options", 0, namespace=NS)
    try:
        client = echo.ray.connect(
            "options",
            EXAMPLE,
            8,
            namespace=NS,
            reconnect=True,
            reconnect_timeout=5.0,
            heartbeat_timeout=None,
            shared_memory=False,
            name="w",
            connect_timeout=5.0,
        )
        assert (client.transport_path, client.shard, client.service) == ("tcp", 0, "options")
        client.close()
        with pytest.raises(ValueError, match="always reconnect"):
            echo.ray.connect("options", EXAMPLE, namespace=NS, reconnect=False)
        with pytest.raises(TypeError, match="shard must be an int"):
            echo.ray.connect("options", EXAMPLE, namespace=NS, shard="0")
    finally:
        server.close()
        echo.ray.shutdown_service("options", namespace=NS)


RAGGED = {
    "tokens": echo.Ragged(64, np.int32, group="completion"),
    "logp": echo.Ragged(64, np.float32, group="completion"),
    "id": np.zeros((), np.int64),
}


def _completion(i: int) -> dict[str, Any]:
    n = i % 65
    return {
        "tokens": np.full(n, i, np.int32),
        "logp": np.zeros(n, np.float32),
        "id": np.int64(i),
    }


def _drain_ids(server: echo.Server) -> list[int]:
    server.close(drain=True)
    ids: list[int] = []
    while (s := server.sample(timeout=WAIT_S)) is not None:
        tokens = s.batch["tokens"]
        for k, i in enumerate(int(i) for i in s.batch["id"]):
            a, b = int(tokens.cu_seqlens[k]), int(tokens.cu_seqlens[k + 1])
            assert b - a == i % 65, f"sample {i}: {b - a} rows"
            assert (tokens.values[a:b] == i).all(), f"sample {i} intact"
            ids.append(i)
    return ids


def test_ragged_workers_send_groups_to_their_shard_and_follow_it_to_a_new_learner(
    cluster: Cluster,
) -> None:
    first = echo.Server(RAGGED, 8, echo.TcpTransport(port=0, host="127.0.0.1"), num_buffers=64)
    first.start()
    echo.ray.serve(first, "ragged", 0, namespace=NS)
    second = None
    try:
        client = echo.ray.connect("ragged", RAGGED, namespace=NS, connect_timeout=WAIT_S)
        assert isinstance(client, echo.ray.RaggedShardClient)
        fixed = {**RAGGED, "tokens": np.zeros(64, np.int32)}
        with pytest.raises(ValueError, match=r"the shard stores int32 \('0\.\.64',\)"):
            echo.ray.connect("ragged", fixed, namespace=NS, connect_timeout=5.0)
        for g in range(20):  # groups of 4: one prompt's completions
            client.send_group([_completion(g * 4 + k) for k in range(4)], timeout=WAIT_S)
        client.wait(WAIT_S)
        before = _drain_ids(first)
        # The learner is gone for good; another takes shard 0 at another port. The worker's
        # next call finds it through the registry and goes on there.
        second = echo.Server(RAGGED, 8, echo.TcpTransport(port=0, host="127.0.0.1"), num_buffers=64)
        second.start()
        echo.ray.serve(second, "ragged", 0, namespace=NS)
        for g in range(20, 40):
            client.send_group([_completion(g * 4 + k) for k in range(4)], timeout=WAIT_S)
        client.wait(WAIT_S)
        assert (client.shard, client.generation) == (0, 2)
        assert client.reconnects >= 1
        client.close()
        after = _drain_ids(second)
        no_duplicates(before + after)
        assert sorted(before) == list(range(80))
        assert sorted(after) == list(range(80, 160))
    finally:
        first.close()
        if second is not None:
            second.close()
        echo.ray.shutdown_service("ragged", namespace=NS)


def test_a_ragged_shard_server_restores_its_newest_checkpoint_and_registers_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    first = echo.ray.shard_server(
        "ragged-restore", 0, RAGGED, 8, checkpoint_dir=tmp_path, checkpoint_every=0.1,
        transport=transport, namespace=NS, sampler=echo.Uniform(), max_size=1000,
    )  # fmt: skip
    second = None
    try:
        first.submit_group([_completion(i) for i in range(4)])
        for i in range(4, 24):
            first.submit(_completion(i))

        wait_for_ragged_checkpoint(tmp_path, 24, timeout=WAIT_S)
        first.close()
        second = echo.ray.shard_server(
            "ragged-restore", 0, RAGGED, 8, checkpoint_dir=tmp_path, checkpoint_every=60.0,
            transport=transport, namespace=NS,
        )  # fmt: skip
        assert second.stats().store_size == 24
        (shard,) = echo.ray.status("ragged-restore", namespace=NS)
        assert (shard.port, shard.generation) == (second.port, 2)
        s = second.sample(timeout=WAIT_S)
        assert s is not None
        assert s.num_samples >= 1
    finally:
        first.close()
        if second is not None:
            second.close()
        echo.ray.shutdown_service("ragged-restore", namespace=NS)
