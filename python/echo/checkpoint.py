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
`read_extra(path)`, which reads it alone; the published parameters (`Server.publish`) in the
extra's files (see `encode`) and `read_params(path)`; and the example rebuilt from a
manifest's leaf paths. Periodic checkpoints: `echo._periodic`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from echo import _echo
from echo._params import Published
from echo._periodic import PeriodicCheckpointer, periodic_checkpoints

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "PeriodicCheckpointer",
    "periodic_checkpoints",
    "read_extra",
    "read_params",
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


def _extra_file(index: int) -> str:
    """The name the core gives the extra's array number `index`."""
    return f"extra_{index:03d}.npy"


_EXTRA_FILE = re.compile(r"extra_(\d{3,})\.npy")


def _npy(array: npt.NDArray[Any]) -> tuple[str, tuple[int, ...], npt.NDArray[np.uint8]]:
    """`array` as the core writes an extra's array: descr literal, shape, C-order bytes."""
    contiguous: npt.NDArray[Any] = np.ascontiguousarray(array).reshape(-1)  # pyright: ignore[reportUnknownMemberType]
    descr = repr(np.lib.format.dtype_to_descr(contiguous.dtype))
    data: npt.NDArray[np.uint8] = contiguous.view(np.uint8)  # pyright: ignore[reportUnknownMemberType]
    return descr, tuple(int(d) for d in array.shape), data


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
        arrays.append(_npy(array))
        return _extra_file(len(arrays) - 1)

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


# The published parameters (`Server.publish`) go in the extra's files, so that they are
# replaced atomically with the data and every file is checked like the others: after the
# arrays the tree names (`extra_000.npy` .. `extra_<n-1>.npy`), `extra_<n>.npy` is a
# descriptor (UTF-8 JSON as uint8: `{"format": "echo-published-params", "format_version": 1,
# "version": 7, "leaves": [[leaf name, file], ...]}`), and each leaf is one `.npy` file after
# it, in the pytree's order. `extra.json` stays the learner's `extra` alone (`{"value": null}`
# without one), so an echo that predates this reads the data and the extra as before and
# ignores the parameters' files.
_PARAMS_FORMAT = "echo-published-params"
_PARAMS_FORMAT_VERSION = 1


def encode(extra: Any, params: Published | None) -> Extra | None:
    """What `Server.checkpoint` hands the core: `extra` encoded (see `encode_extra`), with
    `params` (the latest published version) after its arrays; `None` when there is neither."""
    if extra is None and params is None:
        return None
    tree, arrays = encode_extra(extra)
    if params is not None:
        first = len(arrays) + 1  # after the descriptor
        descriptor = {
            "format": _PARAMS_FORMAT,
            "format_version": _PARAMS_FORMAT_VERSION,
            "version": params.version,
            "leaves": [[n, _extra_file(first + i)] for i, n in enumerate(params.names)],
        }
        arrays.append(_npy(np.frombuffer(json.dumps(descriptor).encode(), np.uint8)))
        arrays.extend(_npy(leaf) for leaf in params.leaves)
    return tree, arrays


def write(core: Any, path: str | os.PathLike[str], extra: Extra | None) -> int:
    """Writes a checkpoint of `core` (a `ServerCore`) to `path` with the encoded `extra`;
    returns the bytes its files hold (the manifest included)."""
    return int(core._checkpoint(os.fspath(path), extra, _hook))


def _extra_tree(opened: _echo.OpenedCheckpoint) -> tuple[str, Any] | None:
    """`extra.json`'s path and parsed JSON (None without one)."""
    name = opened.extra
    if name is None:
        return None
    file = os.path.join(opened.root, str(name))
    try:
        with open(file, "rb") as f:
            return file, json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def _load_array(opened: _echo.OpenedCheckpoint, file: str, array_file: Any) -> npt.NDArray[Any]:
    """The extra's array `array_file`, which `file` names (checked against the manifest)."""
    if not isinstance(array_file, str) or not opened.lists(array_file):
        raise CheckpointError(f"{file}: names {array_file!r}, which the manifest lacks")
    path = os.path.join(opened.root, array_file)
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable .npy file ({e})") from None


def decode_extra_of(opened: Any) -> Any:
    """The extra tree of a checkpoint opened by another writer (a ragged server's): anything
    with `root`, `extra` (extra.json's name or None) and `lists(name)`."""
    return _decode_extra(opened)


def _decode_extra(opened: _echo.OpenedCheckpoint) -> Any:
    """The extra tree of the opened (and checked) checkpoint (None without one)."""
    found = _extra_tree(opened)
    if found is None:
        return None
    file, tree = found

    def load(array_file: Any) -> npt.NDArray[Any]:
        return _load_array(opened, file, array_file)

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


def _arrays_named(node: Any) -> int:
    """One above the highest `extra_<n>.npy` the encoded tree `node` names (0: none)."""
    if not isinstance(node, (dict, list)):
        return 0
    if isinstance(node, list):
        return max((_arrays_named(v) for v in cast("list[Any]", node)), default=0)
    items = cast("dict[str, Any]", node)
    if len(items) != 1:
        return 0
    ((tag, body),) = items.items()
    if tag in ("array", "scalar"):
        matched = _EXTRA_FILE.fullmatch(body) if isinstance(body, str) else None
        return 0 if matched is None else int(matched.group(1)) + 1
    if tag == "dict" and isinstance(body, list):
        pairs = cast("list[Any]", body)
        named = (_arrays_named(p[1]) for p in pairs if isinstance(p, list) and len(p) == 2)  # pyright: ignore[reportUnknownArgumentType]
        return max(named, default=0)
    return _arrays_named(body) if tag in ("list", "tuple") else 0


def decode_params_of(opened: Any) -> Published | None:
    """The published parameters of a checkpoint opened by another writer (a ragged
    server's), as `decode_extra_of`."""
    return _decode_params(opened)


def _decode_params(opened: _echo.OpenedCheckpoint) -> Published | None:
    """The published parameters of the opened (and checked) checkpoint (see `encode`); None
    when it has none."""
    found = _extra_tree(opened)
    if found is None:
        return None
    file, tree = found
    name = _extra_file(_arrays_named(tree))
    if not opened.lists(name):
        return None
    where = os.path.join(opened.root, name)
    raw = _load_array(opened, file, name)
    try:
        descriptor = json.loads(raw.tobytes().decode()) if raw.dtype == np.uint8 else None
    except (ValueError, UnicodeDecodeError):
        descriptor = None
    if not isinstance(descriptor, dict) or descriptor.get("format") != _PARAMS_FORMAT:  # pyright: ignore[reportUnknownMemberType]
        raise CheckpointError(f"{where}: not the published parameters' descriptor")
    described = cast("dict[str, Any]", descriptor)
    if described.get("format_version") != _PARAMS_FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: parameters of format version {described.get('format_version')!r}; this "
            f"echo reads version {_PARAMS_FORMAT_VERSION}"
        )
    version, leaves = described.get("version"), described.get("leaves")
    if (
        not isinstance(version, int)
        or isinstance(version, bool)
        or not 1 <= version < 2**64
        or not isinstance(leaves, list)
        or not leaves
        or not all(
            isinstance(leaf, list) and len(leaf) == 2 and all(isinstance(x, str) for x in leaf)  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]
            for leaf in cast("list[Any]", leaves)
        )
    ):
        raise CheckpointError(f"{where}: a malformed parameters' descriptor")
    pairs = cast("list[list[str]]", leaves)
    arrays = tuple(_load_array(opened, where, leaf_file) for _, leaf_file in pairs)
    return Published(version, tuple(leaf_name for leaf_name, _ in pairs), arrays)


def read_params(path: str | os.PathLike[str]) -> tuple[int, dict[str, npt.NDArray[Any]]] | None:
    """The parameters the checkpointed server had published last (`Server.publish`), without
    building a server: `(version, leaves)`, the leaves by name (their path in the pytree,
    e.g. `"['q']['w']"`) in the order `publish()` flattened them; `None` when it had published
    none. Arrays are loaded into memory. E.g. to evaluate the policy a checkpoint holds.

    Only the manifest and the extra's files are read, each checked against the manifest's size
    and SHA-256.

    Raises:
        CheckpointError: A file is missing, truncated or corrupted, or the parameters' files
            are not what `Server.checkpoint` writes; the message names the file.
    """
    from echo import _ragged_checkpoint

    if _ragged_checkpoint.is_ragged(path):
        manifest, directory = _ragged_checkpoint.read(path)
        _ragged_checkpoint.verify(manifest, directory, _ragged_checkpoint.extra_files(manifest))
        published = _ragged_checkpoint.read_params(manifest, directory)
    else:
        published = _decode_params(_echo.open_checkpoint(os.fspath(path), extra_only=True))
    if published is None:
        return None
    return published.version, dict(zip(published.names, published.leaves, strict=True))


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
    from echo import _ragged_checkpoint

    if _ragged_checkpoint.is_ragged(path):
        manifest, directory = _ragged_checkpoint.read(path)
        _ragged_checkpoint.verify(manifest, directory, _ragged_checkpoint.extra_files(manifest))
        return _ragged_checkpoint.read_extra(manifest, directory)
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


def restored_params(opened: _echo.OpenedCheckpoint) -> Published | None:
    """The published parameters of an opened checkpoint, for `Server.restore` to publish."""
    return _decode_params(opened)
