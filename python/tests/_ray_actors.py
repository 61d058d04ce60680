"""Learner and worker actors for test_ray.py (imported by Ray's worker processes, which get
this directory on their PYTHONPATH from the test's runtime_env)."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from typing import Any

import numpy as np

import echo
import echo.ray

EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros(16, np.float32)}
SERVICE_NAMESPACE = "echo-tests"


def sample_of(i: int) -> dict[str, np.ndarray]:
    return {"id": np.array(i, np.int64), "obs": np.full(16, i % 1000, np.float32)}


def params_of(version: int) -> dict[str, np.ndarray]:
    """The parameters a learner publishes as `version`: every element depends on it."""
    rng = np.random.default_rng(version)
    return {
        "w": rng.standard_normal((256, 64), dtype=np.float32),
        "b": np.full(64, version, np.float64),
    }


def params_digest(tree: dict[str, np.ndarray]) -> str:
    return hashlib.sha256(tree["w"].tobytes() + tree["b"].tobytes()).hexdigest()


class Learner:
    """One shard's learner. `kind="replay"`: a uniform replay table the test reads back
    whole (`stored_ids`); `kind="fifo"`: a FIFO ring of batch 1 consumed by a thread that
    records every id handed out (`consumed_ids`, and everything left at `retire`)."""

    def __init__(
        self,
        service: str,
        shard: int,
        checkpoint_dir: str,
        kind: str = "replay",
        checkpoint_every: float = 3600.0,
    ) -> None:
        self.kind = kind
        self.checkpoint_dir = checkpoint_dir
        self.restored = bool(echo.checkpoint.periodic_checkpoints(checkpoint_dir))
        options: dict[str, Any] = (
            {"sampler": echo.Uniform(), "max_size": 200_000} if kind == "replay" else {}
        )
        self.server = echo.ray.shard_server(
            service,
            shard,
            EXAMPLE,
            1,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            transport=echo.TcpTransport(port=0, host="127.0.0.1"),
            namespace=SERVICE_NAMESPACE,
            report_every=0.2,
            **options,
        )
        self.consumed: list[int] = []
        self.consumer: threading.Thread | None = None
        if kind == "fifo":
            self.consumer = threading.Thread(target=self._consume, daemon=True)
            self.consumer.start()

    def _consume(self) -> None:
        while True:
            batch = self.server.sample(timeout=None)
            if batch is None:
                return
            self.consumed.extend(int(i) for i in np.asarray(batch.batch["id"]).ravel())

    def info(self) -> dict[str, Any]:
        registration = echo.ray.registration(self.server)
        assert registration is not None
        return {
            "pid": os.getpid(),
            "port": self.server.port,
            "generation": registration.generation,
            "restored": self.restored,
        }

    def checkpoints_written(self) -> int:
        """The number of the newest periodic checkpoint (`ckpt-<n>`), 0 before the first."""
        found = echo.checkpoint.periodic_checkpoints(self.checkpoint_dir)
        return int(found[-1].rsplit("-", 1)[1]) if found else 0

    def stored_ids(self) -> list[int]:
        """Every id in the replay table and its ingress queue, duplicates kept."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "now")
            for _ in range(600):  # after the periodic checkpoint being written, if one is
                try:
                    self.server.checkpoint(path)
                    break
                except RuntimeError as e:
                    if "already being written" not in str(e):
                        raise
                    time.sleep(0.05)
            ids = [np.load(os.path.join(path, "leaf_000.npy"))]
            ingress = os.path.join(path, "ingress_leaf_000.npy")
            if os.path.exists(ingress):
                ids.append(np.load(ingress))
            return [int(i) for i in np.concatenate(ids)]

    def consumed_ids(self) -> list[int]:
        return list(self.consumed)

    def publish(self, version: int) -> int:
        """Publishes `params_of(version)` to this shard's workers."""
        return self.server.publish(params_of(version), version=version)

    def retire(self) -> list[int]:
        """Deregisters and drains: every id this shard acknowledged, in the order handed out."""
        self.server.close(drain=True)
        assert self.consumer is not None
        self.consumer.join(timeout=30)
        assert not self.consumer.is_alive()
        return list(self.consumed)


class Worker:
    """A rollout worker: one `echo.ray.connect` client sending ids it is given."""

    def __init__(self, service: str, connect_timeout: float = 60.0, **options: Any) -> None:
        self.client = echo.ray.connect(
            service,
            EXAMPLE,
            namespace=SERVICE_NAMESPACE,
            connect_timeout=connect_timeout,
            reconnect_timeout=120.0,
            **options,
        )

    def shard(self) -> int | None:
        return self.client.shard

    def pid(self) -> int:
        return os.getpid()

    def send(self, ids: list[int], wait: bool = True) -> dict[str, Any]:
        for i in ids:
            self.client.send(sample_of(i), timeout=120.0)
        if wait:
            self.client.wait(timeout=120.0)
        return self.state()

    def state(self) -> dict[str, Any]:
        return {
            "shard": self.client.shard,
            "generation": self.client.generation,
            "acked": self.client.acked,
            "sent": self.client.sent,
            "moves": self.client.moves,
            "reconnects": self.client.reconnects,
            "path": self.client.transport_path,
            "at": time.monotonic(),
        }

    def params(self, min_version: int) -> tuple[int, str]:
        """The version fetched (at least `min_version`) and its arrays' digest."""
        version, tree = self.client.params(min_version=min_version, timeout=60.0)
        return version, params_digest(tree)

    def params_version(self) -> int:
        return self.client.params_version

    def close(self) -> bool:
        return self.client.close(timeout=60.0)


def plant_registration(registry: Any, record: dict[str, Any]) -> None:
    """Run inside a registry actor (`__ray_call__`, which any Ray task may use): puts
    `record` in as shard 0's registration, past every check the registry makes."""
    import heapq

    registry._shards[record["shard"]] = record
    heapq.heappush(registry._by_load, (0, record["shard"]))


def registry_insides(registry: Any) -> tuple[dict[str, str], bytes]:
    """Run inside a registry actor: its process's environment and its state, pickled (all
    but the lock and the clock, which hold nothing)."""
    import pickle

    state = {k: v for k, v in vars(registry).items() if k not in ("_lock", "_clock")}
    return dict(os.environ), pickle.dumps(state)
