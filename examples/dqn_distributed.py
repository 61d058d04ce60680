"""echo example: distributed DQN on CartPole-v1, with a learner restart the workers ride through.

The learner (the main process) keeps a prioritized replay table
(`Server(..., sampler=Prioritized(0.6), max_size=100_000, rate_limiter=SampleToInsertRatio(...))`
on 127.0.0.1) and trains a small Q-network written in plain numpy (a two-hidden-layer MLP,
manual backprop, Adam, double DQN, a target network, importance weights), setting each
sampled item's priority from its TD error with `update_priorities`. `--workers` worker
processes each step a gymnasium vector env of `--envs` CartPole-v1 envs with an
epsilon-greedy policy and send every step's transitions with
`TcpClient(reconnect=True, name="worker-<i>").send_batch(..., priority=...)`, the priorities
being their own TD errors. The policy goes back to the workers over the same connection
(echo's parameter channel): the learner calls `server.publish(params, version=step + 1)`
every `--publish-every` steps, and each worker, every `--poll-every` vector-env steps, looks
at `client.params_version` (no transfer) and fetches the parameters with `client.params()`
only when the learner announced a newer version (see the docs' "Sending the policy back to
workers").

Midway the learner writes a checkpoint with its own state in it
(`server.checkpoint(path, extra={"params": ..., "step": ...})`), closes saying it comes back
(`close(restarting=True)`), and a new learner is started from the checkpoint with
`Server.restore(path, transport=TcpTransport(port=<the same port>))`, taking its parameters,
optimizer state and step back from `restored_extra`; the checkpoint also holds the last
published parameters, which the restored learner publishes again with their version. The
workers keep going: they block while no learner listens, reconnect, and resend what the old
learner had not acknowledged.

Every transition carries a unique id, (worker index, counter). At the end the example reads
the restored learner's table back (a last checkpoint, `np.load` of its id leaf and of the
ingress's) and asserts that nothing was lost and nothing stored twice: every transition a
worker had seen acknowledged before the checkpoint, and every one it sent that the old
learner did not acknowledge, is in the table exactly once; the ones the old learner
acknowledged after the checkpoint (lost with it, as the checkpoint guide says) and the ones a
worker gave up at shutdown are there at most once. It prints the throughput and the greedy
policy's return (learning is not asserted).

    python examples/dqn_distributed.py                  # 4 workers x 4 envs, at most ~30 s
    python examples/dqn_distributed.py --ci             # the small run CI makes
    python examples/dqn_distributed.py --workers 8 --transitions 12000 --seconds 60

Needs gymnasium (`pip install gymnasium`; the `test` extra has it).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import echo
from echo import Prioritized, SampleToInsertRatio, Server, TcpClient, TcpTransport

Params = dict[str, np.ndarray]

OBS_DIM, NUM_ACTIONS = 4, 2  # CartPole-v1
MAX_SIZE = 100_000
GAMMA = 0.99

# One transition. `id` = (worker index, transition counter) is unique per transition: the
# check at the end counts each one.
EXAMPLE = {
    "obs": np.zeros(OBS_DIM, np.float32),
    "action": np.zeros((), np.int64),
    "reward": np.zeros((), np.float32),
    "next_obs": np.zeros(OBS_DIM, np.float32),
    "terminated": np.zeros((), np.float32),  # 1.0: no bootstrap (a time limit is not an end)
    "id": np.zeros(2, np.int64),
}


# ---------------------------------------------------------------------------------------------
# The Q-network: an MLP in numpy, forward and backward by hand.
# ---------------------------------------------------------------------------------------------


def init_params(rng: np.random.Generator, hidden: int) -> Params:
    def dense(n_in: int, n_out: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
        w = rng.normal(0.0, scale * np.sqrt(2.0 / n_in), (n_in, n_out)).astype(np.float32)
        return w, np.zeros(n_out, np.float32)

    w1, b1 = dense(OBS_DIM, hidden, 1.0)
    w2, b2 = dense(hidden, hidden, 1.0)
    w3, b3 = dense(hidden, NUM_ACTIONS, 0.1)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3}


def q_values(p: Params, obs: np.ndarray) -> np.ndarray:
    h1 = np.maximum(obs @ p["w1"] + p["b1"], 0.0)
    h2 = np.maximum(h1 @ p["w2"] + p["b2"], 0.0)
    return h2 @ p["w3"] + p["b3"]


class DQN:
    """Double DQN with a Huber loss, importance weights, Adam and a periodic target copy."""

    def __init__(self, params: Params, *, lr: float, target_every: int) -> None:
        self.params = params
        self.target = {k: v.copy() for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.step = 0
        self.lr, self.target_every = lr, target_every

    def state(self) -> dict[str, Any]:
        """What a checkpoint's `extra` holds: enough to go on exactly where this one is."""
        return {
            "params": self.params,
            "target": self.target,
            "adam": {"m": self.m, "v": self.v},
            "step": self.step,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], *, lr: float, target_every: int) -> DQN:
        dqn = cls(state["params"], lr=lr, target_every=target_every)
        dqn.target, dqn.m, dqn.v = state["target"], state["adam"]["m"], state["adam"]["v"]
        dqn.step = int(state["step"])
        return dqn

    def train(self, batch: dict[str, np.ndarray], weights: np.ndarray) -> np.ndarray:
        """One gradient step on `batch`; returns its TD errors (for the new priorities)."""
        p = self.params
        obs, action = batch["obs"], batch["action"]
        n = len(action)
        rows = np.arange(n)
        # Double DQN target: the online network picks the next action, the target rates it.
        next_action = q_values(p, batch["next_obs"]).argmax(axis=1)
        next_q = q_values(self.target, batch["next_obs"])[rows, next_action]
        target = batch["reward"] + GAMMA * (1.0 - batch["terminated"]) * next_q
        # Forward, keeping the activations for the backward pass.
        h1 = np.maximum(obs @ p["w1"] + p["b1"], 0.0)
        h2 = np.maximum(h1 @ p["w2"] + p["b2"], 0.0)
        q = h2 @ p["w3"] + p["b3"]
        td = q[rows, action] - target
        # Huber loss (delta 1), importance-weighted mean: d loss / d q(s, a).
        dq = np.zeros_like(q)
        dq[rows, action] = weights * np.clip(td, -1.0, 1.0) / n
        dh2 = (dq @ p["w3"].T) * (h2 > 0)
        dh1 = (dh2 @ p["w2"].T) * (h1 > 0)
        grads = {
            "w3": h2.T @ dq,
            "b3": dq.sum(0),
            "w2": h1.T @ dh2,
            "b2": dh2.sum(0),
            "w1": obs.T @ dh1,
            "b1": dh1.sum(0),
        }
        self.step += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for k, g in grads.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            m_hat = self.m[k] / (1 - b1**self.step)
            v_hat = self.v[k] / (1 - b2**self.step)
            # A new array each step (publish() copies, so writing in place would do too).
            p[k] = (p[k] - self.lr * m_hat / (np.sqrt(v_hat) + eps)).astype(np.float32)
        if self.step % self.target_every == 0:
            self.target = {k: v.copy() for k, v in p.items()}
        return td


# ---------------------------------------------------------------------------------------------
# Parameters back to the workers: echo's parameter channel.
# ---------------------------------------------------------------------------------------------


class Policy:
    """A worker's copy of the learner's parameters. `poll()` reads `client.params_version`
    (what the learner announced: no transfer) and fetches only when it grew."""

    def __init__(self, client: TcpClient) -> None:
        self.client = client
        # The learner published version 1 before starting us; wait for it all the same.
        self.version, self.params = client.params(min_version=1, timeout=60.0)
        self.announced = self.version
        self.fetches = 1

    def poll(self) -> bool:
        announced = self.client.params_version
        if announced <= self.announced:
            return False
        self.announced = announced
        # The latest version, whichever it is by now (a restored learner may serve an older
        # one than the old learner announced: its checkpoint's; keep only newer ones).
        version, params = self.client.params(timeout=60.0)
        self.fetches += 1
        if version <= self.version:
            return False
        self.version, self.params = version, params
        return True


# ---------------------------------------------------------------------------------------------
# A worker process
# ---------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import gymnasium as gym  # only the workers and the final evaluation need it

    faulthandler.register(signal.SIGUSR1)  # the learner asks for our stacks if we hang
    # The "echo" logger tree: the client's reconnect warnings name this worker.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    index = args.worker
    run_dir = args.run_dir
    deadline = time.monotonic() + args.seconds + 60  # even if the learner never says stop
    # Ape-X's exploration: each worker has its own epsilon, from 0.4 down to 0.4**8.
    epsilon = 0.4 ** (1 + 7 * index / max(1, args.workers - 1))
    rng = np.random.default_rng(args.seed + 1000 + index)
    envs = gym.make_vec(
        "CartPole-v1",
        num_envs=args.envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    obs, _ = envs.reset(seed=args.seed + 100 * index)
    client = TcpClient(
        "127.0.0.1",
        args.port,
        EXAMPLE,
        max_inflight_msgs=64,
        reconnect=True,
        reconnect_timeout=60.0,
        name=f"worker-{index}",
        # A pytree like the learner's parameters: `client.params()` returns that structure.
        params_example=init_params(np.random.default_rng(0), args.hidden),
    )
    policy = Policy(client)
    stop_file = os.path.join(run_dir, "stop")
    # (monotonic time before, reconnects, acked, monotonic time after), after every send: the
    # learner compares them with the moments of its checkpoint and restart.
    records: list[tuple[float, int, int, float]] = []

    def record() -> None:
        before = time.monotonic()
        reconnects, acked = client.reconnects, client.acked
        records.append((before, reconnects, acked, time.monotonic()))

    counter, episodes, returns = 0, 0, np.zeros(args.envs)
    finished: list[float] = []
    stopped = False
    ids = np.empty((args.envs, 2), np.int64)
    ids[:, 0] = index
    for step in range(args.transitions // args.envs):
        if step % args.poll_every == 0:
            policy.poll()
            if os.path.exists(stop_file) or time.monotonic() > deadline:
                stopped = True
                break
        q = q_values(policy.params, obs)
        action = q.argmax(axis=1)
        explore = rng.random(args.envs) < epsilon
        action[explore] = rng.integers(NUM_ACTIONS, size=int(explore.sum()))
        next_obs, reward, terminated, truncated, info = envs.step(action)
        done = terminated | truncated
        real_next = next_obs.copy()  # SAME_STEP autoreset: next_obs is already the reset one
        for j in np.flatnonzero(done):
            real_next[j] = info["final_obs"][j]
        # The workers' priorities: |TD error| under the parameters they act with.
        bootstrap = q_values(policy.params, real_next).max(axis=1)
        td = reward + GAMMA * (1.0 - terminated) * bootstrap - q[np.arange(args.envs), action]
        ids[:, 1] = counter + np.arange(args.envs)
        batch = {
            "obs": obs.astype(np.float32),
            "action": action.astype(np.int64),
            "reward": reward.astype(np.float32),
            "next_obs": real_next.astype(np.float32),
            "terminated": terminated.astype(np.float32),
            "id": ids,
        }
        client.send_batch(batch, priority=np.abs(td) + 1e-3)
        counter += args.envs
        record()
        returns += reward
        finished += returns[done].tolist()
        episodes += int(done.sum())
        returns[done] = 0.0
        obs = next_obs
    # Told to stop: give up what is not acknowledged yet (the learner may be holding it back)
    # instead of waiting; done: wait until the learner has acknowledged everything.
    flushed = client.close(timeout=0 if stopped else 60)
    record()
    report = {
        "worker": index,
        "sent": client.sent,
        "acked": client.acked,
        "given_up": client.given_up,
        "flushed": flushed,
        "stopped": stopped,
        "reconnects": client.reconnects,
        "resent": client.resent,
        "transport_path": client.transport_path,
        "params_fetches": policy.fetches,
        "params_version": policy.version,
        "episodes": episodes,
        "mean_return_last_20": float(np.mean(finished[-20:])) if finished else 0.0,
    }
    np.save(os.path.join(run_dir, f"worker-{index}.npy"), np.array(records, np.float64))
    with open(os.path.join(run_dir, f"worker-{index}.json"), "w") as f:
        json.dump(report, f)
    envs.close()


# ---------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------


@dataclass
class Moments:
    """When the learner did what, on the clock the workers' records use (`time.monotonic`,
    which is CLOCK_MONOTONIC on Linux: the same in every process)."""

    checkpoint_started: float = 0.0
    close_started: float = 0.0
    restarted: float = 0.0


def make_server(args: argparse.Namespace) -> Server:
    spi = args.samples_per_insert
    return Server(
        EXAMPLE,
        batch_size=args.batch_size,
        transport=TcpTransport(port=0, host="127.0.0.1"),
        sampler=Prioritized(0.6),
        max_size=MAX_SIZE,
        # Each transition is sampled `spi` times on average; the window lets inserts run
        # ahead of sampling by 8 batches' worth before the workers are held back.
        rate_limiter=SampleToInsertRatio(
            samples_per_insert=spi,
            min_size_to_sample=args.min_size,
            error_buffer=8.0 * args.batch_size * max(1.0, spi),
        ),
        seed=args.seed,
    )


class Training:
    """The learner's loop: sample, train, set priorities, publish parameters now and then."""

    def __init__(self, args: argparse.Namespace, dqn: DQN) -> None:
        self.args, self.dqn = args, dqn
        self.items_sampled = 0
        self.published = 0
        self._last_report = time.monotonic()

    def run(self, server: Server, until: Callable[[], bool]) -> None:
        beta = 0.4  # importance-sampling exponent
        while not until():
            try:
                sample = server.sample(timeout=0.1)  # the limiter may hold it back
            except TimeoutError:
                continue
            if sample is None:
                raise RuntimeError("the server closed under the learner")
            assert sample.probabilities is not None
            assert sample.keys is not None
            size = max(1, server.stats().store_size)
            weights = (size * sample.probabilities) ** -beta
            td = self.dqn.train(sample.batch, (weights / weights.max()).astype(np.float32))
            server.update_priorities(sample.keys, np.abs(td) + 1e-3)
            self.items_sampled += len(td)
            if self.dqn.step % self.args.publish_every == 0:
                # Copies the arrays and returns: the workers pull it from the server.
                server.publish(self.dqn.params, version=self.dqn.step + 1)
                self.published += 1
            now = time.monotonic()
            if now - self._last_report > 5.0:
                self._last_report = now
                print(f"  step {self.dqn.step:6d}  table {server.stats().store_size:6d}")


def read_ids(path: str) -> np.ndarray:
    """The `id` leaf of every transition in the checkpoint at `path`: the table's items and
    the acknowledged ones still queued in the ingress (see echo/checkpoint.py's layout)."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    leaves = manifest["layout"]["leaves"]
    index = [leaf["path"] for leaf in leaves].index(["id"])  # its place in the flattened tree
    parts = [np.load(os.path.join(path, leaves[index]["file"]))]
    ingress = manifest.get("ingress")
    if ingress is not None:
        parts.append(np.load(os.path.join(path, ingress["files"][index])))
    return np.concatenate(parts).reshape(-1, 2)


def check_nothing_lost(
    ids: np.ndarray, reports: list[dict[str, Any]], run_dir: str, moments: Moments
) -> dict[str, int]:
    """Asserts each id is in `ids` at most once, and the ones that must survive exactly once.

    For worker `w` with counters `0 .. sent`:
    - `low`: what it had seen acknowledged before the checkpoint started (a record read
      entirely before then): the checkpoint holds those, in the table or in the ingress.
    - `high`: what it had seen acknowledged once it had reconnected after the old learner
      began to close: everything the old learner ever acknowledged is below it, so every
      counter from `high` on reached the new learner (resent or sent after the restart).
    - `acked`: what it had acknowledged at the end; `[acked, sent)` it gave up at shutdown.
    Counters in `[0, low)` and `[high, acked)` must be there exactly once; the rest (what
    the old learner acknowledged after the checkpoint, and what was given up) at most once.
    """
    assert ids.shape[1] == 2
    workers = len(reports)
    assert ((ids[:, 0] >= 0) & (ids[:, 0] < workers)).all(), "an id names no worker"
    flat = ids[:, 0] * (1 << 32) + ids[:, 1]
    unique, counts = np.unique(flat, return_counts=True)
    twice = unique[counts > 1]
    assert twice.size == 0, f"{twice.size} stored twice, e.g. {divmod(twice[0], 1 << 32)}"
    required = window = window_kept = before_checkpoint = after_restart = 0
    for report in reports:
        w = report["worker"]
        records = np.load(os.path.join(run_dir, f"worker-{w}.npy"))
        before, reconnects, acked, after = records.T
        mine = np.sort(ids[ids[:, 0] == w, 1])
        assert mine.size == 0 or (mine[0] >= 0 and mine[-1] < report["sent"]), "unknown counter"
        early = after <= moments.checkpoint_started
        low = int(acked[early].max()) if early.any() else 0
        settled = after <= moments.close_started
        if settled.any():  # it was connected to the old learner
            later = (before >= moments.close_started) & (reconnects > reconnects[settled].max())
            # No reconnect after that: it finished (flushed) before the old learner closed.
            high = int(acked[later][0]) if later.any() else report["acked"]
        else:  # no send had returned yet: connected to the old learner only if it reconnected
            later = reconnects > 0
            high = int(acked[later][0]) if later.any() else 0
        high = max(high, low)
        must = np.concatenate([np.arange(low), np.arange(high, report["acked"])])
        present = np.isin(must, mine)
        missing = must[~present]
        assert missing.size == 0, (
            f"worker {w}: {missing.size} transitions lost, e.g. counter {missing[0]} "
            f"(acknowledged before the checkpoint: {low}; from the restart on: {high}.."
            f"{report['acked']})"
        )
        required += must.size
        before_checkpoint += low
        after_restart += report["acked"] - high
        window += high - low
        window_kept += int(np.isin(np.arange(low, high), mine).sum())
    # Otherwise the run did not test the restart (too short: raise --seconds).
    assert before_checkpoint > 0, "no transition was acknowledged before the checkpoint"
    assert after_restart > 0, "no transition reached the restored learner"
    return {"required": required, "window": window, "window_kept": window_kept}


def greedy_return(params: Params, episodes: int, seed: int) -> float:
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    total = 0.0
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        done = False
        while not done:  # CartPole-v1 truncates at 500 steps
            action = int(q_values(params, obs[None].astype(np.float32))[0].argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    env.close()
    return total / episodes


def learner(args: argparse.Namespace) -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="echo-dqn-")
    os.makedirs(run_dir, exist_ok=True)
    total = args.workers * (args.transitions // args.envs) * args.envs
    started = time.monotonic()
    moments = Moments()
    server = make_server(args)
    server.start()
    port = server.port
    assert port is not None
    params = init_params(np.random.default_rng(args.seed), args.hidden)
    dqn = DQN(params, lr=args.lr, target_every=args.target_every)
    # Version `step + 1`: version 1 is the initial parameters (step 0), before any worker asks.
    server.publish(dqn.params, version=dqn.step + 1)
    training = Training(args, dqn)
    print(
        f"learner on 127.0.0.1:{port}: {args.workers} workers x {args.envs} CartPole-v1 envs, "
        f"up to {total:,} transitions in {args.seconds:g} s; run dir {run_dir}"
    )
    worker_args = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in WORKER_FLAGS]
    worker_args += [f"--port={port}", f"--run-dir={run_dir}"]
    workers = [
        subprocess.Popen([sys.executable, __file__, f"--worker={w}", *worker_args])
        for w in range(args.workers)
    ]

    def workers_done() -> bool:
        return all(proc.poll() is not None for proc in workers)

    def time_up(fraction: float) -> bool:
        return time.monotonic() - started >= fraction * args.seconds

    checkpoint = os.path.join(run_dir, "learner.ckpt")
    try:
        # Phase 1: until about half the transitions are in, or (every worker connected) 40%
        # of the time is gone. Half is enough without the others: on a loaded machine a
        # worker may start only once another has sent all of its transitions, and it then
        # sends to the restored learner (waiting for all of them at once could wait past the
        # end of the run, leaving the restart nothing to test).
        def checkpoint_now() -> bool:
            info = server.stats()
            connected = info.active_connections >= args.workers
            half = info.store_size >= total // 2
            return half or (connected and time_up(0.4)) or time_up(0.8) or workers_done()

        training.run(server, checkpoint_now)
        # The checkpoint: the replay table and the learner's state, atomically together.
        step = dqn.step
        moments.checkpoint_started = time.monotonic()
        server.checkpoint(checkpoint, extra=dqn.state())
        old, old_version = server.stats(), server.params_version
        moments.close_started = time.monotonic()
        # The learner goes away, telling its workers it comes back: they keep trying (a plain
        # close() is for good, and stops them), and their sends block meanwhile.
        server.close(restarting=True)
        print(
            f"checkpoint at step {step} ({old.store_size:,} items; "
            f"{server.stats().last_checkpoint_duration_s * 1e3:.0f} ms), learner closed"
        )
        time.sleep(args.restart_gap)  # a new learner process would start about now
        server = Server.restore(checkpoint, transport=TcpTransport(port=port, host="127.0.0.1"))
        server.start()
        moments.restarted = time.monotonic()
        state = server.restored_extra
        assert state["step"] == step, state["step"]
        dqn = DQN.from_state(state, lr=args.lr, target_every=args.target_every)
        training.dqn = dqn
        size = server.stats().store_size
        # The checkpoint held the last published parameters: published again, same version.
        assert server.params_version == old_version, (server.params_version, old_version)
        print(
            f"restored on the same port at step {dqn.step} with {size:,} items, parameters "
            f"version {old_version} published again"
        )
        # Phase 2: until the workers are done or the time is up; then tell them to stop and
        # keep sampling while they do (they may wait for the limiter to take their last ones).
        training.run(server, lambda: workers_done() or time_up(1.0))
        with open(os.path.join(run_dir, "stop"), "w"):
            pass
        grace = time.monotonic() + 60
        training.run(server, lambda: workers_done() or time.monotonic() > grace)
        stuck = [w for w, proc in enumerate(workers) if proc.poll() is None]
        if stuck:  # their stacks (faulthandler), then what the learner sees, then a failure
            for w in stuck:
                workers[w].send_signal(signal.SIGUSR1)
            time.sleep(1)
            raise AssertionError(f"workers {stuck} did not stop; the learner: {server.stats()}")
        codes = [proc.wait() for proc in workers]
        assert codes == [0] * args.workers, f"worker exit codes: {codes}"
    finally:
        for proc in workers:  # only ours, by their Popen handles
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    elapsed = time.monotonic() - started
    reports = []
    for w in range(args.workers):
        with open(os.path.join(run_dir, f"worker-{w}.json")) as f:
            reports.append(json.load(f))
    final = server.stats()
    assert old.evicted_total == 0, "max_size was reached"
    assert final.evicted_total == 0, "max_size was reached"
    server.checkpoint(os.path.join(run_dir, "final.ckpt"))
    server.close()
    ids = read_ids(os.path.join(run_dir, "final.ckpt"))
    checked = check_nothing_lost(ids, reports, run_dir, moments)

    sent = sum(r["sent"] for r in reports)
    acked = sum(r["acked"] for r in reports)
    print(
        f"workers: {sent:,} transitions sent, {acked:,} acknowledged, "
        f"{sum(r['given_up'] for r in reports)} given up at shutdown, "
        f"{sum(r['reconnects'] for r in reports)} reconnects, {sum(r['resent'] for r in reports)}"
        f" resent; paths {sorted({r['transport_path'] for r in reports})}; parameters fetched "
        f"per worker {[r['params_fetches'] for r in reports]} ({training.published} versions "
        "published)"
    )
    print(
        f"throughput: {acked / elapsed:,.0f} transitions/s into the table, "
        f"{dqn.step / elapsed:,.0f} learner steps/s ({training.items_sampled / elapsed:,.0f} "
        f"items sampled/s) over {elapsed:.1f} s"
    )
    inserts_s = (old.insert_blocked_ns_total + final.insert_blocked_ns_total) / 1e9
    samples_s = (old.sample_blocked_ns_total + final.sample_blocked_ns_total) / 1e9
    print(f"rate limiter: inserts waited {inserts_s:.2f} s, sample() waited {samples_s:.2f} s")
    print(
        f"nothing lost: {len(ids):,} transitions in the restored table, none twice; all "
        f"{checked['required']:,} that had to survive are there once "
        f"({checked['window_kept']} of the {checked['window']} the old learner acknowledged "
        "after its checkpoint are too)"
    )
    ret = greedy_return(dqn.params, args.eval_episodes, args.seed)
    episodes = args.eval_episodes
    print(f"greedy return after {dqn.step} steps: {ret:.1f} (mean of {episodes} episodes, max 500)")
    if args.run_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)


WORKER_FLAGS = ["workers", "envs", "transitions", "seconds", "poll-every", "hidden", "seed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--envs", type=int, default=4, help="CartPole envs per worker")
    parser.add_argument("--transitions", type=int, default=20_000, help="per worker, at most")
    parser.add_argument("--seconds", type=float, default=30.0, help="time for the run, at most")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples-per-insert", type=float, default=8.0)
    parser.add_argument("--min-size", type=int, default=1000, help="items before sampling")
    parser.add_argument("--hidden", type=int, default=64, help="units per hidden layer")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target-every", type=int, default=250, help="steps per target copy")
    parser.add_argument("--publish-every", type=int, default=50, help="steps per publish")
    parser.add_argument("--poll-every", type=int, default=10, help="worker steps per version check")
    parser.add_argument("--restart-gap", type=float, default=1.0, help="seconds")
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", help="keep the checkpoints and records here")
    parser.add_argument(
        "--ci",
        action="store_true",
        help="the small run CI makes: 2 workers x 4 envs, 4,000 transitions each, 40 s at most",
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    if args.ci:
        args.workers, args.transitions, args.seconds = 2, 4000, 40.0
        args.batch_size, args.min_size, args.restart_gap = 32, 256, 0.5
    if args.workers < 1 or args.envs < 1 or args.transitions < args.envs:
        parser.error("--workers, --envs >= 1 and --transitions >= --envs")
    if args.workers * args.transitions > MAX_SIZE:
        parser.error(
            f"--workers x --transitions must be at most max_size={MAX_SIZE:,}: nothing is "
            "evicted then, so the final check can ask for every transition"
        )
    print(f"echo {echo.__version__}")
    learner(args)


if __name__ == "__main__":
    main()
