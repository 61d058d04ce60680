"""Pytree bookkeeping: the one place that knows how samples are flattened.

The Rust core sees a list of leaves in a fixed order; this module turns a user's pytree
(nested dict / tuple / list / namedtuple, as optree understands it) into that list and back,
and produces readable leaf names for error messages.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import optree
from optree import PyTreeSpec

__all__ = ["LeafSpec", "TreeLayout"]

NONE_IS_LEAF = False


def _path_name(path: Sequence[Any]) -> str:
    if not path:
        return "<root>"
    return "".join(f"[{key!r}]" for key in path)


class LeafSpec:
    """Shape, dtype and name of one leaf of the example."""

    __slots__ = ("dtype", "name", "shape")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"LeafSpec({self.name}, shape={self.shape}, dtype={self.dtype})"


class TreeLayout:
    """The structure of the example pytree and how to flatten samples that match it."""

    def __init__(self, example: object) -> None:
        paths, leaves, treespec = cast(
            "tuple[list[tuple[Any, ...]], list[object], PyTreeSpec]",
            optree.tree_flatten_with_path(
                example,  # pyright: ignore[reportArgumentType, reportUnknownArgumentType]
                none_is_leaf=NONE_IS_LEAF,
            ),
        )
        specs: list[LeafSpec] = []
        for path, leaf in zip(paths, leaves, strict=True):
            name = _path_name(path)
            if not isinstance(leaf, np.ndarray):
                raise TypeError(
                    f"example leaf {name}: expected a numpy.ndarray, got {type(leaf).__name__}"
                )
            arr: np.ndarray[Any, Any] = leaf  # pyright: ignore[reportUnknownVariableType]
            if arr.dtype.hasobject:
                raise TypeError(
                    f"example leaf {name}: dtype {arr.dtype} holds Python objects, "
                    "which cannot be stored in a ring buffer"
                )
            specs.append(LeafSpec(name, tuple(int(d) for d in arr.shape), arr.dtype))
        if not specs:
            raise ValueError("the example has no leaves: it needs at least one numpy array")
        if all(int(np.prod(s.shape)) * s.dtype.itemsize == 0 for s in specs):
            raise ValueError(
                "every leaf of the example is empty (0 bytes in total): there is nothing to store"
            )
        self.treespec: PyTreeSpec = treespec
        self.leaves = specs
        # Each leaf's path (the keys and indices leading to it), for checkpoint manifests.
        self.paths: list[tuple[Any, ...]] = [tuple(p) for p in paths]
        # Fast path for the most common sample, a flat dict of arrays: look the leaves up by
        # key in optree's order instead of calling into optree for every sample.
        self._flat_keys: tuple[Any, ...] | None = None
        # Every key must hold a leaf: a `None` value is an empty subtree that the key lookup
        # would not check.
        flat = type(example) is dict and len(cast("dict[Any, Any]", example)) == len(paths)
        if flat and all(len(p) == 1 for p in paths):
            self._flat_keys = tuple(p[0] for p in paths)
        self._flat_keyset = frozenset(self._flat_keys or ())

    @property
    def flat_keys(self) -> list[str] | None:
        """The example's keys in leaf order, if it is a flat dict of arrays with str keys.

        Interned, as the keys of dict literals are: looking one up in a sample's dict then
        finds the very object, without comparing the strings' bytes."""
        keys = self._flat_keys
        if keys is None or not all(isinstance(k, str) for k in keys):
            return None
        return [sys.intern(str(k)) for k in keys]

    def flatten(self, sample: object) -> list[Any]:
        """The leaves of `sample` in the example's order; ValueError if the structure differs.

        A flat-dict sample is looked up by key, any other by the example's treespec
        (`flatten_up_to`, which follows the cached structure instead of discovering the
        sample's: several times cheaper than flattening and comparing treespecs). Neither
        checks that the values at leaf positions are leaves; when the native check then
        rejects a value, call `check_structure` to report a nested container or `None` there
        as the structure mismatch it is. Only a failure runs the full flatten, to explain it.
        """
        if self._flat_keys is not None and type(sample) is dict:
            flat = cast("dict[Any, Any]", sample)
            if flat.keys() == self._flat_keyset:
                return [flat[k] for k in self._flat_keys]
        try:
            return cast(
                "list[Any]",
                self.treespec.flatten_up_to(sample),  # pyright: ignore[reportArgumentType]
            )
        except (ValueError, TypeError):
            return self._flatten_checked(cast("object", sample))

    def check_structure(self, sample: object) -> None:
        """Raises ValueError if `sample`'s structure differs from the example's."""
        self._flatten_checked(sample)

    def _flatten_checked(self, sample: object) -> list[Any]:
        leaves, treespec = cast(
            "tuple[list[Any], PyTreeSpec]",
            optree.tree_flatten(
                sample,  # pyright: ignore[reportArgumentType, reportUnknownArgumentType]
                none_is_leaf=NONE_IS_LEAF,
            ),
        )
        if treespec != self.treespec:
            raise ValueError(
                f"sample structure does not match the example: expected {self.treespec}, "
                f"got {treespec}"
            )
        return leaves

    def unflatten(self, leaves: list[Any]) -> Any:
        """A pytree of the example's structure holding `leaves`."""
        return self.treespec.unflatten(leaves)
