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
            if self.capacity == 0:
                raise ValueError(
                    f"timescale {self.label}: a leading dim of 0 gives no slots; use N > 1 for "
                    "a buffered timescale, or 1 for a single item"
                )
            self.slot_shapes = [shape[1:] for shape in shapes]
        else:
            self.capacity = 1
            self.slot_shapes = shapes
        self.buffered = self.capacity > 1
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
        """The leaves of `item` in the timescale's order; ValueError if the structure differs."""
        if self.flat_keys is not None and type(item) is dict:
            flat = cast("dict[Any, Any]", item)
            if flat.keys() == self.flat_keyset:
                return [flat[key] for key in self.flat_keys]
        return self.flatten_checked(cast("object", item))

    def flatten_checked(self, item: object) -> list[Any]:
        leaves, treespec = _flatten(item)
        if treespec != self.treespec:
            raise ValueError(
                f"add({self.label}): item structure does not match timescale {self.label}: "
                f"expected {self.treespec}, got {treespec}"
            )
        return leaves

    def check(self, item: object, values: list[Any]) -> None:
        """Raises TypeError/ValueError unless `values` fit one slot (nothing is written)."""
        for i, value in enumerate(values):
            name = self.leaf_names[i]
            if not isinstance(value, (np.ndarray, np.generic)):
                self.flatten_checked(item)  # a nested container is a structure error
                raise TypeError(
                    f"add({self.label}): leaf {name}: expected a numpy.ndarray, "
                    f"got {type(value).__name__}"
                )
            arr = cast("np.ndarray[Any, Any]", value)
            if arr.dtype != self.dtypes[i]:
                raise TypeError(
                    f"add({self.label}): leaf {name}: expected dtype {self.dtypes[i]}, "
                    f"got {arr.dtype}"
                )
            if arr.shape != self.slot_shapes[i]:
                expected = str(self.slot_shapes[i])
                if self.stacked:
                    expected += f" (one slot of the {self.buffers[i].shape} leaf)"
                elif self.slot_shapes[i]:
                    expected += f" (the whole leaf: a 0-d leaf makes {self.label} single-item)"
                raise ValueError(
                    f"add({self.label}): leaf {name}: expected shape {expected}, got {arr.shape}"
                )


class TrajectoryAccumulator:
    """Fills one fixed sample (a trajectory) over many steps, in pre-allocated buffers.

    The example is a dict whose top-level keys are *timescales*. Each value is a pytree
    (nested dict / tuple / list / namedtuple, as optree understands it; `None` is an empty
    node) of numpy arrays; its leaves fix the shapes and dtypes that `build()` returns.

    - **Buffered** timescale: every leaf has the same leading dim `N > 1`. It has `N` slots;
      each `add()` fills the next one with an item shaped like the leaves without their
      leading dim (`obs` of shape `(T, 4)` takes items of shape `(4,)`).
    - **Single-item** timescale, capacity 1; `add()` replaces its item:
        - every leaf has leading dim 1: the item is shaped like the leaves without that dim
          (like one slot of a buffered timescale: `(1, 4)` takes `(4,)`);
        - some leaf is 0-d: the item is shaped exactly like the example's leaves.

    Items must match exactly: same structure, and each leaf a numpy array (or a numpy scalar
    for a 0-d slot) of the example's dtype and slot shape. Nothing is cast or broadcast.

    `build()` needs every timescale full (every slot of a buffered one, and an item in every
    single-item one), so a sample with stale or missing steps is never built. It returns read-
    only views of the internal buffers, which the next `add()` overwrites: send or copy the
    result before adding again.

    Not thread-safe: use one accumulator per environment (or per thread).

    Args:
        example: A dict of timescales, each a pytree of numpy arrays. The values are unused.

    Raises:
        TypeError: `example` is not a dict; a leaf is not a numpy array or has an object dtype.
        ValueError: `example` has no timescales; a timescale has no leaves; the leaves of a
            timescale without 0-d leaves have different leading dims, or leading dim 0.

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
        if not timescales:
            raise ValueError("example has no timescales: it needs at least one key")
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
            if not isinstance(leaf, np.ndarray):
                raise TypeError(
                    f"example leaf {_path_name(path)}: expected a numpy.ndarray, "
                    f"got {type(leaf).__name__}"
                )
            arr = cast("np.ndarray[Any, Any]", leaf)
            if arr.dtype.hasobject:
                raise TypeError(
                    f"example leaf {_path_name(path)}: dtype {arr.dtype} holds Python objects, "
                    "which cannot be sent as a sample"
                )
            arrays.append(arr)
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
        # What `build()` hands out: read-only views of every buffer, in optree's leaf order.
        views: list[np.ndarray[Any, Any]] = []
        for ts in self._order:
            for buf in ts.buffers:
                view: np.ndarray[Any, Any] = buf[...]
                view.flags.writeable = False
                views.append(view)
        self._views = views

    def _get(self, name: Hashable) -> _Timescale:
        try:
            return self._timescales[name]
        except KeyError:
            known = ", ".join(repr(key) for key in self._timescales)
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
        """Whether timescale `name` is buffered (`N > 1` slots) rather than single-item.

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

        A buffered timescale fills its slots in order; a single-item timescale's item is
        replaced. The item is checked completely before anything is written, so a rejected
        `add()` changes nothing.

        Args:
            name: A top-level key of the example.
            item: A pytree with the timescale's structure whose leaves have the example's
                dtypes and slot shapes (see the class docstring).

        Raises:
            KeyError: `name` is not a timescale of the example.
            IndexError: The buffered timescale is full: `build()` or `reset()` first.
            ValueError: The structure or a leaf's shape differs.
            TypeError: A leaf is not a numpy array or has another dtype.
        """
        ts = self._get(name)
        if ts.size == ts.capacity and ts.buffered:
            raise IndexError(
                f"add({ts.label}): timescale {ts.label} is full ({ts.size} of {ts.capacity} "
                "slots): call build() or reset() first"
            )
        values = ts.flatten(item)
        ts.check(item, values)
        slot = ts.size if ts.buffered else 0
        for dst, value in zip(ts.slots[slot], values, strict=True):
            np.copyto(dst, value, casting="no")
        ts.size = slot + 1

    def build(self) -> Any:
        """Returns the filled sample and empties every timescale for the next trajectory.

        The result has the example's structure, shapes and dtypes. Its leaves are read-only
        views of the internal buffers, not copies: the next `add()` overwrites them. Send or
        submit it (both copy) or `np.copy` it before adding again.

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
        tree = self._treespec.unflatten(self._views)
        self.reset()
        return tree

    def reset(self) -> None:
        """Empties every timescale without building (the buffers keep their old values)."""
        for ts in self._order:
            ts.size = 0

    def __repr__(self) -> str:
        fill = ", ".join(f"{ts.label}: {ts.size}/{ts.capacity}" for ts in self._timescales.values())
        return f"TrajectoryAccumulator({fill})"
