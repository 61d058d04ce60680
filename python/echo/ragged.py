"""Variable-length samples: leaves ragged along their first axis, stored without padding.

Declare a leaf of the example as `echo.Ragged(max_len, dtype, inner_shape)` and `echo.Server`
stores each sample's rows as they are (a block arena in Rust), hands out groups whole, closes
batches on a token budget, and lays each batch out *packed* (`echo.Packed(values,
cu_seqlens)`) or *padded* (`echo.Padded(values, lengths, mask)`). See the guide "Variable-length
data (episodes, tokens)".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt
import optree
from optree import PyTreeSpec

from echo._echo import RaggedCore, SampleInfo, _sample_info  # pyright: ignore[reportPrivateUsage]
from echo._pytree import NONE_IS_LEAF, _path_name  # pyright: ignore[reportPrivateUsage]
from echo._validate import check_int
from echo.replay import Fifo, MinSize, Prioritized, Uniform
from echo.sample import Sample

MAX_PAD_MULTIPLE = 1 << 16
"""The largest `pad_to_multiple`: a padded batch's rows are rounded up to a multiple of it
(a kernel's tile, 8 to 128 as a rule), never to more than this."""

__all__ = ["Packed", "Padded", "Ragged", "has_ragged_leaves"]


class Ragged:
    """A leaf ragged along its first axis: each sample holds `(n, *inner_shape)` with
    `0 <= n <= max_len`.

    Args:
        max_len: The most rows one sample may have (>= 1); `max_len` rows of one sample
            take less than 2 GiB.
        dtype: The rows' dtype (anything `numpy.dtype` takes).
        inner_shape: The shape of one row (default `()`: a row is one value).
        group: A length group's name. Leaves that name the same group have the same number
            of rows in every sample (tokens, their log-probabilities, their mask), checked on
            insert; they share one `cu_seqlens` (or `lengths` and `mask`) in a batch. `None`
            (default): a group of its own, named after the leaf's path (e.g. `"['prompt']"`).

    Raises:
        TypeError: `max_len` is not an int, `inner_shape` not a tuple of ints, `group` not a
            str, or `dtype` holds Python objects.
        ValueError: `max_len < 1`, a negative dimension, or an empty `group`.
    """

    __slots__ = ("dtype", "group", "inner_shape", "max_len")

    def __init__(
        self,
        max_len: int,
        dtype: npt.DTypeLike,
        inner_shape: tuple[int, ...] = (),
        *,
        group: str | None = None,
    ) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Ragged(max_len) must be an int, got {type(max_len).__name__}")
        if max_len < 1:
            raise ValueError(f"Ragged(max_len) must be at least 1, got {max_len}")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise TypeError(f"Ragged(dtype): {dt} holds Python objects, which cannot be stored")
        if not isinstance(inner_shape, tuple) or not all(  # pyright: ignore[reportUnnecessaryIsInstance]
            isinstance(d, int | np.integer) and not isinstance(d, bool)  # pyright: ignore[reportUnnecessaryIsInstance]
            for d in inner_shape
        ):
            raise TypeError(f"Ragged(inner_shape) must be a tuple of ints, got {inner_shape!r}")
        if any(d < 0 for d in inner_shape):
            raise ValueError(f"Ragged(inner_shape) has a negative dimension: {inner_shape}")
        if group is not None and not isinstance(group, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Ragged(group) must be a str or None, got {type(group).__name__}")
        if group == "":
            raise ValueError("Ragged(group) must not be empty")
        self.max_len = int(max_len)
        self.dtype: np.dtype[Any] = dt
        self.inner_shape = tuple(int(d) for d in inner_shape)
        self.group = group

    def __repr__(self) -> str:
        inner = f", inner_shape={self.inner_shape}" if self.inner_shape else ""
        group = f", group={self.group!r}" if self.group is not None else ""
        return f"Ragged({self.max_len}, {self.dtype}{inner}{group})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        mine = (self.max_len, self.dtype, self.inner_shape, self.group)
        return mine == (other.max_len, other.dtype, other.inner_shape, other.group)

    def __hash__(self) -> int:
        return hash((self.max_len, self.dtype, self.inner_shape, self.group))


class Packed(NamedTuple):
    """A ragged leaf of a packed batch: every sample's rows one after another, `values`
    `(T, *inner_shape)`, and `cu_seqlens` `(B + 1,)` int32 from 0: sample `i` is
    `values[cu_seqlens[i]:cu_seqlens[i + 1]]`. The leaves of one length group share the
    same `cu_seqlens` array."""

    values: Any
    cu_seqlens: npt.NDArray[np.int32]


class Padded(NamedTuple):
    """A ragged leaf of a padded batch: `values` `(B, L, *inner_shape)` with zeros past each
    sample's length, `lengths` `(B,)` int32, and `mask` `(B, L)` bool (true for real rows).
    `L` is the batch's longest length rounded up to `pad_to_multiple`."""

    values: Any
    lengths: npt.NDArray[np.int32]
    mask: npt.NDArray[np.bool_]


def has_ragged_leaves(example: object) -> bool:
    """Whether `example` has an `echo.Ragged` leaf."""
    leaves: list[Any] = optree.tree_leaves(example, none_is_leaf=NONE_IS_LEAF)  # pyright: ignore[reportArgumentType, reportUnknownArgumentType, reportUnknownVariableType]
    return any(isinstance(leaf, Ragged) for leaf in leaves)


class _Leaf(NamedTuple):
    name: str
    key: str  # the path joined by "/", for token_group
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # fixed: the shape; ragged: the inner shape
    ragged: Ragged | None
    path: tuple[Any, ...]  # the keys and indices leading to it


class RaggedLayout:
    """The example's structure, its fixed and ragged leaves, and how to flatten samples."""

    def __init__(self, example: object) -> None:
        paths, leaves, treespec = cast(
            "tuple[list[tuple[Any, ...]], list[object], PyTreeSpec]",
            optree.tree_flatten_with_path(example, none_is_leaf=NONE_IS_LEAF),  # pyright: ignore[reportArgumentType, reportUnknownArgumentType]
        )
        self.treespec = treespec
        self.leaves: list[_Leaf] = []
        # A flat dict of leaves: read samples by key (optree sorts a dict's keys).
        flat = isinstance(example, dict) and all(
            len(p) == 1 and isinstance(p[0], str) for p in paths
        )
        # Interned, as dict literals' keys are: a sample's lookup finds the very object.
        self.flat_keys: list[str] | None = [sys.intern(p[0]) for p in paths] if flat else None
        for path, leaf in zip(paths, leaves, strict=True):
            name, key = _path_name(path), "/".join(str(p) for p in path)
            if isinstance(leaf, Ragged):
                self.leaves.append(
                    _Leaf(name, key, leaf.dtype, leaf.inner_shape, leaf, tuple(path))
                )
            elif isinstance(leaf, np.ndarray):
                arr = cast("np.ndarray[Any, Any]", leaf)
                if arr.dtype.hasobject:
                    raise TypeError(f"example leaf {name}: dtype {arr.dtype} holds Python objects")
                shape = tuple(int(d) for d in arr.shape)
                self.leaves.append(_Leaf(name, key, arr.dtype, shape, None, tuple(path)))
            else:
                raise TypeError(
                    f"example leaf {name}: expected a numpy.ndarray or echo.Ragged, "
                    f"got {type(leaf).__name__}"
                )

    def core_leaves(self) -> list[tuple[str, tuple[int, ...], np.dtype[Any], Any]]:
        return [
            (
                leaf.name,
                leaf.shape,
                leaf.dtype,
                None if leaf.ragged is None else (leaf.ragged.max_len, leaf.ragged.group),
            )
            for leaf in self.leaves
        ]

    def flatten(self, sample: object) -> list[Any]:
        """The sample's leaves in order, numpy arrays (C-contiguous) for the core, which
        checks each one's dtype and shape. A flat dict is read by key (the common case, and
        the fast one); anything else goes through optree."""
        keys = self.flat_keys
        if keys is not None and type(sample) is dict and len(sample) == len(keys):  # pyright: ignore[reportUnknownArgumentType]
            try:
                values = [cast("dict[str, Any]", sample)[k] for k in keys]
            except KeyError:
                values = None
            if values is not None:
                return [
                    v if type(v) is np.ndarray and v.flags.c_contiguous else _array(v)
                    for v in values
                ]
        leaves, treespec = optree.tree_flatten(sample, none_is_leaf=NONE_IS_LEAF)  # pyright: ignore[reportArgumentType, reportUnknownArgumentType, reportUnknownVariableType]
        if treespec != self.treespec:
            raise ValueError(
                f"the sample's structure differs from the example's: expected "
                f"{self.treespec}, got {treespec}"
            )
        return [_array(v) for v in cast("list[Any]", leaves)]

    def unflatten(self, leaves: list[Any]) -> Any:
        return optree.tree_unflatten(self.treespec, leaves)


def _codecs(layout: RaggedLayout, compress: Any) -> list[Any]:
    """Per leaf, the codec `compress=` gives it (None: raw). `compress` is None, a codec (every
    ragged leaf; floating-point ones only with `force=True`), `"auto"` (the integer ragged
    leaves, token ids, with `Zstd(1)`) or a mapping of leaf paths (`"tokens"`, `"obs/pixels"`,
    `("obs", "pixels")` or `"['tokens']"`) to codecs (ValueError for a floating-point leaf
    without `force=True`, as for any server)."""
    from echo.compression import Lz4, Zstd

    leaves = layout.leaves
    if compress is None:
        return [None] * len(leaves)
    if isinstance(compress, Zstd | Lz4):
        # Every ragged leaf; a floating-point one only with `force=True` (it rarely shrinks).
        return [
            compress
            if leaf.ragged is not None and (compress.force or leaf.dtype.kind not in "fc")
            else None
            for leaf in leaves
        ]
    if compress == "auto":
        return [
            Zstd(1) if leaf.ragged is not None and leaf.dtype.kind in "iu" else None
            for leaf in leaves
        ]
    if not isinstance(compress, dict):
        raise TypeError(
            "compress must be None, echo.Zstd(...), echo.Lz4(), 'auto' or a dict of leaf "
            f"paths to codecs, got {type(compress).__name__}"
        )
    out: list[Any] = [None] * len(leaves)
    for path, codec in cast("dict[Any, Any]", compress).items():
        parts: tuple[Any, ...] = (
            cast("tuple[Any, ...]", path) if isinstance(path, tuple) else (path,)
        )
        key = "/".join(str(part) for part in parts)
        hits = [
            i
            for i, leaf in enumerate(leaves)
            if key in (leaf.key, leaf.name) or leaf.key.startswith(key + "/")
        ]
        if not hits:
            names = ", ".join(leaf.name for leaf in leaves)
            raise ValueError(f"compress: {path!r} names no leaf; the leaves are {names}")
        if not isinstance(codec, Zstd | Lz4):
            raise TypeError(
                f"compress[{path!r}] must be echo.Zstd(...) or echo.Lz4(), "
                f"got {type(codec).__name__}"
            )
        for i in hits:
            leaf = leaves[i]
            if leaf.dtype.kind in "fc" and not codec.force:
                raise ValueError(
                    f"compress: leaf {leaf.name} is {leaf.dtype}, and floating-point data "
                    f"rarely compresses (low bits are noise); pass {type(codec).__name__}("
                    "force=True) to compress it anyway"
                )
            out[i] = codec
    return out


def _array(value: Any) -> np.ndarray[Any, Any]:
    """`value` as a C-contiguous numpy array (numpy scalars, lists, other array types)."""
    array = np.asarray(value)
    # (`ascontiguousarray` would make a 0-d array 1-d; a 0-d array is contiguous.)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _sampler_args(sampler: Any) -> tuple[str, float]:
    if sampler is None or isinstance(sampler, Fifo):
        return "fifo", 0.0
    if isinstance(sampler, Uniform):
        return "uniform", 0.0
    if isinstance(sampler, Prioritized):
        return "prioritized", float(sampler.exponent)
    raise ValueError(
        f"a server with ragged leaves samples with Fifo(), Uniform() or Prioritized(), "
        f"got {sampler!r}"
    )


def _token_group(layout: RaggedLayout, name: str | None) -> str:
    """The length group `token_group` names: a group's name or a ragged leaf's path."""
    groups: list[str] = []
    for leaf in layout.leaves:
        if leaf.ragged is not None and (leaf.ragged.group or leaf.name) not in groups:
            groups.append(leaf.ragged.group or leaf.name)
    if name is None:
        if len(groups) == 1:
            return groups[0]
        raise ValueError(
            f"batch_tokens needs token_group= when the example has several length groups "
            f"({', '.join(groups)})"
        )
    for leaf in layout.leaves:
        if leaf.ragged is not None and name in (leaf.key, leaf.name):
            return leaf.ragged.group or leaf.name
    if name in groups:
        return name
    raise ValueError(
        f"token_group {name!r} names no length group or ragged leaf; the groups are "
        f"{', '.join(groups)}"
    )


class RaggedBuffer:
    """What `echo.Server` runs on when its example has ragged leaves (see `Server`)."""

    def __init__(
        self,
        example: Any,
        batch_size: int,
        *,
        num_buffers: int,
        sampler: Any,
        max_size: int | None,
        max_bytes: int | None,
        rate_limiter: Any,
        max_times_sampled: int,
        seed: int | None,
        batch_tokens: int | None,
        token_group: str | None,
        layout: str,
        pad_to_multiple: int,
        compress: Any = None,
        policy_versions: bool = False,
        max_staleness: int | None = None,
        admission: str = "drop",
    ) -> None:
        self.layout = RaggedLayout(example)
        codecs = _codecs(self.layout, compress)
        kind, exponent = _sampler_args(sampler)
        if kind == "fifo":
            if max_size is not None:
                raise ValueError("max_size is for replay; a FIFO server holds num_buffers batches")
            capacity = batch_size * num_buffers
        elif max_size is None:
            raise ValueError("a replay sampler needs max_size (the samples the table holds)")
        else:
            capacity = max_size
        if rate_limiter is not None and not isinstance(rate_limiter, MinSize):
            raise ValueError(
                f"a server with ragged leaves takes rate_limiter=MinSize(n) or None, "
                f"got {rate_limiter!r}"
            )
        min_size = 1 if rate_limiter is None else rate_limiter.min_size
        if min_size > capacity:
            held = "max_size" if kind != "fifo" else "batch_size x num_buffers"
            raise ValueError(
                f"MinSize({min_size}) can never be reached: the table holds at most {held} "
                f"({capacity}) samples"
            )
        self.default_padded = _layout_arg(layout)
        self.pad_to_multiple = check_int("pad_to_multiple", pad_to_multiple, 1, MAX_PAD_MULTIPLE)
        tokens = None
        if batch_tokens is not None:
            rows = check_int("batch_tokens", batch_tokens, 1)
            tokens = (_token_group(self.layout, token_group), rows)
        elif token_group is not None:
            raise ValueError("token_group names the group batch_tokens counts; give batch_tokens")
        core = RaggedCore(
            self.layout.core_leaves(), kind, exponent, batch_size, capacity, max_bytes,
            tokens, min_size, max_times_sampled, seed, codecs, policy_versions, max_staleness,
            admission,
        )  # fmt: skip
        self.codecs = codecs
        self.core = core
        self.versioned = core.policy_versions
        # The sample's own leaves (a table that keeps versions stores one more, last).
        self.leaf_groups: list[int | None] = core.leaf_groups[: len(self.layout.leaves)]
        self.kind = kind
        self.capacity = capacity
        self.batch_tokens = tokens

    def submit_group(
        self,
        samples: Sequence[Any],
        timeout: float | None,
        priority: Any,
        version: int | None = None,
    ) -> int | None:
        if isinstance(samples, dict) or not isinstance(samples, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"submit_group takes a list of samples, got {type(samples).__name__}")
        flat = [self.layout.flatten(sample) for sample in samples]
        p = None if priority is None else float(priority)
        v = None if version is None else check_int("version", version, 0, 2**64 - 1)
        return self.core.submit_group(flat, timeout, p, v)

    def sample(
        self, timeout: float | None, layout: str | None, pad_to_multiple: int | None, copy: bool
    ) -> Sample | None:
        padded = self.default_padded if layout is None else _layout_arg(layout)
        multiple = (
            self.pad_to_multiple
            if pad_to_multiple is None
            else check_int("pad_to_multiple", pad_to_multiple, 1, MAX_PAD_MULTIPLE)
        )
        started = time.monotonic_ns()
        got = self.core.sample(timeout, padded, multiple)
        if got is None:
            return None
        wait_ns = time.monotonic_ns() - started
        arrays, groups, keys, probabilities, times_sampled, samples, sequence, store_size = got
        versions = None
        if self.versioned:
            versions = np.array(arrays[-1])  # its own: the column may be a view of the arena
            arrays = arrays[:-1]
        leaf_groups = self.leaf_groups
        out: list[Any] = []
        for array, group in zip(arrays, leaf_groups, strict=True):
            values = np.array(array) if copy and not array.flags.writeable else array
            if group is None:
                out.append(values)
            elif padded:
                lengths, mask = groups[group]
                out.append(Padded(values, lengths, mask))
            else:
                out.append(Packed(values, groups[group][0]))
        info = _sample_info(
            {
                "store_size": store_size,
                "sequence": sequence,
                "wait_ns": wait_ns,
                "keys": keys if self.kind != "fifo" else None,
                "probabilities": probabilities,
                "times_sampled": times_sampled,
            }
        )
        return Sample(
            self.layout.unflatten(out),
            info,
            keys,
            probabilities,
            times_sampled,
            versions=versions,
            num_samples=samples,
        )

    def stats(self, name_counts: dict[str, int]) -> SampleInfo:
        s = self.core.stats()
        fields: dict[str, Any] = {
            "store_size": s["samples"],
            "samples_submitted_total": s["submitted"],
            "notify_count": s["batches"],
            "items_sampled_total": s["sampled"],
            "evicted_total": s["evicted"],
            "removed_max_times_sampled_total": s["removed_max_times_sampled"],
            "insert_blocked_ns_total": s["insert_blocked_ns"] if self.kind != "fifo" else 0,
            "ring_blocked_ns_total": s["insert_blocked_ns"] if self.kind == "fifo" else 0,
            "active_connections": s["active_connections"],
            "v2_connections_total": s["connections_accepted"],
            "handshakes_refused_layout_total": s["handshakes_refused"],
            "samples_inserted_total": s["samples_received"],
            "shm_connections_total": s["shm_connections"],
            "sessions_resumed_total": s["sessions_resumed"],
            "connections_evicted_total": s["connections_evicted"],
            "samples_received_compressed_total": s["compressed_samples"],
            "compressed_bytes_received_total": s["compressed_bytes"],
            "params_version": self.core.params_version,
            "params_published_total": s["params_published"],
            "params_chunks_served_total": s["params_chunks_served"],
            "params_bytes_served_total": s["params_bytes_served"],
            "stored_bytes": s["arena_bytes_in_use"],
            "raw_bytes": s["raw_bytes"],
            "samples_stale_at_insert_total": s["stale_at_insert"],
            "samples_stale_at_sample_total": s["stale_at_sample"],
            "samples_versioned_total": s["versions_handed"],
            "version_lag_total": s["version_lag_sum"],
            "version_lag_max": s["version_lag_max"],
        }
        fields.update(name_counts)
        return _sample_info(fields)

    def batches(self, timeout: float | None, copy: bool) -> Iterator[Sample]:
        while (batch := self.sample(timeout, None, None, copy)) is not None:
            yield batch


def _layout_arg(layout: object) -> bool:
    """True for "padded", False for "packed"."""
    if layout not in ("packed", "padded"):
        raise ValueError(f'layout must be "packed" or "padded", got {layout!r}')
    return layout == "padded"
