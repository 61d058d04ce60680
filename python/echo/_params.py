"""The learner's published parameters as the native layer takes them and gives them back:
leaves checked against the layout the first publish fixed, a copy of the latest version kept
for checkpoints (`ParamsChannel`, `Server.publish`'s side), and a fetched version's bytes as
a pytree of views."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from echo._pytree import LeafSpec, TreeLayout
from echo._validate import check_int


@dataclasses.dataclass(frozen=True)
class Published:
    """One published version as a checkpoint stores it: each leaf's name (its path in the
    pytree) and array, in the pytree's order."""

    version: int
    names: tuple[str, ...]
    leaves: tuple[np.ndarray[Any, Any], ...]


def param_parts(
    layout: TreeLayout,
    params: Any,
    specs: list[LeafSpec] | None = None,
    whose: str = "the first publish's",
) -> list[tuple[list[int], int, Any]]:
    """`params`' leaves as `(shape, itemsize, bytes)` for `ServerCore._publish`, each checked
    against `specs` (default: `layout`'s leaves, which are `whose`; TypeError for a leaf that
    is not an array or has another dtype, ValueError for another structure or shape, naming
    the leaf)."""
    leaves = layout.flatten(params)
    if len(leaves) != len(layout.leaves):
        layout.check_structure(params)
    specs = layout.leaves if specs is None else specs
    parts: list[tuple[list[int], int, Any]] = []
    for spec, leaf in zip(specs, leaves, strict=True):
        if not isinstance(leaf, np.ndarray):
            raise TypeError(
                f"publish(): leaf {spec.name}: expected a numpy.ndarray, got {type(leaf).__name__}"
            )
        array: np.ndarray[Any, Any] = leaf  # pyright: ignore[reportUnknownVariableType]
        if array.dtype != spec.dtype:
            raise TypeError(
                f"publish(): leaf {spec.name}: expected dtype {spec.dtype} ({whose}), "
                f"got {array.dtype}"
            )
        if array.shape != spec.shape:
            raise ValueError(
                f"publish(): leaf {spec.name}: expected shape {spec.shape} ({whose}), "
                f"got {array.shape}"
            )
        flat = np.frombuffer(np.ascontiguousarray(array), dtype=np.uint8)
        parts.append((list(spec.shape), spec.dtype.itemsize, flat))
    return parts


class ParamsChannel:
    """`Server.publish`'s side of the parameter channel: the layout the first publish fixed
    (or the leaves a restored checkpoint published, until the next publish fixes the
    structure), and a copy of the latest published version for checkpoints.

    The copy costs the parameters' size once more in memory, and one more copy per publish:
    the core keeps its own two versions and gives none back, and the caller's arrays may be
    written in place after `publish()` returns (a PyTorch model), so a reference would not do.
    """

    def __init__(self, core: Any) -> None:
        self._core = core
        self._layout: TreeLayout | None = None
        # Set by `restore()` until a publish fixes the structure: the restored leaves' names,
        # dtypes and shapes, which that publish's leaves must have (a checkpoint stores no
        # pytree structure: a namedtuple or flax tree could not be rebuilt from it).
        self._restored: list[LeafSpec] | None = None
        # Guards `_latest`: publishers may race, and the newest version wins.
        self._lock = threading.Lock()
        self._latest: Published | None = None

    def publish(self, params: Any, version: int | None) -> int:
        """As `Server.publish`."""
        if version is not None:
            version = check_int("version", version, 1, 2**64 - 1)
        layout = self._layout or TreeLayout(params)
        restored = self._restored if self._layout is None else None
        if restored is None:
            parts = param_parts(layout, params)
        else:
            if len(layout.leaves) != len(restored):
                raise ValueError(
                    f"publish(): {len(layout.leaves)} leaves, but the parameters restored "
                    f"from the checkpoint have {len(restored)}: the first publish after a "
                    "restore must have the checkpoint's leaves"
                )
            specs = [
                LeafSpec(s.name, r.shape, r.dtype)
                for s, r in zip(layout.leaves, restored, strict=True)
            ]
            parts = param_parts(layout, params, specs, "the checkpoint's")
        # Our own copy, which the core copies from: the latest version for checkpoints.
        copies: list[npt.NDArray[np.uint8]] = [np.array(flat, np.uint8) for _, _, flat in parts]
        published = int(
            self._core._publish(
                [(shape, size, c) for (shape, size, _), c in zip(parts, copies, strict=True)],
                version,
            )
        )
        self._layout = layout
        leaves = tuple(
            np.reshape(np.frombuffer(c, dtype=spec.dtype), spec.shape)
            for spec, c in zip(layout.leaves, copies, strict=True)
        )
        self._keep(Published(published, tuple(s.name for s in layout.leaves), leaves))
        return published

    def _keep(self, published: Published) -> None:
        with self._lock:
            if self._latest is None or published.version > self._latest.version:
                self._latest = published

    def latest(self) -> Published | None:
        """The latest published version (`None` before the first)."""
        with self._lock:
            return self._latest

    def restore(self, published: Published | None) -> None:
        """Publishes a checkpoint's parameters again, with their version (nothing for
        `None`): what this server's workers fetch until the learner publishes anew."""
        if published is None:
            return
        parts = [
            (list(a.shape), a.dtype.itemsize, np.frombuffer(np.ascontiguousarray(a), np.uint8))
            for a in published.leaves
        ]
        self._core._publish(parts, published.version)
        self._restored = [
            LeafSpec(name, tuple(int(d) for d in a.shape), a.dtype)
            for name, a in zip(published.names, published.leaves, strict=True)
        ]
        self._keep(published)


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
