"""The learner's published parameters as the native layer takes them and gives them back:
leaves checked against the layout the first publish fixed, and a fetched version's bytes
as a pytree of views."""

from __future__ import annotations

from typing import Any

import numpy as np

from echo._pytree import TreeLayout


def param_parts(layout: TreeLayout, params: Any) -> list[tuple[list[int], int, Any]]:
    """`params`' leaves as `(shape, itemsize, bytes)` for `ServerCore._publish`, each checked
    against `layout` (TypeError for a leaf that is not an array or has another dtype,
    ValueError for another structure or shape, naming the leaf)."""
    leaves = layout.flatten(params)
    if len(leaves) != len(layout.leaves):
        layout.check_structure(params)
    parts: list[tuple[list[int], int, Any]] = []
    for spec, leaf in zip(layout.leaves, leaves, strict=True):
        if not isinstance(leaf, np.ndarray):
            raise TypeError(
                f"publish(): leaf {spec.name}: expected a numpy.ndarray, got {type(leaf).__name__}"
            )
        array: np.ndarray[Any, Any] = leaf  # pyright: ignore[reportUnknownVariableType]
        if array.dtype != spec.dtype:
            raise TypeError(
                f"publish(): leaf {spec.name}: expected dtype {spec.dtype} (the first "
                f"publish's), got {array.dtype}"
            )
        if array.shape != spec.shape:
            raise ValueError(
                f"publish(): leaf {spec.name}: expected shape {spec.shape} (the first "
                f"publish's), got {array.shape}"
            )
        flat = np.frombuffer(np.ascontiguousarray(array), dtype=np.uint8)
        parts.append((list(spec.shape), spec.dtype.itemsize, flat))
    return parts


def param_sizes(layout: TreeLayout) -> list[int]:
    """Bytes of each leaf of `layout`."""
    return [int(np.prod(s.shape)) * s.dtype.itemsize for s in layout.leaves]


def param_tree(layout: TreeLayout, data: Any) -> Any:
    """A fetched version's bytes (`data`, one buffer) as a pytree of `layout`: views of it in
    each leaf's dtype and shape."""
    leaves: list[Any] = []
    offset = 0
    for spec, size in zip(layout.leaves, param_sizes(layout), strict=True):
        leaf: np.ndarray[Any, Any] = np.frombuffer(
            data, dtype=spec.dtype, count=size // spec.dtype.itemsize, offset=offset
        )
        leaves.append(np.reshape(leaf, spec.shape))
        offset += size
    return layout.unflatten(leaves)
