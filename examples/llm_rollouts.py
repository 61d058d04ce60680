"""echo example: LLM-RL rollouts of variable length, in groups, to a learner with a token budget.

Worker threads stand in for inference servers. Each takes prompts of random length, samples
`--group-size` completions of each from a tiny policy (a softmax over a 32-token vocabulary,
from a random matrix), each ending at the end token or at `--max-new` tokens, and submits the
completions of one prompt as a group (`Server.submit_group`). The learner takes FIFO batches
of at most `--batch-tokens` completion tokens in the packed layout (`echo.Packed`: the tokens
of the batch one after another, and `cu_seqlens`), finds each batch's groups by their shared
key, computes GRPO's group-normalised advantage and a policy-gradient loss. At the end it
checks that every completion arrived, each group whole in one batch, and prints the
throughput.

    python examples/llm_rollouts.py --prompts 64 --group-size 8 --workers 2 --batch-tokens 2048

Ragged samples are in-process in this version: the workers are threads of the learner's
process. It needs only echo and numpy.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import echo

VOCAB = 32
EOS = 0
MAX_PROMPT = 64


def make_example(max_new: int) -> dict[str, object]:
    """The sample layout: a prompt, a completion's tokens and log-probabilities, a reward."""
    return {
        "prompt": echo.Ragged(MAX_PROMPT, np.int32),  # a length group of its own
        "tokens": echo.Ragged(max_new, np.int32, group="completion"),
        "logp": echo.Ragged(max_new, np.float32, group="completion"),
        "reward": np.zeros((), np.float32),
        "id": np.zeros((2,), np.int64),  # (worker, prompt), to check what arrived
    }


class TinyPolicy:
    """Next-token probabilities softmax(W[previous token]) over a vocabulary of VOCAB."""

    def __init__(self, seed: int) -> None:
        self.logits = np.random.default_rng(seed).normal(0.0, 2.0, (VOCAB, VOCAB))

    def complete(
        self, prompt: np.ndarray, group: int, max_new: int, rng: np.random.Generator
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`group` completions of `prompt`, sampled together: (tokens, log-probabilities)."""
        prev = np.full(group, prompt[-1])
        tokens, logps = [], []
        length = np.full(group, max_new)
        for t in range(max_new):
            logits = self.logits[prev]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            draw = rng.random((group, 1))
            prev = np.minimum((p.cumsum(axis=1) < draw).sum(axis=1), VOCAB - 1)
            tokens.append(prev)
            logps.append(np.log(p[np.arange(group), prev]))
            length = np.where((prev == EOS) & (length == max_new), t + 1, length)
            if (length < max_new).all():
                break
        tok = np.stack(tokens, axis=1).astype(np.int32)
        logp = np.stack(logps, axis=1).astype(np.float32)
        return [(tok[g, :n], logp[g, :n]) for g, n in enumerate(length)]


def reward_of(tokens: np.ndarray) -> np.float32:
    """A toy reward: the fraction of even tokens."""
    return np.float32((tokens % 2 == 0).mean()) if len(tokens) else np.float32(0.0)


def worker(
    server: echo.Server, worker_id: int, prompts: int, args: argparse.Namespace, errors: list
) -> None:
    try:
        policy = TinyPolicy(seed=0)  # every worker acts with the same parameters
        rng = np.random.default_rng(1000 + worker_id)
        for p in range(prompts):
            prompt = rng.integers(1, VOCAB, int(rng.integers(4, MAX_PROMPT + 1)), dtype=np.int32)
            completions = policy.complete(prompt, args.group_size, args.max_new, rng)
            server.submit_group(
                [
                    {
                        "prompt": prompt,
                        "tokens": tokens,
                        "logp": logp,
                        "reward": reward_of(tokens),
                        "id": np.array([worker_id, p], np.int64),
                    }
                    for tokens, logp in completions
                ]
            )
    except BaseException as exc:
        errors.append(exc)  # the learner reports it as a failure
        raise


def group_advantages(keys: np.ndarray, reward: np.ndarray) -> np.ndarray:
    """GRPO: each sample's reward normalised over the samples that share its key."""
    _, group_of, size = np.unique(keys, return_inverse=True, return_counts=True)
    mean = np.bincount(group_of, reward) / size
    std = np.sqrt(np.bincount(group_of, (reward - mean[group_of]) ** 2) / size)
    return (reward - mean[group_of]) / (std[group_of] + 1e-6)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48, help="prompts in all")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--workers", type=int, default=2, help="worker threads")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="token budget")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch, at most")
    parser.add_argument("--max-new", type=int, default=128, help="longest completion")
    args = parser.parse_args()
    if args.group_size * args.max_new > args.batch_tokens:
        parser.error(
            f"a group may take {args.group_size} x {args.max_new} tokens, more than"
            f" --batch-tokens {args.batch_tokens}: the server would refuse it"
        )

    server = echo.Server(
        make_example(args.max_new),
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        token_group="completion",
        layout="packed",
    )
    errors: list[BaseException] = []
    shares = [
        args.prompts // args.workers + (w < args.prompts % args.workers)
        for w in range(args.workers)
    ]
    threads = [
        threading.Thread(target=worker, args=(server, w, shares[w], args, errors), daemon=True)
        for w in range(args.workers)
    ]

    def close_when_done() -> None:
        for thread in threads:
            thread.join()
        server.close(drain=True)  # the learner gets what is left, then None

    started = time.perf_counter()
    for thread in threads:
        thread.start()
    closer = threading.Thread(target=close_when_done, daemon=True)
    closer.start()

    seen: dict[int, tuple[int, ...]] = {}  # key -> the (worker, prompt) its samples carry
    problems: list[str] = []
    batches = samples = tokens_total = 0
    while (s := server.sample(timeout=30.0)) is not None:
        tokens, logp, reward = s.batch["tokens"], s.batch["logp"], s.batch["reward"]
        cu = tokens.cu_seqlens
        if cu[-1] > args.batch_tokens or s.num_samples > args.batch_size:
            problems.append(f"batch {batches}: {cu[-1]} tokens, {s.num_samples} samples")
        advantage = group_advantages(s.keys, reward)  # (B,)
        per_token = np.repeat(advantage, np.diff(cu))  # (T,)
        loss = -(per_token * logp.values).sum() / max(len(logp.values), 1)
        if not np.isfinite(loss):
            problems.append(f"batch {batches}: loss {loss}")
        ids = s.batch["id"]
        for key in np.unique(s.keys).tolist():
            rows = np.flatnonzero(s.keys == key)
            if key in seen:
                problems.append(f"group {key} came in two batches (split)")
            if len(rows) != args.group_size or np.ptp(rows) != len(rows) - 1:
                problems.append(f"group {key}: {len(rows)} samples at {rows.tolist()}")
            if len({tuple(i) for i in ids[rows].tolist()}) != 1:
                problems.append(f"group {key} mixes prompts {ids[rows].tolist()}")
            seen[key] = tuple(ids[rows[0]].tolist())
        batches += 1
        samples += s.num_samples
        tokens_total += int(cu[-1])
    elapsed = time.perf_counter() - started
    closer.join()
    for exc in errors:
        problems.append(f"a worker failed: {exc!r}")

    expected = {(w, p) for w in range(args.workers) for p in range(shares[w])}
    arrived = set(seen.values())
    if arrived != expected or len(seen) != len(expected):
        problems.append(
            f"{len(expected - arrived)} groups lost, {len(seen) - len(arrived)} duplicated"
        )
    if samples != args.prompts * args.group_size:
        problems.append(f"{samples} samples arrived, {args.prompts * args.group_size} submitted")

    print(
        f"{samples} completions in {len(seen)} groups of {args.group_size}, {batches} batches"
        f" of at most {args.batch_tokens} tokens (mean {tokens_total / max(batches, 1):.0f})"
    )
    print(
        f"{tokens_total} completion tokens in {elapsed:.2f} s:"
        f" {tokens_total / elapsed:,.0f} tokens/s"
    )
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems[:20]))
        return 1
    print("nothing lost: every group whole, in one batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
