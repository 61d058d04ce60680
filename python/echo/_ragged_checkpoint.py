"""Checkpoints of a ragged server: numpy files of values plus offsets, and a JSON manifest.

```text
path -> .<name>.ckpt-<token>/      (a symbolic link, replaced atomically)
    ragged.json                    the format, the example's leaves, the settings, the counts
    leaf_<i>.npy                   leaf i: every stored sample's rows one after another
                                   ((T_i, *inner_shape)); a fixed leaf (N, *shape)
    leaf_<i>.offsets.npy           a ragged leaf's offsets (N + 1,) int64: sample k is
                                   leaf_<i>[offsets[k]:offsets[k + 1]]
    group_sizes.npy                per entry (a sample or a group), its samples (E,) int64
    priorities.npy                 per entry, its priority (E,) float64
    times_sampled.npy              per entry, its draws (E,) uint32
    policy_versions.npy            a server that keeps policy versions: per sample, the
                                   version of the policy that made it (N,) uint64
    extra.json, extra_<n>.npy      the learner's `extra=` and, after its arrays, the latest
                                   published parameters (as `echo.checkpoint.encode` lays
                                   them out for a fixed-shape checkpoint)
```

Entries are oldest first; a FIFO server's are those not handed out yet. `np.load(...,
mmap_mode="r")` opens every file. `ragged.json` records every other file's size and SHA-256
(`"files"`), and each is checked before anything is loaded (`verify`): a missing, truncated
or corrupted file raises `CheckpointError` naming it. `Server.restore(path)` inserts the
entries again, in order, with their priorities and draw counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from echo.checkpoint import CheckpointError, Extra
from echo.ragged import Ragged

if TYPE_CHECKING:
    from echo._params import Published
    from echo._ragged_server import RaggedServer

FORMAT = "echo-ragged-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "ragged.json"
VERSIONS = "policy_versions.npy"


def is_ragged(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a ragged server's checkpoint."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def _digest(path: str) -> tuple[int, str]:
    """The size and SHA-256 (hex) of the file at `path`."""
    sha = hashlib.sha256()
    size = 0
    buffer = bytearray(1 << 22)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            sha.update(view[:n])  # hashlib releases the GIL for large updates
            size += n
    return size, sha.hexdigest()


def verify(manifest: dict[str, Any], directory: str, names: set[str] | None = None) -> None:
    """Checks the size and SHA-256 of every file `manifest` lists (only those in `names`, when
    given) before anything is loaded; a checkpoint written before files were listed has none
    to check.

    Raises:
        CheckpointError: A file is missing, truncated or corrupted (the message names it).
    """
    files: Any = manifest.get("files", {})
    if not isinstance(files, dict):
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: a malformed file list")
    for name, entry in cast("dict[str, Any]", files).items():
        if names is not None and name not in names:
            continue
        path = os.path.join(directory, os.path.basename(str(name)))
        expected = cast("dict[str, Any]", entry) if isinstance(entry, dict) else {}
        if not {"bytes", "sha256"} <= set(expected):
            raise CheckpointError(f"{path}: a malformed entry in {MANIFEST}")
        try:
            size, digest = _digest(path)
        except OSError as e:
            raise CheckpointError(f"{path}: missing or unreadable ({e})") from None
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the manifest says {expected['bytes']} (truncated?)"
            )
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"{path}: SHA-256 {digest} differs from the manifest's {expected['sha256']} "
                "(corrupted)"
            )


def extra_files(manifest: dict[str, Any]) -> set[str]:
    """The files of the learner's extra (and the published parameters) the manifest names."""
    found: Any = manifest.get("extra")
    if not isinstance(found, dict):
        return set()
    extra = cast("dict[str, Any]", found)
    arrays: Any = extra.get("arrays", [])
    names: set[str] = set()
    if isinstance(arrays, list):
        names = {str(a) for a in cast("list[Any]", arrays)}
    return names | {str(extra.get("file"))}


def _save(directory: str, name: str, array: np.ndarray[Any, Any]) -> None:
    with open(os.path.join(directory, name), "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


class _Opened:
    """A ragged checkpoint's extra as `echo.checkpoint`'s decoder reads an opened one: its
    directory, `extra.json`'s name (None without an extra) and the arrays it may name."""

    def __init__(self, directory: str, manifest: dict[str, Any]) -> None:
        found: Any = manifest.get("extra")
        extra = cast("dict[str, Any]", found) if isinstance(found, dict) else {}
        arrays: Any = extra.get("arrays", [])
        self.root = directory
        self.extra: str | None = None if not extra else str(extra.get("file"))
        self._arrays: set[str] = (
            {str(a) for a in cast("list[Any]", arrays)} if isinstance(arrays, list) else set()
        )

    def lists(self, name: str) -> bool:
        return name in self._arrays


def read_extra(manifest: dict[str, Any], directory: str) -> Any:
    """The learner's state stored with the checkpoint (`checkpoint(path, extra=...)`), or
    None."""
    from echo.checkpoint import decode_extra_of

    return decode_extra_of(_Opened(directory, manifest))


def read_params(manifest: dict[str, Any], directory: str) -> Published | None:
    """The parameters the learner had published last (`publish()`), stored in the extra's
    files as a fixed-shape checkpoint stores them; None when it had published none."""
    from echo.checkpoint import decode_params_of

    return decode_params_of(_Opened(directory, manifest))


def _write_extra(directory: str, extra: Extra) -> dict[str, Any]:
    """Writes an encoded extra (`extra.json` and one `.npy` per array) into `directory`; its
    entry of the manifest."""
    import ast

    tree, arrays = extra
    names: list[str] = []
    for i, (descr, shape, data) in enumerate(arrays):
        name = f"extra_{i:03d}.npy"
        dtype: Any = np.lib.format.descr_to_dtype(ast.literal_eval(descr))  # pyright: ignore[reportUnknownMemberType]
        array: Any = np.frombuffer(data.tobytes(), dtype)
        _save(directory, name, array.reshape(shape))
        names.append(name)
    with open(os.path.join(directory, "extra.json"), "wb") as f:
        f.write(tree)
        f.flush()
        os.fsync(f.fileno())
    return {"file": "extra.json", "arrays": names}


def write(
    server: RaggedServer,
    path: str | os.PathLike[str],
    settings: dict[str, Any],
    extra: Extra | None = None,
) -> int:
    """Writes `server`'s entries to `path` (see the module), with the learner's `extra`
    (encoded by `echo.checkpoint.encode_extra`); returns the bytes written."""
    target: str = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(target)
    if os.path.lexists(target) and not os.path.islink(target):
        raise FileExistsError(f"{target} exists and is not a checkpoint link")
    buffer = server._buffer  # pyright: ignore[reportPrivateUsage]
    exported: Any = buffer.core.export()
    values, rows, sizes, priorities, times, sessions = exported
    leaves = buffer.layout.leaves
    # A table that keeps policy versions stores one more leaf, last: each sample's version.
    n = len(rows) // len(values)
    per_sample = rows.reshape(n, len(values))
    directory = os.path.join(parent, f".{name}.ckpt-{secrets.token_hex(8)}")
    os.mkdir(directory)
    try:
        described: list[dict[str, Any]] = []
        for i, leaf in enumerate(leaves):
            dtype: Any = leaf.dtype
            data: Any = values[i].view(dtype) if values[i].size else np.empty(0, dtype)
            if leaf.ragged is None:
                _save(directory, f"leaf_{i}.npy", data.reshape(n, *leaf.shape))
            else:
                _save(directory, f"leaf_{i}.npy", data.reshape(-1, *leaf.shape))
                offsets = np.zeros(n + 1, np.int64)
                np.cumsum(per_sample[:, i], out=offsets[1:])
                _save(directory, f"leaf_{i}.offsets.npy", offsets)
            described.append(
                {
                    "name": leaf.name,
                    "path": list(leaf.path),
                    "dtype": str(dtype.str),
                    "shape": list(leaf.shape),
                    "max_len": None if leaf.ragged is None else leaf.ragged.max_len,
                    "group": None if leaf.ragged is None else leaf.ragged.group,
                }
            )
        if buffer.versioned:
            _save(directory, VERSIONS, values[-1].view(np.uint64).reshape(n))
        _save(directory, "group_sizes.npy", sizes)
        _save(directory, "priorities.npy", priorities)
        _save(directory, "times_sampled.npy", times)
        # The TCP workers' sessions: how many of each one's samples are stored, matching
        # the entries (a restored server resumes each reconnecting worker from there).
        ids: Any = np.frombuffer(b"".join(bytes(i) for i, _ in sessions), np.uint8)
        _save(directory, "session_ids.npy", ids.reshape(len(sessions), 16))
        _save(directory, "session_stored.npy", np.array([n for _, n in sessions], np.uint64))
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "leaves": described,
            "settings": {**settings, "params_version": int(buffer.core.params_version)},
            "counts": {"samples": n, "entries": len(sizes), "sessions": len(sessions)},
        }
        if extra is not None:
            manifest["extra"] = _write_extra(directory, extra)
        # Every file's size and SHA-256, checked before a restore loads anything.
        manifest["files"] = {
            name: dict(
                zip(("bytes", "sha256"), _digest(os.path.join(directory, name)), strict=True)
            )
            for name in sorted(os.listdir(directory))
        }
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        written = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        old = os.path.realpath(target) if os.path.islink(target) else None
        link = os.path.join(parent, f".{name}.link-{secrets.token_hex(8)}")
        os.symlink(os.path.basename(directory), link)
        os.replace(link, target)
    except BaseException:
        _remove(directory)
        raise
    # Durable workers let go of what this checkpoint holds.
    buffer.core.note_persisted(sessions)
    if old is not None and os.path.dirname(old) == parent and old != directory:
        _remove(old)
    return written


def _remove(directory: str) -> None:
    with contextlib.suppress(OSError):
        for f in os.listdir(directory):
            os.remove(os.path.join(directory, f))
        os.rmdir(directory)


def _example_from(leaves: list[dict[str, Any]]) -> dict[str, Any]:
    """The example, rebuilt from the leaves' paths (dicts of str keys)."""
    root: dict[str, Any] = {}
    for leaf in leaves:
        path = leaf["path"]
        if not path or not all(isinstance(key, str) for key in path):
            raise CheckpointError(
                f"leaf {leaf['name']} is not under str keys: pass the example to restore()"
            )
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        dtype = np.dtype(leaf["dtype"])
        if leaf["max_len"] is None:
            node[path[-1]] = np.zeros(tuple(leaf["shape"]), dtype)
        else:
            node[path[-1]] = Ragged(
                leaf["max_len"], dtype, tuple(leaf["shape"]), group=leaf["group"]
            )
    return root


def read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """The manifest of the ragged checkpoint at `path`, and its directory."""
    directory: str = os.path.realpath(os.fspath(path))
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory}: not a version-{FORMAT_VERSION} ragged echo checkpoint "
            f"(format {manifest.get('format')!r}, version {manifest.get('format_version')!r})"
        )
    return manifest, directory


def example_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return _example_from(manifest["leaves"])


def sessions_of(manifest: dict[str, Any], directory: str) -> list[tuple[bytes, int]]:
    """The TCP workers' sessions the checkpoint holds: (session id, samples stored) each;
    none in a checkpoint written before sessions were kept."""
    if "sessions" not in manifest.get("counts", {}):
        return []
    try:
        ids = np.load(os.path.join(directory, "session_ids.npy"), allow_pickle=False)
        stored = np.load(os.path.join(directory, "session_stored.npy"), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}: the sessions: {e}") from None
    count = int(manifest["counts"]["sessions"])
    if ids.shape != (count, 16) or stored.shape != (count,):
        raise CheckpointError(
            f"{directory}: {count} sessions in the manifest, arrays of {ids.shape} and "
            f"{stored.shape}"
        )
    return [(bytes(ids[i]), int(stored[i])) for i in range(count)]


def refill(server: RaggedServer, manifest: dict[str, Any], directory: str) -> None:
    """Inserts the checkpoint's entries into the new `server`, in order."""
    leaves = manifest["leaves"]
    layout = server._buffer.layout  # pyright: ignore[reportPrivateUsage]
    if [leaf.name for leaf in layout.leaves] != [leaf["name"] for leaf in leaves]:
        raise CheckpointError(
            f"{directory}: the example's leaves {[leaf.name for leaf in layout.leaves]} differ "
            f"from the checkpoint's {[leaf['name'] for leaf in leaves]}"
        )

    def load(name: str) -> np.ndarray[Any, Any]:
        try:
            return np.load(os.path.join(directory, name), mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(directory, name)}: {e}") from None

    data = [load(f"leaf_{i}.npy") for i in range(len(leaves))]
    offsets = [
        None if leaf["max_len"] is None else load(f"leaf_{i}.offsets.npy")
        for i, leaf in enumerate(leaves)
    ]
    sizes, priorities, times = (
        load("group_sizes.npy"),
        load("priorities.npy"),
        load("times_sampled.npy"),
    )
    versions = load(VERSIONS) if server._buffer.versioned else None  # pyright: ignore[reportPrivateUsage]
    n = int(manifest["counts"]["samples"])
    if int(np.sum(sizes)) != n or len(sizes) != len(priorities) or len(sizes) != len(times):
        raise CheckpointError(f"{directory}: the entry arrays disagree with the sample count")
    core = server._buffer.core  # pyright: ignore[reportPrivateUsage]
    replay = server._buffer.kind != "fifo"  # pyright: ignore[reportPrivateUsage]
    k = 0
    for size, priority, drawn in zip(sizes, priorities, times, strict=True):
        group: list[list[Any]] = []
        for s in range(k, k + int(size)):
            sample: list[Any] = []
            for i, leaf_offsets in enumerate(offsets):
                if leaf_offsets is None:
                    sample.append(np.array(data[i][s]))  # 0-d stays 0-d
                else:
                    a, b = int(leaf_offsets[s]), int(leaf_offsets[s + 1])
                    sample.append(np.ascontiguousarray(data[i][a:b]))
            group.append(sample)
        stamps = None if versions is None else [int(v) for v in versions[k : k + int(size)]]
        k += int(size)
        key = core.submit_group(group, None, float(priority) if replay else None, stamps)
        if drawn and key is not None:  # None: stale (not under the checkpoint's own version)
            core.set_times_sampled(key, int(drawn))
