"""Two learners on Ray, eight workers, and one learner killed and restarted mid-run.

    python examples/ray_learners.py                 # a local two-node Ray cluster, 20 s
    python examples/ray_learners.py --seconds 6     # shorter (what the tests run)
    python examples/ray_learners.py --address auto  # an existing Ray cluster

Each learner is a Ray actor holding one shard of the service "example": a replay table built
by `echo.ray.shard_server`, which checkpoints it every second and, when Ray restarts the actor,
restores it from the newest checkpoint and registers it again. Each learner samples its own
shard in-process (a thread standing in for the training loop, reading every batch), so the two
learners' batches are disjoint. Eight worker actors `echo.ray.connect` to the service, which
spreads them four and four; they send samples with unique ids in two phases:

1. for half the time; then, once shard 0 has a checkpoint taken after every phase-1 sample
   was acknowledged, the driver kills shard 0's learner (`ray.kill(..., no_restart=False)`);
2. for the other half, while Ray restarts it and after: shard 0's workers find the new
   address in the registry and resend what was not acknowledged.

At the end the script reads both shards back and checks what echo promises: no sample is
stored twice, every phase-1 sample (acknowledged before shard 0's last checkpoint) and every
phase-2 sample is stored. Printed: samples/s per shard (the workers pace themselves like an
environment would) and the learners' batches.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

# Ray would otherwise advertise this machine's outside address; keep the demo on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray

import echo
import echo.ray

SERVICE = "example"
NAMESPACE = "echo-example"
EXAMPLE = {"id": np.zeros((), np.int64), "obs": {"frame": np.zeros((8, 8), np.uint8)}}
ROWS = 32  # samples per send_batch: a vector env's step
STEP_S = 0.005  # what one step of those environments takes


def checkpoint_now(server: echo.Server, path: str) -> None:
    """`server.checkpoint(path)`, after the periodic one being written, if one is."""
    for _ in range(600):
        try:
            server.checkpoint(path)
            return
        except RuntimeError as e:  # one checkpoint at a time
            if "already being written" not in str(e):
                raise
            time.sleep(0.05)
    raise TimeoutError("a periodic checkpoint took more than 30 s")


class Learner:
    """One shard: a replay table, periodic checkpoints, and a thread that samples it."""

    def __init__(self, shard: int, checkpoint_dir: str) -> None:
        self.restored = bool(echo.checkpoint.periodic_checkpoints(checkpoint_dir))
        self.checkpoint_dir = checkpoint_dir
        self.server = echo.ray.shard_server(
            SERVICE,
            shard,
            EXAMPLE,
            64,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=1.0,
            transport=echo.TcpTransport(port=0, host="127.0.0.1"),
            namespace=NAMESPACE,
            sampler=echo.Uniform(),
            max_size=1_000_000,
        )
        self.batches = 0
        threading.Thread(target=self._train, daemon=True).start()

    def _train(self) -> None:
        while (batch := self.server.sample(timeout=None)) is not None:
            _ = int(batch.batch["obs"]["frame"].sum())  # read every batch, as a learner does
            self.batches += 1

    def info(self) -> dict[str, Any]:
        registration = echo.ray.registration(self.server)
        assert registration is not None
        return {
            "pid": os.getpid(),
            "generation": registration.generation,
            "restored": self.restored,
        }

    def checkpoints_written(self) -> int:
        """The number of the newest periodic checkpoint (`ckpt-<n>`), 0 before the first."""
        found = echo.checkpoint.periodic_checkpoints(self.checkpoint_dir)
        return int(found[-1].rsplit("-", 1)[1]) if found else 0

    def close(self) -> int:
        """Closes the shard for good (deregistered; the periodic checkpoints stop)."""
        self.server.close()
        return self.batches

    def stored_ids(self) -> list[int]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "now")
            checkpoint_now(self.server, path)
            parts = [np.load(os.path.join(path, "leaf_000.npy"))]
            queued = os.path.join(path, "ingress_leaf_000.npy")
            if os.path.exists(queued):
                parts.append(np.load(queued))
            return np.concatenate(parts).tolist()


class Worker:
    """A rollout worker: sends batches of samples with ids unique across the run."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.next_id = index * 10_000_000
        self.client = echo.ray.connect(
            SERVICE, EXAMPLE, namespace=NAMESPACE, reconnect_timeout=120.0, name=f"worker-{index}"
        )
        self.rng = np.random.default_rng(index)

    def shard(self) -> int | None:
        return self.client.shard

    def run(self, seconds: float) -> dict[str, Any]:
        """Sends for `seconds`, then waits until everything sent is acknowledged."""
        first = self.next_id
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ids = np.arange(self.next_id, self.next_id + ROWS, dtype=np.int64)
            frames = self.rng.integers(0, 255, (ROWS, 8, 8), dtype=np.uint8)
            self.client.send_batch({"id": ids, "obs": {"frame": frames}}, timeout=120.0)
            self.next_id += ROWS
            time.sleep(STEP_S)  # stepping the environments
        self.client.wait(timeout=120.0)
        return {
            "shard": self.client.shard,
            "ids": (first, self.next_id),
            "reconnects": self.client.reconnects,
        }

    def close(self) -> bool:
        return self.client.close()


def call_restarted(method: Any) -> Any:
    """`ray.get(method.remote())` of an actor Ray restarted: its calls fail fast (the actor is
    unavailable) until its `__init__` returns, a moment after its server registered."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return ray.get(method.remote(), timeout=120)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it asks whether the process exists
    except ProcessLookupError:
        return False
    return True


def ids_of(runs: list[dict[str, Any]]) -> set[int]:
    return {i for run in runs for i in range(*run["ids"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="sending time, both phases")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (else local)")
    args = parser.parse_args(argv)

    cluster = None
    if args.address is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "node_ip_address": "127.0.0.1",
                "resources": {"node0": 99},
            },
        )
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", resources={"node1": 99})
        ray.init(address=cluster.address)
    else:
        ray.init(address=args.address)
    try:
        with tempfile.TemporaryDirectory() as checkpoints:  # shared storage on a real cluster
            return run(args.seconds, checkpoints, local=cluster is not None)
    finally:
        echo.ray.shutdown_service(SERVICE, namespace=NAMESPACE)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def run(seconds: float, checkpoints: str, *, local: bool) -> int:
    def place(node: int) -> dict[str, Any]:
        return {"resources": {f"node{node}": 1}} if local else {}

    learner = ray.remote(Learner)
    learners = [
        learner.options(num_cpus=0, max_restarts=1, max_task_retries=0, **place(k)).remote(
            k, os.path.join(checkpoints, f"shard{k}")
        )
        for k in (0, 1)
    ]
    before = ray.get([a.info.remote() for a in learners])
    worker = ray.remote(Worker)
    workers = [worker.options(num_cpus=0, **place(w % 2)).remote(w) for w in range(8)]
    shards = ray.get([w.shard.remote() for w in workers])
    print(f"workers per shard: {dict(sorted(Counter(shards).items()))}")

    started = time.monotonic()
    phase1 = ray.get([w.run.remote(seconds / 2) for w in workers])
    acked_at = time.monotonic()
    # A checkpoint of shard 0 written after every phase-1 sample was acknowledged.
    # A checkpoint that may have begun before the last ack could be finishing now: the one
    # after it began after every phase-1 sample was acknowledged.
    wanted = ray.get(learners[0].checkpoints_written.remote()) + 2
    while ray.get(learners[0].checkpoints_written.remote()) < wanted:
        assert time.monotonic() - acked_at < 60, "shard 0 wrote no checkpoint"
        time.sleep(0.1)
    print(f"killing shard 0's learner (pid {before[0]['pid']})")
    ray.kill(learners[0], no_restart=False)
    # ray.kill returns before the process is gone, and a sample the dying learner still
    # acknowledges is lost with it (acknowledged after its last checkpoint): phase 2 starts
    # once it is gone, here while Ray restarts it.
    gone_by = time.monotonic() + 60
    while (
        process_alive(before[0]["pid"])
        if local
        else call_restarted(learners[0].info)["pid"] == before[0]["pid"]
    ):
        assert time.monotonic() < gone_by, "the killed learner is still there"
        time.sleep(0.02)
    phase2 = ray.get([w.run.remote(seconds / 2) for w in workers])
    elapsed = time.monotonic() - started

    after = call_restarted(learners[0].info)
    assert after["restored"], "the restarted learner did not restore its checkpoint"
    assert after["generation"] == 2, after
    assert after["pid"] != before[0]["pid"]
    stored = ray.get([a.stored_ids.remote() for a in learners])
    for shard, ids in enumerate(stored):
        twice = [i for i, n in Counter(ids).items() if n > 1]
        assert not twice, f"shard {shard} stored {len(twice)} samples twice"
    everything = set(stored[0]) | set(stored[1])
    assert not set(stored[0]) & set(stored[1]), "a sample reached both shards"
    missing1 = ids_of(phase1) - everything
    missing2 = ids_of(phase2) - everything
    assert not missing1, f"{len(missing1)} samples acknowledged before the checkpoint were lost"
    assert not missing2, f"{len(missing2)} samples sent after the kill were lost"

    sent = len(ids_of(phase1)) + len(ids_of(phase2))
    for shard in (0, 1):
        mine = sum(r["ids"][1] - r["ids"][0] for r in phase1 + phase2 if r["shard"] == shard)
        print(f"shard {shard}: {mine / elapsed:,.0f} samples/s from its 4 workers")
    reconnected = sum(r["reconnects"] > 0 for r in phase2 if r["shard"] == 0)
    print(
        f"{sent:,} samples sent, {len(everything):,} stored, none twice; shard 0 came back "
        f"restored (generation {after['generation']}) and its {reconnected} workers rode through"
    )
    print(f"aggregate: {sent / elapsed:,.0f} samples/s over {elapsed:.1f} s")
    assert ray.get([w.close.remote() for w in workers]) == [True] * 8
    batches = ray.get([a.close.remote() for a in learners])
    print(f"batches sampled by the learners: {batches} (shard 0 counts since its restart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
