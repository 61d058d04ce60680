"""The data of the ``ragged`` suite (``benches/suites/ragged.py``): synthetic LLM rollouts, the
reader that touches every byte of a batch, and the memcpy baseline.

Numpy and the standard library only: the peers' virtualenvs (TorchRL, TransferQueue) import
it too.

A rollout is a prompt of ``prompt_min`` to ``prompt_max`` tokens (uniform), ``int32``; a
completion whose length is lognormal with median ``completion_median`` and shape
``completion_sigma``, clipped to ``[1, completion_max]``, as ``int32`` tokens and one
``float32`` log-probability per token (the length group ``"completion"``); and a fixed
``float32`` reward, which holds the rollout's index in the pool (so a reader can check that
what it got is what was sent). The pool is made once, before any clock starts, and every
insert loop cycles through it: distinct samples, not one hot sample.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

PROMPT_DTYPE = np.int32
TOKEN_DTYPE = np.int32
LOGP_DTYPE = np.float32
REWARD_DTYPE = np.float32
VOCAB = 151_936  # a Qwen-sized vocabulary: the token ids' range


class Rollouts:
    """A pool of ``n`` rollouts: ``prompts[i]``, ``tokens[i]``, ``logps[i]`` (numpy arrays,
    each C-contiguous and its own) and ``rewards[i]`` (a 0-d ``float32`` array, ``i``)."""

    def __init__(self, p: dict[str, Any], seed: int = 0) -> None:
        n = int(p["pool"])
        rng = np.random.default_rng(seed)
        self.prompt_max = int(p["prompt_max"])
        self.completion_max = int(p["completion_max"])
        prompt_len = rng.integers(int(p["prompt_min"]), self.prompt_max + 1, n)
        median, sigma = float(p["completion_median"]), float(p["completion_sigma"])
        raw = rng.lognormal(math.log(median), sigma, n)
        completion_len = np.clip(np.rint(raw), 1, self.completion_max).astype(np.int64)
        self.prompt_len = prompt_len.astype(np.int64)
        self.completion_len = completion_len
        self.prompts = [rng.integers(0, VOCAB, k, dtype=PROMPT_DTYPE) for k in prompt_len]
        self.tokens = [rng.integers(0, VOCAB, k, dtype=TOKEN_DTYPE) for k in completion_len]
        self.logps = [-rng.exponential(1.0, k).astype(LOGP_DTYPE) for k in completion_len]
        self.rewards = [np.array(i, REWARD_DTYPE) for i in range(n)]
        self.n = n

    def sample_bytes(self, i: int) -> int:
        """The payload bytes of rollout ``i``: its prompt, tokens, log-probabilities, reward."""
        return (
            self.prompts[i].nbytes
            + self.tokens[i].nbytes
            + self.logps[i].nbytes
            + self.rewards[i].nbytes
        )

    def total_bytes(self) -> int:
        return sum(self.sample_bytes(i) for i in range(self.n))

    def mean_bytes(self) -> float:
        return self.total_bytes() / self.n

    def padded_bytes(self) -> int:
        """One sample's bytes with every ragged leaf padded to its ``max_len``: the fixed-shape
        leaves a table without ragged leaves would need."""
        item = np.dtype(PROMPT_DTYPE).itemsize
        return (
            self.prompt_max * item
            + self.completion_max * (np.dtype(TOKEN_DTYPE).itemsize + np.dtype(LOGP_DTYPE).itemsize)
            + np.dtype(REWARD_DTYPE).itemsize
        )

    def facts(self) -> dict[str, Any]:
        """The pool's lengths and bytes, for the record."""
        return {
            "pool": self.n,
            "prompt_mean": round(float(self.prompt_len.mean()), 1),
            "completion_mean": round(float(self.completion_len.mean()), 1),
            "completion_median": float(np.median(self.completion_len)),
            "completion_p99": float(np.percentile(self.completion_len, 99)),
            "completion_max_seen": int(self.completion_len.max()),
            "clipped": int((self.completion_len >= self.completion_max).sum()),
            "mean_sample_bytes": round(self.mean_bytes(), 1),
            "padded_sample_bytes": self.padded_bytes(),
        }

    def leaves_lengths(self) -> tuple[int, int]:
        """The pool's mean prompt and completion lengths, rounded: the shapes of the
        fixed-shape rollouts of :meth:`fixed_leaves`."""
        return round(float(self.prompt_len.mean())), round(float(self.completion_len.mean()))

    def fixed_leaves(self, seed: int = 2) -> list[dict[str, np.ndarray]]:
        """One fixed-shape rollout per rollout of the pool: the same four leaves and dtypes,
        at the pool's mean lengths (so about its mean bytes), random values, and the
        rollout's index as its reward (so a reader can check what it got): the sample a
        fixed-shape table would take for the same data, padded to no maximum."""
        prompt, completion = self.leaves_lengths()
        rng = np.random.default_rng(seed)
        return [
            {
                "prompt": rng.integers(0, VOCAB, prompt, dtype=PROMPT_DTYPE),
                "tokens": rng.integers(0, VOCAB, completion, dtype=TOKEN_DTYPE),
                "logp": -rng.exponential(1.0, completion).astype(LOGP_DTYPE),
                "reward": np.array(i, REWARD_DTYPE),
            }
            for i in range(self.n)
        ]

    def sample(self, i: int) -> dict[str, np.ndarray]:
        """Rollout ``i`` as the dict a learner's worker would submit."""
        return {
            "prompt": self.prompts[i],
            "tokens": self.tokens[i],
            "logp": self.logps[i],
            "reward": self.rewards[i],
        }


def touch(arrays: Any) -> int:
    """Reads every byte of every array (numpy, or anything ``np.asarray`` takes without a
    copy): sums them as ``uint64`` words from the first 8-byte aligned address, the bytes
    before it and after the last word as bytes (a word view of an unaligned address would
    make numpy copy it to an aligned buffer first: a second pass that is not the reader's).
    What a consumer that reads every batch costs at least, the same for every library
    measured."""
    acc = 0
    for a in arrays:
        b = np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)
        lead = min(len(b), -b.ctypes.data % 8)
        n8 = (len(b) - lead) // 8 * 8
        if lead:
            acc += int(b[:lead].sum(dtype=np.uint64))
        if n8:
            acc += int(b[lead : lead + n8].view(np.uint64).sum(dtype=np.uint64))
        if lead + n8 < len(b):
            acc += int(b[lead + n8 :].sum(dtype=np.uint64))
    return acc


class Memcpy:
    """``np.copyto`` of ``nbytes`` into one preallocated buffer, from ``sources`` preallocated
    buffers in turn (so the source is not in cache, as a table's rows would not be), and a
    :func:`touch` of the copy: the baseline of a batch of ``nbytes``."""

    def __init__(self, nbytes: int, sources: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.nbytes = max(8, int(nbytes) // 8 * 8)
        words = self.nbytes // 8
        self.src = [rng.integers(0, 2**63, words, dtype=np.uint64) for _ in range(sources)]
        self.dst = np.empty(words, np.uint64)
        self.i = 0

    def copy(self) -> None:
        np.copyto(self.dst, self.src[self.i % len(self.src)])
        self.i += 1

    def copy_and_touch(self) -> int:
        self.copy()
        return touch([self.dst])
