"""echo example: rollout workers send whole trajectories, each one sample, to a learner over TCP.

Each worker steps a fake environment, fills a `TrajectoryAccumulator` with `--horizon` steps
of (obs, action, reward, done), the observation to bootstrap from, and a (worker, sequence)
id, and sends the built trajectory as one sample with a `TcpClient`. The learner (the main
process) runs a `Server` with a `TcpTransport` on a free loopback port, starts `--workers`
worker processes, and checks every batch: each worker's trajectories arrive in order, and
each trajectory starts where the previous one's bootstrap observation left off.

    python examples/trajectory_worker.py --workers 2 --trajectories 8 --horizon 16
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np

from echo import Server, TcpClient, TcpTransport, TrajectoryAccumulator

NUM_ACTIONS = 4


def make_example(horizon: int, obs_dim: int) -> dict[str, dict[str, np.ndarray]]:
    """The sample layout, shared by the learner and the workers."""
    return {
        # Buffered: leading dim `horizon`, one slot per step.
        "steps": {
            "obs": np.zeros((horizon, obs_dim), np.float32),
            "action": np.zeros((horizon,), np.int64),
            "reward": np.zeros((horizon,), np.float32),
            "done": np.zeros((horizon,), np.bool_),
        },
        # Single item, leading dim 1: `add()` takes an observation of shape (obs_dim,).
        "bootstrap": {"obs": np.zeros((1, obs_dim), np.float32)},
        # Single item with 0-d leaves: `add()` takes these shapes (or a leading dim of 1).
        "meta": {"worker": np.zeros((), np.int64), "seq": np.zeros((), np.int64)},
    }


class FakeEnv:
    """A stand-in environment: random observations and rewards, episodes of 1 to `max_steps`
    steps, reset automatically when one ends (the returned observation is then the first of
    the next episode)."""

    def __init__(self, obs_dim: int, seed: int, max_steps: int = 20) -> None:
        self._rng = np.random.default_rng(seed)
        self._obs_dim = obs_dim
        self._max_steps = max_steps
        self._left = 0

    def reset(self) -> np.ndarray:
        self._left = int(self._rng.integers(1, self._max_steps + 1))
        return self._rng.standard_normal(self._obs_dim).astype(np.float32)

    def step(self, action: np.int64) -> tuple[np.ndarray, np.float32, np.bool_]:
        self._left -= 1
        reward = np.float32(self._rng.random() + float(action))
        done = self._left == 0
        obs = self.reset() if done else self._rng.standard_normal(self._obs_dim).astype(np.float32)
        return obs, reward, np.bool_(done)


def worker(port: int, worker_id: int, trajectories: int, horizon: int, obs_dim: int) -> None:
    """One rollout worker: send `trajectories` trajectories of `horizon` steps, then close."""
    example = make_example(horizon, obs_dim)
    acc = TrajectoryAccumulator(example)
    env = FakeEnv(obs_dim, seed=worker_id)
    policy = np.random.default_rng(1000 + worker_id)
    with TcpClient("127.0.0.1", port, example) as client:  # close() on exit flushes
        obs = env.reset()
        for seq in range(trajectories):
            for _ in range(horizon):
                action = np.int64(policy.integers(NUM_ACTIONS))
                next_obs, reward, done = env.step(action)
                acc.add("steps", {"obs": obs, "action": action, "reward": reward, "done": done})
                obs = next_obs
            acc.add("bootstrap", {"obs": obs})  # the value target's V(s_T) input
            acc.add("meta", {"worker": np.int64(worker_id), "seq": np.int64(seq)})
            # build() aliases the accumulator's buffers; send() has written the bytes when it
            # returns, so the next add() may overwrite them.
            client.send(acc.build())


def learner(args: argparse.Namespace) -> None:
    example = make_example(args.horizon, args.obs_dim)
    server = Server(
        example, batch_size=args.batch_size, transport=TcpTransport(port=0, host="127.0.0.1")
    )
    server.start()
    port = server.port
    assert port is not None
    total = args.workers * args.trajectories
    print(
        f"learner on 127.0.0.1:{port}: {args.workers} workers x {args.trajectories} trajectories "
        f"of {args.horizon} steps, batch {args.batch_size}"
    )
    worker_args = ["--port", str(port), "--trajectories", str(args.trajectories)]
    worker_args += ["--horizon", str(args.horizon), "--obs-dim", str(args.obs_dim)]
    workers = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(w), *worker_args])
        for w in range(args.workers)
    ]
    next_seq = np.zeros(args.workers, np.int64)
    last_bootstrap: dict[int, np.ndarray] = {}
    episodes = 0
    try:
        for step in range(total // args.batch_size):
            sample = server.sample(timeout=60)
            if sample is None:
                raise SystemExit("the server closed early")
            steps, meta = sample.batch["steps"], sample.batch["meta"]
            for i in range(args.batch_size):
                worker_id, seq = int(meta["worker"][i]), int(meta["seq"][i])
                if seq != next_seq[worker_id]:
                    raise SystemExit(
                        f"worker {worker_id}: expected {next_seq[worker_id]}, got {seq}"
                    )
                next_seq[worker_id] += 1
                previous = last_bootstrap.get(worker_id)
                if previous is not None and not np.array_equal(steps["obs"][i, 0], previous):
                    raise SystemExit(f"worker {worker_id}: trajectory {seq} does not continue")
                # The batch is a view into the ring, valid until the next sample(): copy to keep.
                last_bootstrap[worker_id] = np.copy(sample.batch["bootstrap"]["obs"][i, 0])
            episodes += int(steps["done"].sum())
            print(
                f"batch {step}: obs {steps['obs'].shape}, "
                f"bootstrap {sample.batch['bootstrap']['obs'].shape}, "
                f"mean reward {float(steps['reward'].mean()):.3f}, "
                f"{int(steps['done'].sum())} episode ends"
            )
        for proc in workers:
            if proc.wait(timeout=60) != 0:
                raise SystemExit(f"a worker exited with {proc.returncode}")
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
    print(
        f"received {int(next_seq.sum())} trajectories ({args.horizon * total} steps, "
        f"{episodes} episode ends), in per-worker order, each continuing the previous one's "
        "bootstrap observation"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=8, help="trajectories per worker")
    parser.add_argument("--horizon", type=int, default=16, help="steps per trajectory (> 1)")
    parser.add_argument("--obs-dim", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.port, args.worker, args.trajectories, args.horizon, args.obs_dim)
        return
    if args.horizon < 2:
        parser.error("--horizon must be at least 2 (a buffered timescale has N > 1 slots)")
    if (args.workers * args.trajectories) % args.batch_size:
        parser.error("--workers x --trajectories must be a multiple of --batch-size")
    learner(args)


if __name__ == "__main__":
    main()
