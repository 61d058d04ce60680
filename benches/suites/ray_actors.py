"""The Ray actors of the ``ray`` suite (:mod:`benches.suites.ray_service`) and the samples they
move: the sample layout, its pool and rows; a shard learner (a ``Server`` behind
``echo.ray``'s service, with a consumer thread that samples it), and the senders, connectors
and streamers that play the workers. Ray imports this module in its worker processes (the
repository root is on their ``PYTHONPATH``). Every loop is bounded in count and time.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benches import common as c

# --------------------------------------------------------------------------- samples

NAMESPACE = "echo-bench"
CALL_S = 120.0  # the longest any one Ray call of this suite may take
MAX_LOOPS = 100_000_000


def example() -> dict[str, Any]:
    """The nested sample: 6 leaves, 1,880 bytes."""
    return {
        "obs": {"pixels": np.zeros((24, 24, 3), np.uint8), "state": np.zeros(32, np.float32)},
        "action": np.zeros((), np.int64),
        "reward": np.zeros((), np.float32),
        "discount": np.zeros((), np.float32),
        "id": np.zeros((), np.int64),
    }


def sample_bytes() -> int:
    return 24 * 24 * 3 + 32 * 4 + 8 + 4 + 4 + 8


def pool(rows: int, seed: int) -> dict[str, Any]:
    """``rows`` distinct rows of the sample (a pytree with a leading dimension), seeded."""
    rng = np.random.default_rng(seed)
    return {
        "obs": {
            "pixels": rng.integers(0, 256, (rows, 24, 24, 3), dtype=np.uint8),
            "state": rng.standard_normal((rows, 32), dtype=np.float32),
        },
        "action": rng.integers(0, 18, rows, dtype=np.int64),
        "reward": rng.standard_normal(rows, dtype=np.float32),
        "discount": np.full(rows, 0.99, np.float32),
        "id": np.zeros(rows, np.int64),
    }


def rows_of(batch: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {
        "obs": {"pixels": batch["obs"]["pixels"][lo:hi], "state": batch["obs"]["state"][lo:hi]},
        "action": batch["action"][lo:hi],
        "reward": batch["reward"][lo:hi],
        "discount": batch["discount"][lo:hi],
        "id": batch["id"][lo:hi],
    }


def row(batch: dict[str, Any], i: int) -> dict[str, Any]:
    return {
        "obs": {"pixels": batch["obs"]["pixels"][i], "state": batch["obs"]["state"][i]},
        "action": batch["action"][i],
        "reward": batch["reward"][i],
        "discount": batch["discount"][i],
        "id": batch["id"][i],
    }


def _rss_mib() -> float:
    return c.rss_mib()


# --------------------------------------------------------------------------- actors


class Consumer:
    """A thread sampling every batch of a FIFO server, counting samples and summing ids."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.count = 0
        self.id_sum = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for _ in range(MAX_LOOPS):
            if self.stop.is_set():
                return
            try:
                batch = self.server.sample(timeout=0.2)
            except TimeoutError:
                continue
            if batch is None:
                return
            ids = np.asarray(batch.batch["id"])
            self.id_sum += int(ids.sum())
            self.count += int(ids.size)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10.0)


class ShardLearner:
    """One shard's learner: ``shard_server`` (a FIFO, restored from its newest periodic
    checkpoint when there is one) and a consumer thread reading every batch."""

    def __init__(
        self,
        service: str,
        shard: int,
        checkpoint_dir: str,
        batch_size: int,
        checkpoint_every: float,
    ) -> None:
        import echo
        import echo.ray

        self.checkpoint_dir = checkpoint_dir
        self.restored = bool(echo.checkpoint.periodic_checkpoints(checkpoint_dir))
        self.server = echo.ray.shard_server(
            service,
            shard,
            example(),
            batch_size,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            transport=echo.TcpTransport(port=0, host=c.HOST),
            namespace=NAMESPACE,
            report_every=0.5,
        )
        self.registered_unix_s = time.time()
        registration = echo.ray.registration(self.server)
        self.generation = None if registration is None else registration.generation
        self.consumer = Consumer(self.server)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "port": self.server.port,
            "generation": self.generation,
            "restored": self.restored,
            "registered_unix_s": self.registered_unix_s,
        }

    def counters(self) -> dict[str, Any]:
        return {
            "count": self.consumer.count,
            "id_sum": self.consumer.id_sum,
            "cpu_s": time.process_time(),
            "rss_mib": _rss_mib(),
            "connections": self.server.stats().active_connections,
            "unix_s": time.time(),
        }

    def wait_count(self, count: int, timeout: float) -> dict[str, Any]:
        """The counters once ``count`` samples were consumed, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        for _ in range(MAX_LOOPS):
            if self.consumer.count >= count or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        return self.counters()

    def idle_cpu(self, seconds: float) -> dict[str, Any]:
        """This process's CPU over ``seconds`` of doing nothing here (heartbeats, reports)."""
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return {
            "cpu_s": time.process_time() - cpu0,
            "wall_s": time.monotonic() - wall0,
            "rss_mib": _rss_mib(),
            "connections": self.server.stats().active_connections,
        }

    def checkpoints(self) -> int:
        import echo

        return len(echo.checkpoint.periodic_checkpoints(self.checkpoint_dir))

    def close(self) -> dict[str, Any]:
        out = self.counters()
        self.server.close()
        self.consumer.end()
        return out


class Sender:
    """A worker: one ``echo.ray.connect`` client sending batches of numbered pool rows."""

    def __init__(
        self, service: str, batch_size: int, inflight: int, seed: int, shared_memory: bool
    ) -> None:
        import echo.ray

        self.batch_size = batch_size
        self.pool = pool(8 * batch_size, seed)
        self.client = echo.ray.connect(
            service,
            example(),
            inflight,
            namespace=NAMESPACE,
            shared_memory=shared_memory,
            connect_timeout=60.0,
            reconnect_timeout=60.0,
        )

    def shard(self) -> int | None:
        return self.client.shard

    def run(self, start_unix: float, seconds: float, id_base: int) -> dict[str, Any]:
        """Sends from ``start_unix`` for ``seconds`` (whole batches), then waits for every
        acknowledgement."""
        bs = self.batch_size
        slices = [rows_of(self.pool, k * bs, (k + 1) * bs) for k in range(8)]
        time.sleep(max(0.0, min(30.0, start_unix - time.time())))
        cpu0, t0 = time.process_time(), time.time()
        end = t0 + seconds
        n = id_sum = 0
        for k in range(MAX_LOOPS):
            batch = slices[k % 8]
            ids = np.arange(id_base + n, id_base + n + bs, dtype=np.int64)
            batch["id"][:] = ids
            self.client.send_batch(batch, timeout=60.0)
            n += bs
            id_sum += int(ids.sum())
            if time.time() >= end:
                break
        self.client.wait(timeout=60.0)
        t1 = time.time()
        return {
            "shard": self.client.shard,
            "path": self.client.transport_path,
            "sent": n,
            "acked": self.client.acked,
            "id_sum": id_sum,
            "start_unix_s": t0,
            "done_unix_s": t1,
            "cpu_s": time.process_time() - cpu0,
        }

    def close(self) -> bool:
        return self.client.close(timeout=30.0)


class Connector:
    """Opens many ``ShardClient``s at once (discovery plus connect), then holds them."""

    def __init__(self) -> None:
        self.clients: list[Any] = []
        self.pool = pool(64, 5)

    def ready(self) -> int:
        import echo.ray  # noqa: F401 (imported before the clock starts)

        return os.getpid()

    def connect_many(
        self, service: str, n: int, threads: int, shared_memory: bool
    ) -> dict[str, Any]:
        import echo.ray

        def one(_: int) -> tuple[Any, float]:
            t = time.perf_counter()
            client = echo.ray.connect(
                service,
                example(),
                namespace=NAMESPACE,
                shared_memory=shared_memory,
                connect_timeout=60.0,
            )
            return client, time.perf_counter() - t

        started = time.time()
        with ThreadPoolExecutor(max_workers=threads) as ex:
            made = list(ex.map(one, range(n), timeout=CALL_S))
        done = time.time()
        self.clients += [client for client, _ in made]
        return {
            "started_unix_s": started,
            "done_unix_s": done,
            "connect_s": [dt for _, dt in made],
            "shards": sorted({client.shard for client, _ in made}),
        }

    def send_one_each(self) -> int:
        """Each client sends one sample and has it acknowledged: all of them are live."""
        one = row(pool(1, 0), 0)
        for client in self.clients:
            client.send(one, timeout=30.0)
        for client in self.clients:
            client.wait(timeout=30.0)
        return sum(client.acked for client in self.clients)

    def send_rounds(self, rounds: int) -> dict[str, Any]:
        """``rounds`` times one sample from each client in turn (many connections, each
        carrying a little), then every acknowledgement."""
        rows = [row(self.pool, i) for i in range(64)]
        cpu0, t0 = time.process_time(), time.time()
        for k in range(rounds):
            for client in self.clients:
                client.send(rows[k % 64], timeout=60.0)
        for client in self.clients:
            client.wait(timeout=60.0)
        return {
            "sent": rounds * len(self.clients),
            "cpu_s": time.process_time() - cpu0,
            "start_unix_s": t0,
            "done_unix_s": time.time(),
        }

    def close_all(self) -> int:
        closed = sum(bool(client.close(timeout=10.0)) for client in self.clients)
        self.clients = []
        return closed


class Streamer:
    """A worker streaming single samples in a thread while another thread watches its
    client: when the shard's generation changes, and the first acknowledgement after that."""

    def __init__(self, service: str, inflight: int, shared_memory: bool) -> None:
        import echo.ray

        self.pool = pool(64, 7)
        self.client = echo.ray.connect(
            service,
            example(),
            inflight,
            namespace=NAMESPACE,
            shared_memory=shared_memory,
            connect_timeout=60.0,
            reconnect_timeout=120.0,
        )
        self.stop = threading.Event()
        self.error: str | None = None
        self.first_ack: dict[int, float] = {}  # generation -> unix time of its first ack
        self.seen_generation: dict[int, float] = {}
        self.threads: list[threading.Thread] = []

    def start(self, max_seconds: float) -> None:
        deadline = time.monotonic() + max_seconds

        def send() -> None:
            try:
                for k in range(MAX_LOOPS):
                    if self.stop.is_set() or time.monotonic() >= deadline:
                        return
                    self.client.send(row(self.pool, k % 64), timeout=max_seconds)
            except Exception as e:  # noqa: BLE001 (reported by state())
                self.error = f"{type(e).__name__}: {e}"

        def watch() -> None:
            generation, acked = self.client.generation, self.client.acked
            for _ in range(MAX_LOOPS):
                if self.stop.is_set() or time.monotonic() >= deadline:
                    return
                now_gen, now_acked = self.client.generation, self.client.acked
                if now_gen != generation:
                    generation, acked = now_gen, now_acked
                    if generation is not None:
                        self.seen_generation.setdefault(generation, time.time())
                elif now_acked > acked and generation is not None:
                    self.first_ack.setdefault(generation, time.time())
                    acked = now_acked
                time.sleep(0.001)

        self.threads = [
            threading.Thread(target=send, daemon=True),
            threading.Thread(target=watch, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def state(self) -> dict[str, Any]:
        return {
            "generation": self.client.generation,
            "acked": self.client.acked,
            "reconnects": self.client.reconnects,
            "first_ack": {str(k): v for k, v in self.first_ack.items()},
            "seen_generation": {str(k): v for k, v in self.seen_generation.items()},
            "error": self.error,
        }

    def close(self) -> dict[str, Any]:
        self.stop.set()
        for t in self.threads:
            t.join(30.0)
        state = self.state()
        state["flushed"] = self.client.close(timeout=30.0)
        return state
