"""Checkpoints of a server on disk: `Server.checkpoint(path)` and `Server.restore(path)`.

The format (the manifest, every version echo has written, the data files, the atomic
replacement of `path`) is defined once, in the core (`src/checkpoint/`), which writes and
reads every file, checks each against the manifest's size and SHA-256, and restores the data.
The design page `docs/design/checkpoints.md` describes the directory.

This module keeps what is Python's: the learner's own state (`Server.checkpoint(path,
extra=...)`: model parameters, optimizer state, a step counter), encoded as a tree with a tag
per node (`{"dict": [[key, node], ...]}`, `{"list": [...]}`, `{"tuple": [...]}`,
`{"value": json}`, `{"array": file}`, `{"scalar": file}`) in `extra.json`, each array one
`extra_000.npy`, ... beside it, so any key, tuples and numpy scalars come back as they went in;
`read_extra(path)`, which reads it alone; and the example rebuilt from a manifest's leaf paths.
Periodic checkpoints: `echo._periodic`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from echo import _echo
from echo._periodic import PeriodicCheckpointer, periodic_checkpoints

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "PeriodicCheckpointer",
    "periodic_checkpoints",
    "read_extra",
]

FORMAT_VERSION: int = _echo.CHECKPOINT_FORMAT_VERSION
"""The checkpoint format this echo writes, and the newest it reads (version 2 added FIFO
checkpoints and the ingress's acknowledged samples, version 3 sequence tables, version 4
compressed leaves; versions 1 to 3 are still read)."""

CheckpointError = _echo.CheckpointError
"""A checkpoint cannot be restored: a file is missing, truncated or corrupted (its SHA-256
differs from the manifest's), its format version is newer than this echo reads, or the
example does not match its layout (a `ValueError`). The message names the file and what is
wrong."""

# Tests set this to observe (and kill the process at) the stages of a checkpoint:
# "leaves-written" (leaf files complete, manifest not written), "extra-written" (the extra's
# files complete, manifest not written; only with `extra=`) and "before-swap" (the new
# directory complete, `path` not yet pointing at it).
_test_hook: Callable[[str], None] | None = None


def _hook(stage: str) -> None:
    if _test_hook is not None:
        _test_hook(stage)


_EXTRA_KINDS = (
    "a numpy array, a numpy scalar, None, bool, int, float, str, or a dict (str keys), list or "
    "tuple of these"
)

# An `extra` as the core writes it: `extra.json`'s bytes, and each array as
# `(descr literal, shape, C-order bytes)`.
Extra = tuple[bytes, list[tuple[str, tuple[int, ...], npt.NDArray[np.uint8]]]]


def _tree_path(path: tuple[Any, ...]) -> str:
    """`extra['opt'][1]`: where a node is in the extra tree, for messages."""
    return "extra" + "".join(f"[{key!r}]" for key in path)


def encode_extra(extra: Any) -> Extra:
    """Checks and encodes `Server.checkpoint(extra=...)` before anything is written.

    Raises:
        TypeError: A node is not one of `_EXTRA_KINDS`, a dict key is not a str, or an array
            holds Python objects; the message names the node's path in the tree.
        ValueError: The tree contains itself.
    """
    arrays: list[tuple[str, tuple[int, ...], npt.NDArray[np.uint8]]] = []
    active: set[int] = set()

    def file_for(array: npt.NDArray[Any], path: tuple[Any, ...]) -> str:
        if array.dtype.hasobject:
            raise TypeError(
                f"checkpoint(): {_tree_path(path)} is an array of dtype {array.dtype}, which "
                "holds Python objects: only arrays of plain data are stored (no pickling)"
            )
        contiguous: npt.NDArray[Any] = np.ascontiguousarray(array).reshape(-1)  # pyright: ignore[reportUnknownMemberType]
        descr = repr(np.lib.format.dtype_to_descr(contiguous.dtype))
        data: npt.NDArray[np.uint8] = contiguous.view(np.uint8)  # pyright: ignore[reportUnknownMemberType]
        arrays.append((descr, tuple(int(d) for d in array.shape), data))
        return f"extra_{len(arrays) - 1:03d}.npy"

    def encode(node: object, path: tuple[Any, ...]) -> Any:
        # numpy's float64 and bool_ scalars are (or behave as) Python floats and bools: they
        # come first so they come back as numpy scalars.
        if isinstance(node, np.ndarray):
            return {"array": file_for(cast("npt.NDArray[Any]", node), path)}
        if isinstance(node, np.generic):
            return {"scalar": file_for(np.asarray(cast("Any", node)), path)}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"value": node}
        if isinstance(node, dict) or type(node) in (list, tuple):
            ident = id(cast("object", node))
            if ident in active:
                raise ValueError(f"checkpoint(): {_tree_path(path)} contains itself")
            active.add(ident)
            try:
                return encode_container(cast("Any", node), path)
            finally:
                active.discard(ident)
        raise TypeError(
            f"checkpoint(): {_tree_path(path)} is a {type(node).__module__}."
            f"{type(node).__qualname__}, expected {_EXTRA_KINDS} (convert tensors with "
            "np.asarray, a namedtuple or dataclass to a dict)"
        )

    def encode_container(node: dict[object, object] | list[object], path: tuple[Any, ...]) -> Any:
        if isinstance(node, dict):
            items: list[list[Any]] = []
            for key, value in node.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"checkpoint(): {_tree_path(path)} has the key {key!r} "
                        f"({type(key).__name__}): the extra's dict keys must be str"
                    )
                items.append([key, encode(value, (*path, key))])
            return {"dict": items}
        return {type(node).__name__: [encode(v, (*path, i)) for i, v in enumerate(node)]}

    tree = encode(extra, ())
    return json.dumps(tree).encode(), arrays


def write(core: Any, path: str | os.PathLike[str], extra: Extra | None) -> int:
    """Writes a checkpoint of `core` (a `ServerCore`) to `path` with the encoded `extra`;
    returns the bytes its files hold (the manifest included)."""
    return int(core._checkpoint(os.fspath(path), extra, _hook))


def _decode_extra(opened: _echo.OpenedCheckpoint) -> Any:
    """The extra tree of the opened (and checked) checkpoint (None without one)."""
    name = opened.extra
    if name is None:
        return None
    root: str = opened.root
    file = os.path.join(root, str(name))
    try:
        with open(file, "rb") as f:
            tree = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None

    def load(array_file: Any) -> npt.NDArray[Any]:
        if not isinstance(array_file, str) or not opened.lists(array_file):
            raise CheckpointError(f"{file}: names {array_file!r}, which the manifest lacks")
        try:
            return np.load(os.path.join(root, array_file), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{os.path.join(root, array_file)}: not a readable .npy file ({e})"
            ) from None

    def decode(node: Any) -> Any:
        if isinstance(node, dict) and len(node) == 1:  # pyright: ignore[reportUnknownArgumentType]
            ((tag, body),) = cast("dict[str, Any]", node).items()
            if tag == "value":
                return body
            if tag == "array":
                return load(body)
            if tag == "scalar":
                return load(body)[()]
            if tag == "dict" and isinstance(body, list):
                pairs = cast("list[tuple[Any, Any]]", body)
                return {str(k): decode(v) for k, v in pairs}
            if tag in ("list", "tuple") and isinstance(body, list):
                values = [decode(v) for v in cast("list[Any]", body)]
                return values if tag == "list" else tuple(values)
        raise CheckpointError(f"{file}: malformed node {str(cast('object', node))[:80]!r}")

    try:
        return decode(tree)
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: malformed ({type(e).__name__}: {e})") from None


def read_extra(path: str | os.PathLike[str]) -> Any:
    """The learner's state stored by `Server.checkpoint(path, extra=...)`, without building a
    server: the same tree, arrays as numpy arrays (loaded into memory), numpy scalars as numpy
    scalars, tuples as tuples; `None` when the checkpoint has none.

    Only the manifest and the extra's files are read, each checked against the manifest's size
    and SHA-256. To restore the data and the extra of one and the same checkpoint while
    periodic checkpoints may replace `path`, use `Server.restore(path)` and
    `Server.restored_extra` instead: `path` is resolved once there.

    Raises:
        CheckpointError: A file is missing, truncated or corrupted, or the manifest is not an
            echo checkpoint's; the message names the file.
    """
    return _decode_extra(_echo.open_checkpoint(os.fspath(path), extra_only=True))


def open_for_restore(
    path: str | os.PathLike[str], example: Any
) -> tuple[_echo.OpenedCheckpoint, Any]:
    """The checkpoint at `path`, opened and checked (every file's size and SHA-256, the format
    version, the layout against `example`), and the example (rebuilt from the manifest's leaf
    paths when `example` is None); CheckpointError naming the file otherwise."""
    from echo._pytree import TreeLayout

    opened = _echo.open_checkpoint(os.fspath(path))
    if example is None:
        example = {}
        for keys, shape, descr in opened.dict_leaves():
            node = example
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = np.zeros(shape, np.dtype(descr))
    opened.check_example(TreeLayout(example))
    return opened, example


def restored_extra(opened: _echo.OpenedCheckpoint) -> Any:
    """The learner's state of an opened checkpoint (see `Server.restored_extra`)."""
    return _decode_extra(opened)
