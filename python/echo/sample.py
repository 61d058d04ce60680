"""`Sample`: one batch as `Server.sample()` hands it out, with its counters and per-item
arrays, and how it prints (a summary of every leaf, never the data)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import optree

from echo._echo import SampleInfo
from echo._pytree import NONE_IS_LEAF

__all__ = ["Sample"]


class _Batch(NamedTuple):
    batch: Any
    info: SampleInfo


class _LeafSummary:
    """Stands in for an array in `repr(sample)`: its dtype and shape, not its contents."""

    __slots__ = ("text",)

    def __init__(self, leaf: object) -> None:
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            self.text = type(leaf).__name__
        else:
            self.text = f"{dtype}[{', '.join(str(d) for d in shape)}]"

    def __repr__(self) -> str:
        return self.text


def _tree_summary(batch: object) -> str:
    """`batch` with every leaf replaced by its dtype and shape: `{'obs': float32[32, 4]}`."""
    try:
        summary = optree.tree_map(
            _LeafSummary,
            batch,  # pyright: ignore[reportArgumentType]
            none_is_leaf=NONE_IS_LEAF,
        )
    except Exception:  # noqa: BLE001 -- a repr never raises; say what it is instead
        return type(batch).__name__
    return repr(summary)


def _array_summary(array: npt.NDArray[Any]) -> str:
    """`uint64[32] 0..97`: dtype, length and range of a replay per-item array."""
    head = f"{array.dtype}[{', '.join(str(d) for d in array.shape)}]"
    if array.size == 0:
        return head
    low, high = array.min(), array.max()
    if array.dtype.kind == "f":
        return f"{head} {float(low):.4g}..{float(high):.4g}"
    return f"{head} {int(low)}..{int(high)}"


class Sample(_Batch):
    """One batch and the server's counters when it was handed out: a named tuple
    `(batch, info)`.

    `batch` has the example's structure; each leaf has shape `(batch_size, *leaf.shape)` and
    the leaf's dtype. Unless it came from `copy=True`, every leaf is a read-only view that is
    only meaningful until the next `sample()` call (see the zero-copy guide).

    With a replay sampler (anything but `Fifo()`) three per-item arrays come along as
    attributes (`None` for FIFO): `keys` (uint64, stable per item: pass them to
    `update_priorities`), `probabilities` (float64, the probability each item was drawn with,
    for importance weights) and `times_sampled` (uint32, including this draw). `info` carries
    the same three arrays (`info.keys`, ...), so `batch, info = sample` unpacks every sample,
    FIFO or replay, into two values and loses nothing.

    A sequence table's batch is windows: each leaf is `(batch_size, length, *shape)`, the
    three arrays above are per window, and six more come along (`None` otherwise): `mask`
    (bool, `(batch_size, length)`: which steps are real rather than padding), `episode`
    (uint64 episode id), `start` (uint32, the window's first step's index in its episode),
    `stream` (uint64), `terminated` / `truncated` (bool: how the window's episode ended,
    both false while it goes on when the batch is drawn), and `is_last` (bool,
    `(batch_size, length)`: true at the episode's last step, where the window holds it).

    A server that keeps policy versions (`Server(policy_versions=True)` or `max_staleness=`)
    adds `versions` (uint64, `(batch_size,)`, or `(batch_size, length)` for windows): the
    version of the learner's parameters that made each sample (`None` otherwise).

    `repr(sample)` shows the batch's structure with each leaf's dtype and shape (not its
    contents), the batch's `sequence`, and for replay the range of each per-item array.
    """

    keys: npt.NDArray[np.uint64] | None
    probabilities: npt.NDArray[np.float64] | None
    times_sampled: npt.NDArray[np.uint32] | None
    mask: npt.NDArray[np.bool_] | None
    episode: npt.NDArray[np.uint64] | None
    start: npt.NDArray[np.uint32] | None
    stream: npt.NDArray[np.uint64] | None
    terminated: npt.NDArray[np.bool_] | None
    truncated: npt.NDArray[np.bool_] | None
    is_last: npt.NDArray[np.bool_] | None
    versions: npt.NDArray[np.uint64] | None
    _num_samples: int | None

    def __new__(
        cls,
        batch: Any,
        info: SampleInfo,
        keys: npt.NDArray[np.uint64] | None = None,
        probabilities: npt.NDArray[np.float64] | None = None,
        times_sampled: npt.NDArray[np.uint32] | None = None,
        *,
        mask: npt.NDArray[np.bool_] | None = None,
        episode: npt.NDArray[np.uint64] | None = None,
        start: npt.NDArray[np.uint32] | None = None,
        stream: npt.NDArray[np.uint64] | None = None,
        terminated: npt.NDArray[np.bool_] | None = None,
        truncated: npt.NDArray[np.bool_] | None = None,
        is_last: npt.NDArray[np.bool_] | None = None,
        versions: npt.NDArray[np.uint64] | None = None,
        num_samples: int | None = None,
    ) -> Sample:
        self = super().__new__(cls, batch, info)
        self._num_samples = num_samples
        self.keys = keys
        self.probabilities = probabilities
        self.times_sampled = times_sampled
        self.mask = mask
        self.episode = episode
        self.start = start
        self.stream = stream
        self.terminated = terminated
        self.truncated = truncated
        self.is_last = is_last
        self.versions = versions
        return self

    @property
    def num_samples(self) -> int:
        """How many samples (or windows) the batch holds: `batch_size`, or fewer for a
        ragged server's batch closed by its token budget or by a group that did not fit."""
        if self._num_samples is not None:
            return self._num_samples
        leaves = optree.tree_leaves(self.batch, none_is_leaf=NONE_IS_LEAF)
        return int(leaves[0].shape[0]) if leaves else 0

    def _with_batch(self, batch: Any) -> Sample:
        """The same sample with another batch (a device copy), every per-item array kept."""
        extras = {name: getattr(self, name) for name in _PER_ITEM}
        return Sample(batch, self.info, **extras, num_samples=self._num_samples)

    def __repr__(self) -> str:
        parts = [f"sequence={getattr(self.info, 'sequence', '?')}"]
        parts.append(f"batch={_tree_summary(self.batch)}")
        shown = ("keys", "probabilities", "times_sampled", "episode", "start", "stream")
        for name in (*shown, "versions"):
            array = getattr(self, name, None)
            if array is not None:
                parts.append(f"{name}={_array_summary(np.asarray(array))}")
        return f"Sample({', '.join(parts)})"


# Every per-item array a `Sample` may carry, by name (`ServerCore.meta_names` hands out some).
_PER_ITEM = (
    "keys",
    "probabilities",
    "times_sampled",
    "mask",
    "episode",
    "start",
    "stream",
    "terminated",
    "truncated",
    "is_last",
    "versions",
)
