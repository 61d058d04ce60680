"""The rollout-worker side helper: `TrajectoryAccumulator` fills one fixed sample over many steps.

A sample that holds a whole trajectory (say `T` steps of observations, actions and rewards,
plus the observation to bootstrap from) is assembled here step by step in pre-allocated
buffers, then sent as one sample with `TcpClient.send()` or `Server.submit()`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, cast

import numpy as np
import optree
from optree import PyTreeSpec

__all__ = ["TrajectoryAccumulator"]

NONE_IS_LEAF = False


def _path_name(path: Sequence[Any]) -> str:
    return "".join(f"[{key!r}]" for key in path)


def _flatten(tree: object) -> tuple[list[Any], PyTreeSpec]:
    return cast(
        "tuple[list[Any], PyTreeSpec]",
        optree.tree_flatten(
            tree,  # pyright: ignore[reportArgumentType, reportUnknownArgumentType]
            none_is_leaf=NONE_IS_LEAF,
        ),
    )


def _without_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    start = 0
    while start < len(shape) and shape[start] == 1:
        start += 1
    return shape[start:]


class _Timescale:
    """One top-level key of the example: its buffers, slot views and fill count."""

    __slots__ = (
        "buffered",
        "buffers",
        "capacity",
        "dtypes",
        "flat_keys",
        "flat_keyset",
        "label",
        "leaf_names",
        "name",
        "size",
        "slot_shapes",
        "slots",
        "stacked",
        "targets",
        "treespec",
    )

    def __init__(
        self,
        name: Hashable,
        subtree: object,
        paths: list[tuple[Any, ...]],
        leaves: list[np.ndarray[Any, Any]],
    ) -> None:
        self.name = name
        self.label = repr(name)
        self.leaf_names = [_path_name(path) for path in paths]
        _, self.treespec = _flatten(subtree)
        self.dtypes: list[np.dtype[Any]] = [leaf.dtype for leaf in leaves]
        shapes = [tuple(int(d) for d in leaf.shape) for leaf in leaves]
        # The slot axis: the shared leading dim of every leaf. A 0-d leaf has none, so a
        # timescale holding one has no slot axis and stores one item shaped like the example.
        self.stacked = all(len(shape) > 0 for shape in shapes)
        if self.stacked:
            leading = {shape[0] for shape in shapes}
            if len(leading) > 1:
                dims = ", ".join(
                    f"{leaf_name}: {shape[0]}"
                    for leaf_name, shape in zip(self.leaf_names, shapes, strict=True)
                )
                raise ValueError(
                    f"timescale {self.label}: every leaf of a buffered timescale needs the same "
                    f"leading dim (its number of slots), got {dims}; for a single item, give "
                    "every leaf a leading dim of 1"
                )
            self.capacity = shapes[0][0]
            self.slot_shapes: list[tuple[int, ...]] = [shape[1:] for shape in shapes]
        else:
            self.capacity = 1
            self.slot_shapes = shapes
        # Leading dim 0 is a buffered timescale without slots: always full, never added to.
        self.buffered = self.capacity != 1
        # An item leaf fits a slot when the shapes agree once leading dims of 1 are dropped
        # from both: numpy assignment without its broadcasting, which would repeat values.
        self.targets = [_without_leading_ones(shape) for shape in self.slot_shapes]
        self.size = 0

        # Pre-allocated once; `add()` only copies into these slot views.
        self.buffers: list[np.ndarray[Any, Any]] = [
            np.zeros(shape, dtype) for shape, dtype in zip(shapes, self.dtypes, strict=True)
        ]
        if self.stacked:
            self.slots = [[buf[i, ...] for buf in self.buffers] for i in range(self.capacity)]
        else:
            self.slots = [list(self.buffers)]

        # Fast path for a flat dict of arrays: look the leaves up by key in optree's order.
        self.flat_keys: tuple[Any, ...] | None = None
        # (`None` values are empty nodes: such a dict is not flat, its items must keep them.)
        if (
            type(subtree) is dict
            and len(cast("dict[Any, Any]", subtree)) == len(paths)
            and all(len(path) == 2 for path in paths)
        ):
            self.flat_keys = tuple(path[1] for path in paths)
        self.flat_keyset = frozenset(self.flat_keys or ())

    def flatten(self, item: object) -> list[Any]:
        """The item's values at the timescale's leaves, in order; ValueError if the structure
        differs above them (a value at a leaf may be a list or any other array-like)."""
        if self.flat_keys is not None and type(item) is dict:
            flat = cast("dict[Any, Any]", item)
            if flat.keys() == self.flat_keyset:
                return [flat[key] for key in self.flat_keys]
        try:
            return cast(
                "list[Any]",
                self.treespec.flatten_up_to(item),  # pyright: ignore[reportArgumentType]
            )
        except ValueError:
            _, treespec = _flatten(cast("object", item))
            raise ValueError(
                f"add({self.label}): item structure does not match timescale {self.label}: "
                f"expected {self.treespec}, got {treespec}"
            ) from None

    def prepare(self, item: object) -> list[Any]:
        """The item's leaves, each ready to copy into its slot; nothing is written.

        Raises TypeError (not an array, or a cast that changes the kind), ValueError
        (structure or shape) or OverflowError (an integer that does not fit the leaf's dtype).
        """
        values = self.flatten(item)
        for i, value in enumerate(values):
            if isinstance(value, (np.ndarray, np.generic)):
                arr = cast("np.ndarray[Any, Any]", value)
                if arr.dtype == self.dtypes[i] and arr.shape == self.slot_shapes[i]:
                    continue  # the common case: copied as it is
            values[i] = self.convert(i, cast("object", value))
        return values

    def convert(self, i: int, value: object) -> np.ndarray[Any, Any]:
        """Checks one leaf that is not an exact match, and returns it as an array for its slot."""
        where = f"add({self.label}): leaf {self.leaf_names[i]}"
        dtype = self.dtypes[i]
        try:
            arr: np.ndarray[Any, Any] = np.asarray(value)
        except (TypeError, ValueError) as err:  # a ragged list, or an array-like that fails
            raise TypeError(
                f"{where}: expected a numpy array, or a value numpy turns into one, got "
                f"{type(value).__name__} ({err})"
            ) from None
        if arr.dtype.hasobject and not dtype.hasobject:
            if isinstance(value, int):  # beyond int64 and uint64
                raise OverflowError(
                    f"{where}: expected a value that fits dtype {dtype}, got {value}"
                )
            raise TypeError(
                f"{where}: expected a numpy array (or a scalar or list numpy turns into one) of "
                f"dtype {dtype}, got {type(value).__name__}"
            )
        src = arr.dtype
        integers = src.kind in "iu" and dtype.kind in "iub"
        if not (integers or np.can_cast(src, dtype, "same_kind")):
            raise TypeError(
                f"{where}: expected dtype {dtype}, or one that numpy casts to it within its "
                f"kind ('same_kind'), got {src}; convert it first (.astype)"
            )
        # Leading 1s aside, the shapes agree: `np.copyto` adds or drops those, nothing else.
        if _without_leading_ones(arr.shape) != self.targets[i]:
            shape = self.slot_shapes[i]
            expected = str(shape)
            if self.stacked:
                expected += f" (one slot of the {self.buffers[i].shape} leaf)"
            elif shape:
                expected += f" (the whole leaf: a 0-d leaf makes {self.label} single-item)"
            raise ValueError(f"{where}: expected shape {expected}, got {arr.shape}")
        if integers and arr.size and not np.can_cast(src, dtype, "safe"):
            low, high = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
            least, most = int(arr.min()), int(arr.max())
            if least < low or most > high:
                got = f"{least}" if least == most else f"values from {least} to {most}"
                raise OverflowError(
                    f"{where}: expected values that fit dtype {dtype} ({low} to {high}), got {got}"
                )
        return arr


class TrajectoryAccumulator:
    """Fills one fixed sample (a trajectory) over many steps, in pre-allocated buffers.

    The example is a dict whose top-level keys are *timescales*. Each value is a pytree
    (nested dict / tuple / list / namedtuple, as optree understands it; `None` is an empty
    node) of numpy arrays; its leaves fix the shapes and dtypes that `build()` returns.

    - **Buffered** timescale: every leaf has the same leading dim `N > 1`. It has `N` slots;
      each `add()` fills the next one with an item shaped like the leaves without their
      leading dim (`obs` of shape `(T, 4)` takes items of shape `(4,)`).
    - **Single-item** timescale, capacity 1, one `add()` until the next `build()`/`reset()`:
        - every leaf has leading dim 1: the item is shaped like the leaves without that dim
          (like one slot of a buffered timescale: `(1, 4)` takes `(4,)`);
        - some leaf is 0-d: the item is shaped exactly like the example's leaves.

    An item has the timescale's structure. Each of its leaves is a numpy array, numpy scalar,
    Python scalar or list, as `id-echo` 0.2.1 accepted them, with two rules where numpy
    assignment would silently change the data:

    - shape: the slot's shape, with or without leading dims of 1 (`(4,)` or `(1, 4)` for a
      `(4,)` slot); nothing is broadcast, so a `()` item does not fill a `(4,)` slot.
    - dtype: the leaf's, or one numpy casts to it within its kind (`float64` to `float32`,
      `int` to `float`, `bool` to anything); integers of another width or sign only if every
      value fits (`OverflowError` otherwise). Casts that change the kind (`float` to `int` or
      `bool`, `complex` to `float`, text, objects) are refused.

    `build()` needs every timescale full (every slot of a buffered one, and an item in every
    single-item one), so a sample with stale or missing steps is never built. It returns views
    of the internal buffers, which the next `add()` overwrites: send or copy the result before
    adding again.

    Not thread-safe: use one accumulator per environment (or per thread).

    Args:
        example: A dict of timescales, each a pytree of numpy arrays (a numpy scalar counts as
            a 0-d array). The values are unused.

    Raises:
        TypeError: `example` is not a dict; a leaf is not a numpy array or numpy scalar.
        ValueError: A timescale has no leaves; the leaves of a timescale without 0-d leaves
            have different leading dims.

    Example:
        ```python
        acc = TrajectoryAccumulator({
            "steps": {"obs": np.zeros((T, 4), np.float32), "reward": np.zeros((T,), np.float32)},
            "bootstrap": {"obs": np.zeros((1, 4), np.float32)},
        })
        for t in range(T):
            acc.add("steps", {"obs": obs, "reward": np.float32(reward)})
            obs, reward = env.step(policy(obs))
        acc.add("bootstrap", {"obs": obs})
        client.send(acc.build())
        ```
    """

    def __init__(self, example: Any) -> None:
        if not isinstance(example, dict):
            raise TypeError(
                "example must be a dict of timescales (name -> pytree of numpy arrays), "
                f"got {type(example).__name__}"
            )
        timescales = cast("dict[Any, Any]", example)
        paths, leaves, treespec = cast(
            "tuple[list[tuple[Any, ...]], list[object], PyTreeSpec]",
            optree.tree_flatten_with_path(
                timescales,  # pyright: ignore[reportArgumentType]
                none_is_leaf=NONE_IS_LEAF,
            ),
        )
        if any(not path for path in paths):  # a dict subclass optree does not know is a leaf
            raise TypeError(
                f"example must be a dict of timescales that optree flattens as a dict, got "
                f"{type(timescales).__name__}"
            )
        arrays: list[np.ndarray[Any, Any]] = []
        for path, leaf in zip(paths, leaves, strict=True):
            if not isinstance(leaf, (np.ndarray, np.generic)):
                raise TypeError(
                    f"example leaf {_path_name(path)}: expected a numpy.ndarray or numpy "
                    f"scalar, got {type(leaf).__name__}"
                )
            arrays.append(np.asarray(cast("np.ndarray[Any, Any]", leaf)))
        # optree lists each timescale's leaves together, in the order it flattens the subtree
        # alone: group them by their first path entry, keeping that order for `build()`.
        groups: dict[Any, list[int]] = {}
        for i, path in enumerate(paths):
            groups.setdefault(path[0], []).append(i)
        for name in timescales:
            if name not in groups:
                raise ValueError(
                    f"timescale {name!r} has no leaves: it needs at least one numpy array"
                )
        self._treespec: PyTreeSpec = treespec
        self._order: list[_Timescale] = [
            _Timescale(
                name,
                timescales[name],
                [paths[i] for i in indices],
                [arrays[i] for i in indices],
            )
            for name, indices in groups.items()
        ]
        by_name = {ts.name: ts for ts in self._order}
        self._timescales: dict[Any, _Timescale] = {name: by_name[name] for name in timescales}
        # Every buffer in optree's leaf order, for `build()`.
        self._buffers = [buf for ts in self._order for buf in ts.buffers]

    def _get(self, name: Hashable) -> _Timescale:
        try:
            return self._timescales[name]
        except KeyError:
            known = ", ".join(repr(key) for key in self._timescales) or "no timescales"
            raise KeyError(f"unknown timescale {name!r}: the example has {known}") from None

    @property
    def timescales(self) -> tuple[Any, ...]:
        """The timescale names, in the example's order."""
        return tuple(self._timescales)

    def capacity(self, name: Hashable) -> int:
        """Slots of timescale `name`: `N` for a buffered one, 1 for a single-item one.

        Raises:
            KeyError: `name` is not a timescale of the example.
        """
        return self._get(name).capacity

    def size(self, name: Hashable) -> int:
        """Slots of timescale `name` filled since the last `build()` or `reset()`.

        Raises:
            KeyError: `name` is not a timescale of the example.
        """
        return self._get(name).size

    def is_buffered(self, name: Hashable) -> bool:
        """Whether timescale `name` is buffered (`N > 1` slots, or 0) rather than single-item.

        Raises:
            KeyError: `name` is not a timescale of the example.
        """
        return self._get(name).buffered

    @property
    def ready(self) -> bool:
        """Whether every timescale is full, so that `build()` succeeds."""
        return all(ts.size == ts.capacity for ts in self._order)

    def add(self, name: Hashable, item: Any) -> None:
        """Copies `item` into the next slot of timescale `name`.

        A buffered timescale fills its slots in order; a single-item timescale takes one item.
        The item is checked completely before anything is written, so a rejected `add()`
        changes nothing.

        Args:
            name: A top-level key of the example.
            item: A pytree with the timescale's structure whose leaves fit the example's slot
                shapes and dtypes (see the class docstring).

        Raises:
            KeyError: `name` is not a timescale of the example.
            IndexError: The timescale is full (every slot of a buffered one, or the item of a
                single-item one): `build()` or `reset()` first.
            ValueError: The structure or a leaf's shape differs.
            TypeError: A leaf is not array-like, or its dtype would have to change kind.
            OverflowError: An integer leaf has a value that its slot's dtype cannot hold.
        """
        ts = self._get(name)
        if ts.size == ts.capacity:
            raise IndexError(
                f"add({ts.label}): timescale {ts.label} is full ({ts.size} of {ts.capacity} "
                "slots): call build() or reset() first"
            )
        values = ts.prepare(item)
        for dst, value in zip(ts.slots[ts.size], values, strict=True):
            np.copyto(dst, value, casting="unsafe")  # `prepare` allowed only lossless kinds
        ts.size += 1

    def build(self) -> Any:
        """Returns the filled sample and empties every timescale for the next trajectory.

        The result has the example's structure, shapes and dtypes. Its leaves are views of the
        internal buffers, not copies: the next `add()` overwrites them. Send or submit it (both
        copy) or `np.copy` it before adding again. Writing to them is allowed; it cannot leak
        into a later trajectory, which `build()` returns only once every slot is written again.

        Raises:
            ValueError: A timescale is not full (the message names each one and how many of
                its slots are filled); nothing is reset then.
        """
        missing = [ts for ts in self._timescales.values() if ts.size < ts.capacity]
        if missing:
            detail = ", ".join(
                f"{ts.label} has {ts.size} of {ts.capacity} slots filled" for ts in missing
            )
            raise ValueError(
                f"build(): not every timescale is full: {detail}; add() the missing items "
                "or reset() to drop this trajectory"
            )
        tree = self._treespec.unflatten([buf[...] for buf in self._buffers])
        self.reset()
        return tree

    def reset(self) -> None:
        """Empties every timescale without building (the buffers keep their old values)."""
        for ts in self._order:
            ts.size = 0

    def __repr__(self) -> str:
        fill = ", ".join(f"{ts.label}: {ts.size}/{ts.capacity}" for ts in self._timescales.values())
        return f"TrajectoryAccumulator({fill})"
