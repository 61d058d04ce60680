"""The learner's published parameters as the native layer takes them and gives them back:
leaves checked against the layout the first publish fixed, a copy of the latest version kept
for checkpoints (`ParamsChannel`, `Server.publish`'s side), and a fetched version's bytes as
a pytree of views."""

from __future__ import annotations

import ast
import dataclasses
import json
import threading
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import optree

from echo._pytree import NONE_IS_LEAF, LeafSpec, TreeLayout
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
    try:
        leaves = layout.flatten(params)
        if len(leaves) != len(layout.leaves):
            layout.check_structure(params)
    except ValueError:
        got = optree.tree_structure(params, none_is_leaf=NONE_IS_LEAF)  # pyright: ignore[reportArgumentType, reportUnknownArgumentType]
        raise ValueError(
            f"publish(): the parameters' structure does not match {whose}: expected "
            f"{layout.treespec}, got {got}"
        ) from None
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

    def publish(self, params: Any, version: int | None, compress: Any = None) -> int:
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
        # The first publish (and the first after a restore) fixes the structure: workers
        # without a `params_example` learn it from this description.
        described = describe(layout.paths, layout.leaves) if self._layout is None else None
        published = int(
            self._core._publish(
                [(shape, size, c) for (shape, size, _), c in zip(parts, copies, strict=True)],
                version,
                described,
                compress,
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
        specs = [
            LeafSpec(name, tuple(int(d) for d in a.shape), a.dtype)
            for name, a in zip(published.names, published.leaves, strict=True)
        ]
        try:
            described = describe(paths_of_names(published.names), specs)
        except (SyntaxError, ValueError):
            described = None  # names not of TreeLayout's making: workers need an example
        self._core._publish(parts, published.version, described)
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


# The format of the description a learner serves with its parameters (`describe`).
_DESCRIPTION_FORMAT = "echo-params-layout"


def describe(paths: list[tuple[Any, ...]], leaves: list[LeafSpec]) -> bytes:
    """The parameters' description workers without a `params_example` fetch: each leaf's
    path (dict keys and sequence indices), dtype and shape, in the pytree's order, as JSON."""
    return json.dumps(
        {
            "format": _DESCRIPTION_FORMAT,
            "version": 1,
            "leaves": [
                {
                    "path": [k if isinstance(k, (str, int)) else str(k) for k in path],
                    "dtype": np.lib.format.dtype_to_descr(spec.dtype),
                    "shape": list(spec.shape),
                }
                for path, spec in zip(paths, leaves, strict=True)
            ],
        }
    ).encode()


def paths_of_names(names: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Leaf paths from their names as `TreeLayout` writes them (`['layer'][0]`): what a
    checkpoint keeps of a published pytree's structure."""
    paths: list[tuple[Any, ...]] = []
    for name in names:
        node: ast.expr = ast.parse("x" + name if name != "<root>" else "x", mode="eval").body
        keys: list[Any] = []
        while isinstance(node, ast.Subscript):
            keys.append(ast.literal_eval(node.slice))
            node = node.value
        paths.append(tuple(reversed(keys)))
    return paths


def layout_of_description(description: bytes) -> TreeLayout:
    """The layout a learner's description (`describe`) gives: nested dicts (str keys) and
    lists (int keys) of arrays, in the learner's leaf order.

    Raises:
        ValueError: The description is empty or not one, or its structure cannot be rebuilt
            in the same leaf order (a namedtuple or a custom node: pass `params_example`).
    """
    if not description:
        raise ValueError(
            "params(): the learner did not describe its parameters (it published none with a "
            "structure yet): pass TcpClient(..., params_example=<a pytree like them>)"
        )
    try:
        doc = json.loads(description)
        if doc.get("format") != _DESCRIPTION_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        leaves = [
            (
                tuple(leaf["path"]),
                np.zeros(leaf["shape"], np.lib.format.descr_to_dtype(leaf["dtype"])),
            )
            for leaf in doc["leaves"]
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"params(): the learner's description of its parameters: {e}") from e
    if len(leaves) == 1 and not leaves[0][0]:
        return TreeLayout(leaves[0][1])
    root: dict[Any, Any] = {}
    for path, array in leaves:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        children = cast("dict[Any, Any]", node)
        keys = list(children)
        if (
            keys
            and all(isinstance(k, int) for k in keys)
            and sorted(keys) == list(range(len(keys)))
        ):
            return [build(children[k]) for k in range(len(keys))]
        return {k: build(v) for k, v in children.items()}

    layout = TreeLayout(build(root))
    if layout.paths != [path for path, _ in leaves]:
        raise ValueError(
            "params(): the learner's parameters are a pytree this worker cannot rebuild from "
            "their description (a namedtuple or a custom node): pass TcpClient(..., "
            "params_example=<a pytree like them>)"
        )
    return layout
