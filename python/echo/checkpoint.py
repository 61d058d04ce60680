"""Checkpoints of a server on disk: `Server.checkpoint(path)` and `Server.restore(path)`.

A checkpoint is a directory:

- `manifest.json`: `format` (`echo-replay-checkpoint`, `echo-fifo-checkpoint` or
  `echo-sequence-checkpoint`), the format version, the echo version, the layout (each leaf's
  path name, dtype, shape and file), the settings, the counts and the size and SHA-256 of
  every other file;
- one `.npy` file per leaf (`leaf_000.npy`, ...).

A replay checkpoint's leaf files hold `N` rows in key (insertion) order, and beside them are
`keys.npy` (uint64), `priorities.npy` (float64), `times_sampled.npy` (uint32); the manifest
holds the settings (batch size, sampler, remover, rate limiter, `max_size`,
`max_times_sampled`) and the table-wide state (the rate limiter's counters, the sampler's RNG
state, the next key, the largest priority).

A FIFO checkpoint's leaf files hold, in order, every committed sample of the ring not yet
handed to the learner (the partial batch included), then the acknowledged samples still
queued in the ingress; the manifest's settings are `batch_size` and `num_buffers`, its counts
say how many rows came from each (`from_ring`, `from_ingress`) and how many samples the
learner had been handed before (`handed_out_before`).

A sequence table's checkpoint (format version 3) holds its stored steps in the leaf files
(each chunk of one stream's consecutive steps in turn, in eviction order), and in
`sequence.npy` (uint8) the rest of the table, encoded by the core: where each chunk was, the
windows (first step, episode, start, length, times sampled, priority), the streams with their
open episodes, the episodes, the limiter's counters, the RNG state and the counters. The
steps TCP clients had queued are `ingress_leaf_000.npy`, ... (their streams and flags are in
`sequence.npy`). A restore puts every chunk back where it was, so window keys stay valid;
in-process streams go on with their open episodes, and TCP clients' streams end theirs,
truncated, after their queued steps (their clients come back as new streams).

Acknowledged samples still queued in the ingress (format version 2): a replay checkpoint
keeps them apart, as they are not items yet (no key): `ingress_leaf_000.npy`, ... and
`ingress_priorities.npy` (float64, NaN where the sample carried none), listed under
`ingress` in the manifest (absent when there were none); `counts.from_ingress` says how many.
A restore inserts them, in order, before anything new. Version 1 (replay only, no ingress
samples) is still read.

The settings that are not part of the data (`num_drainers`, `producer_queue_size` as the
server was given it, `null` for the automatic size; a replay table's `compress`, one entry
per leaf, `null` or `[codec, level]` such as `["zstd", 1]`, and `max_bytes`) are under
`tuning` in the manifest; a manifest without them (written before they were recorded)
restores with the defaults.

A replay table that stores leaves compressed (format version 4) writes each such leaf as it
stores it: `leaf_000.zst` (or `.lz4`) holds every item's compressed row back to back, with
no header (a zstd file of concatenated frames, which `zstd -d` reads), and
`leaf_000.lengths.npy` (uint32) each row's length; the leaf's entry in the manifest's layout
names the codec (`"codec": ["zstd", 1]`) and the lengths file. A restore into a table that
compresses the leaf the same way keeps the rows as they are; otherwise it decompresses them
(and compresses them again the new way).

The learner's own state (`Server.checkpoint(path, extra=...)`: model parameters, optimizer
state, a step counter) lives in the same directory: `extra.json` holds the tree's structure
and its JSON values, and each array is one `extra_000.npy`, ...; both are listed under
`files` like every other file, and the manifest's `extra` names the tree's file. The tree is
encoded with a tag per node (`{"dict": [[key, node], ...]}`, `{"list": [...]}`,
`{"tuple": [...]}`, `{"value": json}`, `{"array": file}`, `{"scalar": file}`), so any
key, tuples and numpy scalars come back as they went in. `read_extra(path)` reads it alone.
`np.load(file, mmap_mode="r")` opens any file, for inspection or offline RL. How `path` is
replaced atomically, and the leftovers a killed checkpoint leaves: `echo._periodic`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from echo import replay
from echo._echo import __version__
from echo._periodic import PeriodicCheckpointer, clean_leftovers, periodic_checkpoints
from echo._pytree import TreeLayout

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "PeriodicCheckpointer",
    "periodic_checkpoints",
    "read_extra",
]

_log = logging.getLogger("echo")

FORMAT_VERSION = 4
"""The checkpoint format this echo writes, and the newest it reads (version 2 added FIFO
checkpoints and the ingress's acknowledged samples, version 3 sequence tables; versions 1 and
2 are still read)."""

REPLAY_FORMAT = "echo-replay-checkpoint"
FIFO_FORMAT = "echo-fifo-checkpoint"
SEQUENCE_FORMAT = "echo-sequence-checkpoint"
_SEQUENCE_META = "sequence.npy"
_INGRESS_PRIORITIES = "ingress_priorities.npy"

MANIFEST = "manifest.json"
_META_FILES = (
    ("keys", "keys.npy", np.dtype(np.uint64)),
    ("priorities", "priorities.npy", np.dtype(np.float64)),
    ("times_sampled", "times_sampled.npy", np.dtype(np.uint32)),
)
_HASH_CHUNK = 1 << 20

# Tests set this to observe (and kill the process at) the stages of a checkpoint:
# "leaves-written" (leaf files complete, manifest not written), "extra-written" (the extra's
# files complete, manifest not written; only with `extra=`) and "before-swap" (the new
# directory complete, `path` not yet pointing at it).
_test_hook: Callable[[str], None] | None = None


class CheckpointError(ValueError):
    """A checkpoint cannot be restored: a file is missing, truncated or corrupted (its SHA-256
    differs from the manifest's), its format version is newer than this echo reads, or the
    example does not match its layout. The message names the file and what is wrong."""


def _hook(stage: str) -> None:
    if _test_hook is not None:
        _test_hook(stage)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _str_path(path: str | os.PathLike[str]) -> str:
    return path if isinstance(path, str) else path.__fspath__()


def _write_small(path: str, data: bytes) -> str:
    """Writes `data` to the new file `path`, fsynced; returns its SHA-256."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


EXTRA = "extra.json"
_EXTRA_KINDS = (
    "a numpy array, a numpy scalar, None, bool, int, float, str, or a dict (str keys), list or "
    "tuple of these"
)


def _tree_path(path: tuple[Any, ...]) -> str:
    """`extra['opt'][1]`: where a node is in the extra tree, for messages."""
    return "extra" + "".join(f"[{key!r}]" for key in path)


@dataclasses.dataclass
class Extra:
    """The learner's state for a checkpoint, checked and encoded (see the module doc): the
    tagged tree and the arrays its `array`/`scalar` nodes name, in file order."""

    tree: Any
    arrays: list[npt.NDArray[Any]]


def encode_extra(extra: Any) -> Extra:
    """Checks and encodes `Server.checkpoint(extra=...)` before anything is written.

    Raises:
        TypeError: A node is not one of `_EXTRA_KINDS`, a dict key is not a str, or an array
            holds Python objects; the message names the node's path in the tree.
        ValueError: The tree contains itself.
    """
    arrays: list[npt.NDArray[Any]] = []
    active: set[int] = set()

    def file_for(array: npt.NDArray[Any], path: tuple[Any, ...]) -> str:
        if array.dtype.hasobject:
            raise TypeError(
                f"checkpoint(): {_tree_path(path)} is an array of dtype {array.dtype}, which "
                "holds Python objects: only arrays of plain data are stored (no pickling)"
            )
        arrays.append(array)
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

    return Extra(encode(extra, ()), arrays)


class _HashingWriter:
    """A file that hashes what is written to it, so an `.npy` file is hashed as it is
    written instead of read back."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self._f.write(data)


def _write_extra(data_dir: str, extra: Extra) -> dict[str, dict[str, Any]]:
    """Writes the extra's arrays and tree into `data_dir` (each file fsynced); returns their
    `files` entries."""
    files: dict[str, dict[str, Any]] = {}
    for i, array in enumerate(extra.arrays):
        name = f"extra_{i:03d}.npy"
        with open(os.path.join(data_dir, name), "xb") as f:
            writer = _HashingWriter(f)
            np.lib.format.write_array(writer, array, allow_pickle=False)  # pyright: ignore[reportArgumentType]
            f.flush()
            os.fsync(f.fileno())
            files[name] = {"sha256": writer.sha256.hexdigest(), "bytes": f.tell()}
    tree = json.dumps(extra.tree).encode()
    files[EXTRA] = {"sha256": _write_small(os.path.join(data_dir, EXTRA), tree), "bytes": len(tree)}
    return files


def _decode_extra(root: str, manifest: dict[str, Any]) -> Any:
    """The extra tree of the checked checkpoint directory `root` (None without one)."""
    name = manifest.get("extra")
    if name is None:
        return None
    mfile = os.path.join(root, MANIFEST)
    file = os.path.join(root, str(name))
    if name != EXTRA:
        raise CheckpointError(f"{mfile}: extra names {name!r}, expected {EXTRA!r}")
    try:
        with open(file, "rb") as f:
            tree = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    files: dict[str, Any] = manifest["files"]

    def load(array_file: Any) -> npt.NDArray[Any]:
        if not isinstance(array_file, str) or array_file not in files:
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
    root = os.path.realpath(_str_path(path))
    manifest = _read_manifest(root)
    mfile = os.path.join(root, MANIFEST)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{mfile}: malformed (no files)")
    files = cast("dict[str, dict[str, Any]]", files)
    for name, expected in files.items():
        if name == EXTRA or (name.startswith("extra_") and os.path.basename(name) == name):
            _check_file(root, name, expected)
    if manifest.get("extra") is not None and EXTRA not in files:
        raise CheckpointError(f"{mfile}: lists no checksum for {EXTRA}")
    return _decode_extra(root, manifest)


def _strategy(value: Any) -> dict[str, Any]:
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, replay.SampleToInsertRatio):
        fields["error_buffer"] = list(value.window)
    return {"type": type(value).__name__, **fields}


def _from_strategy(spec: dict[str, Any]) -> Any:
    kwargs = {k: v for k, v in spec.items() if k != "type"}
    if spec["type"] == "SampleToInsertRatio":
        kwargs["error_buffer"] = tuple(kwargs["error_buffer"])
    return getattr(replay, spec["type"])(**kwargs)


def settings_dict(
    *,
    batch_size: int,
    max_size: int,
    sampler: Any,
    remover: Any,
    rate_limiter: Any,
    max_times_sampled: int,
    sequence: replay.Sequence | None = None,
) -> dict[str, Any]:
    """A replay or sequence server's settings as the manifest stores them."""
    settings: dict[str, Any] = {
        "batch_size": batch_size,
        "max_size": max_size,
        "sampler": _strategy(sampler),
        "remover": _strategy(remover),
        "rate_limiter": _strategy(rate_limiter),
        "max_times_sampled": max_times_sampled,
    }
    if sequence is not None:
        settings["sequence"] = _strategy(sequence)
    return settings


def _leaf_files(layout: TreeLayout, prefix: str = "") -> list[str]:
    return [f"{prefix}leaf_{i:03d}.npy" for i in range(len(layout.leaves))]


def _native_files(
    layout: TreeLayout, data_dir: str, names: list[str]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """`(path, descr, item_shape)` per leaf, as the core's file writer takes them."""
    return [
        (os.path.join(data_dir, file), repr(np.lib.format.dtype_to_descr(leaf.dtype)), leaf.shape)
        for leaf, file in zip(layout.leaves, names, strict=True)
    ]


def _digests(data_dir: str, names: list[str], digests: list[bytes]) -> dict[str, dict[str, Any]]:
    return {
        file: {"sha256": digest.hex(), "bytes": os.path.getsize(os.path.join(data_dir, file))}
        for file, digest in zip(names, digests, strict=True)
    }


def _layout_dict(layout: TreeLayout, leaf_files: list[str]) -> dict[str, Any]:
    return {
        "treespec": str(layout.treespec),
        "leaves": [
            {
                "name": leaf.name,
                "path": list(p),
                "dtype": np.lib.format.dtype_to_descr(leaf.dtype),
                "shape": list(leaf.shape),
                "file": file,
            }
            for leaf, p, file in zip(layout.leaves, layout.paths, leaf_files, strict=True)
        ],
    }


def _write_atomically(
    path: str | os.PathLike[str], fill: Callable[[str], dict[str, Any]], extra: Extra | None
) -> int:
    """Writes a checkpoint directory beside `path` with `fill(data_dir)` (which writes the data
    files and returns the manifest, `files` included) and `extra`'s files, then swaps `path`
    over to it (see the module doc); returns the bytes its files hold (the manifest
    included)."""
    target = os.path.abspath(_str_path(path))
    parent, name = os.path.split(target)
    if os.path.lexists(target) and not os.path.islink(target):
        if os.path.isdir(target) and not os.listdir(target):
            os.rmdir(target)
        else:
            raise FileExistsError(
                f"checkpoint(): {target} exists and is not a checkpoint link written by "
                "Server.checkpoint(); pass a new path or remove it"
            )
    token = f"{time.time_ns():x}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data_name = f".{name}.ckpt-{token}"
    data_dir = os.path.join(parent, data_name)
    link_tmp = os.path.join(parent, f".{name}.link-{token}")
    os.mkdir(data_dir)
    linked = False
    try:
        manifest = fill(data_dir)
        files: dict[str, dict[str, Any]] = manifest["files"]
        if extra is not None:
            files.update(_write_extra(data_dir, extra))
            manifest["extra"] = EXTRA
            _hook("extra-written")
        manifest_bytes = json.dumps(manifest, indent=1).encode()
        _write_small(os.path.join(data_dir, MANIFEST), manifest_bytes)
        total_bytes = len(manifest_bytes) + sum(int(f["bytes"]) for f in files.values())
        _fsync_dir(data_dir)
        _hook("before-swap")
        os.symlink(data_name, link_tmp)
        os.replace(link_tmp, target)
        linked = True
        _fsync_dir(parent)
    finally:
        if not linked:
            shutil.rmtree(data_dir, ignore_errors=True)
            if os.path.lexists(link_tmp):
                os.unlink(link_tmp)
    clean_leftovers(parent, name, keep=data_name)
    return total_bytes


@dataclasses.dataclass(frozen=True)
class Written:
    """What a checkpoint records beside the data: the server's settings that are part of the
    data (`settings`: they must match on restore), those that are not (`tuning`: a restore
    keeps them unless given others), and the learner's state (`extra`, encoded)."""

    layout: TreeLayout
    settings: dict[str, Any]
    tuning: dict[str, Any]
    extra: Extra | None


def _packed_files(
    what: Written, leaf_files: list[str]
) -> tuple[list[tuple[int, list[Any]]], list[str]]:
    """The leaves the table stores compressed, `(leaf, [codec name, level])`, and their
    lengths files; their data files are renamed in `leaf_files` (`leaf_NNN.zst` or `.lz4`):
    they are written as stored, rows of varying length, with no `.npy` header."""
    codecs: list[list[Any] | None] = what.tuning.get("compress") or []
    packed = [(i, c) for i, c in enumerate(codecs) if c is not None]
    for i, (name, _) in packed:
        leaf_files[i] = f"leaf_{i:03d}.{'zst' if name == 'zstd' else 'lz4'}"
    return packed, [f"leaf_{i:03d}.lengths.npy" for i, _ in packed]


def _manifest_head(
    kind: str,
    what: Written,
    leaf_files: list[str],
    packed: list[tuple[int, list[Any]]] | None = None,
    lengths_files: list[str] | None = None,
) -> dict[str, Any]:
    """The manifest fields every checkpoint has, whatever its backend, with the codec and
    lengths file of each compressed leaf file. Its format version is the lowest that
    describes it (4 only with compressed leaf files), so that an echo that reads up to 3
    still reads every checkpoint it could."""
    layout = _layout_dict(what.layout, leaf_files)
    for (i, codec), lengths in zip(packed or [], lengths_files or [], strict=True):
        layout["leaves"][i].update(codec=list(codec), lengths=lengths)
    return {
        "format": kind,
        "format_version": 4 if packed else 3,
        "echo_version": __version__,
        "created_unix_ns": time.time_ns(),
        "settings": what.settings,
        "tuning": what.tuning,
        "layout": layout,
    }


def write(core: Any, what: Written, path: str | os.PathLike[str]) -> int:
    """Writes a checkpoint of `core` (a replay `ServerCore`) to `path` (see the module doc);
    returns the bytes its files hold (the manifest included)."""

    def fill(data_dir: str) -> dict[str, Any]:
        layout = what.layout
        leaf_files = _leaf_files(layout)
        ingress_files = _leaf_files(layout, "ingress_")
        meta_files = [file for _, file, _ in _META_FILES]
        packed, lengths_files = _packed_files(what, leaf_files)
        keys, _, _, state, digests, ingress = core._checkpoint(
            _native_files(layout, data_dir, leaf_files),
            _native_files(layout, data_dir, ingress_files),
            [os.path.join(data_dir, f) for f in [*meta_files, _INGRESS_PRIORITIES]],
            [os.path.join(data_dir, f) for f in lengths_files] if packed else None,
        )
        queued, ingress_digests, _ = ingress
        n = len(keys)
        # Every file is written (and hashed, and fsynced) natively with the GIL released.
        files = _digests(data_dir, leaf_files + meta_files + lengths_files, digests)
        _hook("leaves-written")
        if queued:
            files.update(_digests(data_dir, [*ingress_files, _INGRESS_PRIORITIES], ingress_digests))
        inserts, samples, rng, next_key, max_priority = state
        head = _manifest_head(REPLAY_FORMAT, what, leaf_files, packed, lengths_files)
        manifest: dict[str, Any] = {
            **head,
            "counts": {"items": n, "from_ingress": queued},
            "state": {
                "inserts": inserts,
                "samples": samples,
                "rng": list(rng),
                "next_key": next_key,
                "max_priority": max_priority,
            },
            "files": files,
        }
        if queued:
            manifest["ingress"] = {"files": ingress_files, "priorities": _INGRESS_PRIORITIES}
        return manifest

    return _write_atomically(path, fill, what.extra)


def write_sequence(core: Any, what: Written, path: str | os.PathLike[str]) -> int:
    """Writes a checkpoint of `core` (a sequence table's `ServerCore`) to `path` (see the
    module doc); returns the bytes its files hold (the manifest included)."""

    def fill(data_dir: str) -> dict[str, Any]:
        layout = what.layout
        leaf_files = _leaf_files(layout)
        ingress_files = _leaf_files(layout, "ingress_")
        packed, lengths_files = _packed_files(what, leaf_files)
        counts, digests, ingress_digests = core._checkpoint_sequence(
            _native_files(layout, data_dir, leaf_files),
            _native_files(layout, data_dir, ingress_files),
            os.path.join(data_dir, _SEQUENCE_META),
            [os.path.join(data_dir, f) for f in lengths_files] if packed else None,
        )
        steps, windows, open_episodes, queued, chunks = counts
        files = _digests(data_dir, [*leaf_files, _SEQUENCE_META, *lengths_files], digests)
        _hook("leaves-written")
        if queued:
            files.update(_digests(data_dir, ingress_files, ingress_digests))
        manifest: dict[str, Any] = {
            **_manifest_head(SEQUENCE_FORMAT, what, leaf_files, packed, lengths_files),
            "counts": {
                "items": steps,
                "windows": windows,
                "open_episodes": open_episodes,
                "from_ingress": queued,
                "chunks": chunks,
            },
            "sequence": _SEQUENCE_META,
            "files": files,
        }
        if queued:
            manifest["ingress"] = {"files": ingress_files}
        return manifest

    return _write_atomically(path, fill, what.extra)


def write_fifo(core: Any, what: Written, path: str | os.PathLike[str]) -> int:
    """Writes a checkpoint of `core` (a FIFO `ServerCore`) to `path` (see the module doc);
    returns the bytes its files hold (the manifest included)."""

    def fill(data_dir: str) -> dict[str, Any]:
        layout = what.layout
        leaf_files = _leaf_files(layout)
        handed_out, from_ring, from_ingress, digests = core._checkpoint_fifo(
            _native_files(layout, data_dir, leaf_files)
        )
        files = _digests(data_dir, leaf_files, digests)
        _hook("leaves-written")
        return {
            **_manifest_head(FIFO_FORMAT, what, leaf_files),
            "counts": {
                "items": from_ring + from_ingress,
                "from_ring": from_ring,
                "from_ingress": from_ingress,
                "handed_out_before": handed_out,
            },
            "files": files,
        }

    return _write_atomically(path, fill, what.extra)


def _file_digest(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


@dataclasses.dataclass
class Loaded:
    """A checkpoint read and checked by `read`, ready for `ServerCore._restore` (replay) or
    `ServerCore._restore_fifo` (FIFO: `leaves` hold the ring's rows, then the ingress's)."""

    fifo: bool
    sequence: bool
    example: Any
    settings: dict[str, Any]
    leaves: list[npt.NDArray[Any]]
    rows: int
    keys: npt.NDArray[np.uint64]
    priorities: npt.NDArray[np.float64]
    times_sampled: npt.NDArray[np.uint32]
    state: tuple[int, int, list[int], int, float]
    ingress_leaves: list[npt.NDArray[Any]]
    ingress_priorities: npt.NDArray[np.float64]
    # A sequence table's metadata (`sequence.npy`); empty otherwise.
    sequence_meta: npt.NDArray[np.uint8]
    # The settings that are not part of the data (`num_drainers`, `producer_queue_size`), as
    # recorded; empty for checkpoints written before they were.
    tuning: dict[str, Any]
    # The learner's state (`checkpoint(extra=...)`), decoded; None without one.
    extra: Any
    # Leaves whose rows in `leaves` are compressed as stored (format 4): (leaf, codec name,
    # level, each row's length).
    packed: list[tuple[int, str, int, npt.NDArray[np.uint32]]] = dataclasses.field(
        default_factory=lambda: []
    )

    def server_kwargs(self) -> dict[str, Any]:
        """The `Server` keyword arguments that rebuild the checkpointed settings that are part
        of the data (FIFO: `num_buffers` too, which is not, but was always recorded)."""
        s = self.settings
        if self.fifo:
            return {"batch_size": s["batch_size"], "num_buffers": s["num_buffers"]}
        kwargs = {
            "batch_size": s["batch_size"],
            "max_size": s["max_size"],
            "sampler": _from_strategy(s["sampler"]),
            "remover": _from_strategy(s["remover"]),
            "rate_limiter": _from_strategy(s["rate_limiter"]),
            "max_times_sampled": s["max_times_sampled"],
        }
        if self.sequence:
            kwargs["sequence"] = _from_strategy(s["sequence"])
        return kwargs

    def leaf_bytes(self) -> list[npt.NDArray[np.uint8]]:
        """Each leaf's rows as one flat byte array (views of the memory-mapped files)."""
        return _flat_bytes(self.leaves)

    def ingress_bytes(self) -> list[npt.NDArray[np.uint8]]:
        """As `leaf_bytes`, for a replay checkpoint's ingress samples."""
        return _flat_bytes(self.ingress_leaves)


def _flat_bytes(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[np.uint8]]:
    return [
        cast("npt.NDArray[np.uint8]", np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # pyright: ignore[reportUnknownMemberType]
        for a in arrays
    ]


def _read_manifest(root: str) -> dict[str, Any]:
    file = os.path.join(root, MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (not a checkpoint, or an incomplete one)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file}: not a checkpoint manifest (a JSON object)")
    manifest = cast("dict[str, Any]", manifest)
    version = manifest.get("format_version")
    form = manifest.get("format")
    if form not in (REPLAY_FORMAT, FIFO_FORMAT, SEQUENCE_FORMAT) or not isinstance(version, int):
        raise CheckpointError(
            f"{file}: not an echo checkpoint manifest (format {form!r}, expected "
            f"{REPLAY_FORMAT!r}, {FIFO_FORMAT!r} or {SEQUENCE_FORMAT!r})"
        )
    if form == FIFO_FORMAT and version < 2:
        raise CheckpointError(f"{file}: a FIFO checkpoint needs format version 2, got {version}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {version} is newer than this echo ({__version__}) reads "
            f"(up to {FORMAT_VERSION}); upgrade echo to restore it"
        )
    return manifest


def _is_codec_entry(entry: object) -> bool:
    if not isinstance(entry, list) or len(cast("list[Any]", entry)) != 2:
        return False
    name, level = cast("list[Any]", entry)
    return name in ("zstd", "lz4") and isinstance(level, int) and not isinstance(level, bool)


def _read_tuning(tuning: Any) -> dict[str, Any]:
    """The manifest's `tuning`, checked: `num_drainers` an int >= 1, `producer_queue_size` an
    int >= 1 or None (the automatic size); either may be absent. Settings this echo does not
    know (a newer one's) are left out: they only tune, so the defaults are safe."""
    if not isinstance(tuning, dict):
        raise TypeError(f"tuning must be an object, got {type(tuning).__name__}")
    known: dict[str, Any] = {}
    given = cast("dict[str, Any]", tuning)
    compress = given.get("compress")
    if compress is not None:
        if not isinstance(compress, list) or not all(
            entry is None or _is_codec_entry(entry) for entry in cast("list[Any]", compress)
        ):
            raise ValueError(
                "tuning: compress must be a list of null or [codec, level] per leaf, got "
                f"{compress!r}"
            )
        known["compress"] = [
            None if e is None else (str(e[0]), int(e[1])) for e in cast("list[Any]", compress)
        ]
    max_bytes = given.get("max_bytes")
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"tuning: max_bytes must be an int >= 1, got {max_bytes!r}")
        known["max_bytes"] = max_bytes
    for key in ("num_drainers", "producer_queue_size"):
        if key not in tuning:
            continue
        value = cast("dict[str, Any]", tuning)[key]
        if not (value is None and key == "producer_queue_size") and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"tuning: {key} must be an int >= 1, got {value!r}")
        known[key] = value
    return known


def _check_file(root: str, name: str, expected: dict[str, Any]) -> None:
    file = os.path.join(root, name)
    try:
        digest = _file_digest(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    if digest["bytes"] != expected["bytes"]:
        raise CheckpointError(
            f"{file}: {digest['bytes']} bytes, the manifest says {expected['bytes']} (truncated?)"
        )
    if digest["sha256"] != expected["sha256"]:
        raise CheckpointError(
            f"{file}: SHA-256 {digest['sha256']} differs from the manifest's "
            f"{expected['sha256']} (corrupted)"
        )


def _load_packed(root: str, name: str) -> npt.NDArray[np.uint8]:
    """A compressed leaf's rows: the file's bytes (memory-mapped), without a header."""
    file = os.path.join(root, name)
    if os.path.getsize(file) == 0:  # numpy cannot map an empty file
        return np.zeros(0, np.uint8)
    return np.memmap(file, dtype=np.uint8, mode="r")


def _load(root: str, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    file = os.path.join(root, name)
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable .npy file ({e})") from None
    if array.dtype != dtype or array.shape != shape:
        raise CheckpointError(
            f"{file}: holds {array.dtype}{list(array.shape)}, expected {dtype}{list(shape)}"
        )
    return cast("npt.NDArray[Any]", array)


def _example_from_paths(file: str, leaves: list[dict[str, Any]]) -> Any:
    """The example pytree of nested dicts the manifest's leaf paths describe; CheckpointError
    if a path holds something else (then the caller must pass `example=`)."""
    root: dict[str, Any] = {}
    for leaf in leaves:
        path = leaf["path"]
        if not path or not all(isinstance(k, str) for k in path):
            raise CheckpointError(
                f"{file}: leaf {leaf['name']} is not in a tree of dicts with str keys; "
                "pass example= to restore it"
            )
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.zeros(leaf["shape"], np.dtype(leaf["dtype"]))
    return root


def read(path: str | os.PathLike[str], example: Any = None) -> Loaded:
    """Reads and checks the checkpoint at `path` (every file's size and SHA-256, the format
    version, the layout against `example`); CheckpointError naming the file otherwise."""
    root = os.path.realpath(_str_path(path))
    manifest = _read_manifest(root)
    mfile = os.path.join(root, MANIFEST)
    fifo = manifest["format"] == FIFO_FORMAT
    sequence = manifest["format"] == SEQUENCE_FORMAT
    state: tuple[int, int, list[int], int, float] = (0, 0, [], 0, 0.0)
    ingress_files: list[str] = []
    ingress_priorities = ""
    try:
        files: dict[str, dict[str, Any]] = manifest["files"]
        leaves: list[dict[str, Any]] = manifest["layout"]["leaves"]
        counts = manifest["counts"]
        n = int(counts["items"])
        from_ingress = int(counts.get("from_ingress", 0))
        settings: dict[str, Any] = manifest["settings"]
        tuning = _read_tuning(manifest.get("tuning", {}))
        needed = [leaf["file"] for leaf in leaves]
        packed_rows = [
            (i, str(leaf["codec"][0]), int(leaf["codec"][1]), str(leaf["lengths"]))
            for i, leaf in enumerate(leaves)
            if leaf.get("codec") is not None
        ]
        if packed_rows and fifo:
            raise ValueError("compressed leaf files in a FIFO checkpoint")
        # A compressed leaf file has a row per item, or per chunk of a sequence table.
        packed_count = int(counts["chunks"]) if packed_rows and sequence else n
        for _, name, _, lengths_file in packed_rows:
            if name not in ("zstd", "lz4"):
                raise ValueError(f"unknown codec {name!r}")
            needed.append(lengths_file)
        if manifest.get("extra") is not None:
            needed.append(EXTRA)
        if fifo:
            if int(counts["from_ring"]) + from_ingress != n:
                raise ValueError(
                    f"counts: from_ring {counts['from_ring']} + from_ingress {from_ingress} "
                    f"!= items {n}"
                )
            _ = (int(settings["batch_size"]), int(settings["num_buffers"]))
        elif sequence:
            needed.append(str(manifest["sequence"]))
            _ = settings["sequence"]["length"]
            if from_ingress:
                ingress_files = [str(f) for f in manifest["ingress"]["files"]]
                if len(ingress_files) != len(leaves):
                    raise ValueError(
                        f"ingress: {len(ingress_files)} files for {len(leaves)} leaves"
                    )
                needed += ingress_files
        else:
            st = manifest["state"]
            state = (
                int(st["inserts"]),
                int(st["samples"]),
                [int(x) for x in st["rng"]],
                int(st["next_key"]),
                float(st["max_priority"]),
            )
            needed += [f for _, f, _ in _META_FILES]
            if from_ingress:
                ingress = manifest["ingress"]
                ingress_files = [str(f) for f in ingress["files"]]
                ingress_priorities = str(ingress["priorities"])
                if len(ingress_files) != len(leaves):
                    raise ValueError(
                        f"ingress: {len(ingress_files)} files for {len(leaves)} leaves"
                    )
                needed += [*ingress_files, ingress_priorities]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{mfile}: malformed ({type(e).__name__}: {e})") from None
    for name in needed:
        if name not in files:
            raise CheckpointError(f"{mfile}: lists no checksum for {name}")
    for name, expected in files.items():
        if os.path.basename(name) != name:
            raise CheckpointError(f"{mfile}: file name {name!r} is not a plain name")
        _check_file(root, name, expected)
    if example is None:
        example = _example_from_paths(mfile, leaves)
    layout = TreeLayout(example)
    if len(layout.leaves) != len(leaves):
        raise CheckpointError(
            f"{mfile}: the example has {len(layout.leaves)} leaves, the checkpoint "
            f"{len(leaves)} ({manifest['layout']['treespec']})"
        )
    for mine, theirs in zip(layout.leaves, leaves, strict=True):
        dtype = np.dtype(theirs["dtype"])
        if (
            mine.name != theirs["name"]
            or mine.dtype != dtype
            or list(mine.shape) != theirs["shape"]
        ):
            raise CheckpointError(
                f"{mfile}: the example's leaf {mine.name} ({mine.dtype}{list(mine.shape)}) "
                f"does not match the checkpoint's {theirs['name']} "
                f"({dtype}{theirs['shape']}, {theirs['file']})"
            )
    if str(layout.treespec) != manifest["layout"]["treespec"]:
        raise CheckpointError(
            f"{mfile}: the example's structure {layout.treespec} differs from the "
            f"checkpoint's {manifest['layout']['treespec']}"
        )
    arrays = [
        _load_packed(root, leaf["file"])
        if leaf.get("codec") is not None
        else _load(root, leaf["file"], mine.dtype, (n, *mine.shape))
        for leaf, mine in zip(leaves, layout.leaves, strict=True)
    ]
    packed = [
        (
            i,
            name,
            level,
            cast("npt.NDArray[np.uint32]", _load(root, f, np.dtype(np.uint32), (packed_count,))),
        )
        for i, name, level, f in packed_rows
    ]
    sequence_meta: npt.NDArray[Any] = np.zeros(0, np.uint8)
    if sequence:
        meta_name = str(manifest["sequence"])
        meta_size = files[meta_name]["bytes"]
        sequence_meta = np.load(os.path.join(root, meta_name), allow_pickle=False)
        if sequence_meta.dtype != np.uint8 or sequence_meta.ndim != 1:
            raise CheckpointError(
                f"{os.path.join(root, meta_name)}: holds {sequence_meta.dtype}"
                f"{list(sequence_meta.shape)}, expected uint8[n] ({meta_size} bytes of file)"
            )
    if fifo or sequence:
        keys: npt.NDArray[Any] = np.zeros(0, np.uint64)
        priorities: npt.NDArray[Any] = np.zeros(0, np.float64)
        times_sampled: npt.NDArray[Any] = np.zeros(0, np.uint32)
    else:
        keys, priorities, times_sampled = (
            _load(root, file, dtype, (n,)) for _, file, dtype in _META_FILES
        )
    if ingress_files:
        ingress_arrays = [
            _load(root, file, mine.dtype, (from_ingress, *mine.shape))
            for file, mine in zip(ingress_files, layout.leaves, strict=True)
        ]
        priorities_in = (
            np.zeros(0, np.float64)
            if sequence
            else _load(root, ingress_priorities, np.dtype(np.float64), (from_ingress,))
        )
    else:
        ingress_arrays = [np.zeros((0, *mine.shape), mine.dtype) for mine in layout.leaves]
        priorities_in = np.zeros(0, np.float64)
    extra = _decode_extra(root, manifest)
    return Loaded(
        fifo=fifo,
        sequence=sequence,
        example=example,
        settings=settings,
        leaves=arrays,
        rows=n,
        keys=keys,
        priorities=priorities,
        times_sampled=times_sampled,
        state=state,
        ingress_leaves=ingress_arrays,
        ingress_priorities=priorities_in,
        sequence_meta=sequence_meta,
        tuning=tuning,
        extra=extra,
        packed=packed,
    )
