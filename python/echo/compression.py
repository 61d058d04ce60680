"""Compressed observations: which leaves a replay table stores compressed, and how.

Pass `compress=` to `Server` with a replay sampler:

- `{"obs": echo.Zstd(level=1)}`: a mapping from leaf paths to codecs. A path is a top-level
  key (`"obs"`), keys joined by `/` (`"obs/pixels"`), or a tuple of keys and indices
  (`("obs", 0)`); a path that names a subtree compresses every leaf under it.
- `"auto"`: every uint8/int8 leaf of at least 4 KiB (image observations), with `Zstd(1)`.
- A codec alone (`echo.Lz4()`): the leaves `"auto"` picks, with that codec.

Image observations compress 10-70x one frame at a time (zstd level 1 on Atari frames); float
leaves hardly compress and small leaves cost more to compress than they save, so a codec on
a floating-point leaf needs `force=True`. See the compression guide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union, cast

import numpy as np

from echo._echo import check_codec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from echo._pytree import TreeLayout

__all__ = ["AUTO_MIN_BYTES", "Codec", "Compress", "Lz4", "Zstd"]

# `compress="auto"` picks uint8/int8 leaves of at least this many bytes.
AUTO_MIN_BYTES = 4096


def _check_force(name: str, force: object) -> None:
    if not isinstance(force, bool):
        raise TypeError(f"{name}(force) must be a bool, got {type(force).__name__}")


@dataclass(frozen=True)
class Zstd:
    """Zstandard, the default choice: on Atari frames level 1 stores one observation in
    1/12 (MsPacman) to 1/68 (Pong) of its bytes and decompresses at 2-5 GB/s per core.

    Args:
        level: -7 to -1 (faster, less compression) or 1 to 22 (slower, more); 1 is the
            field's choice for replay (higher levels cost insert time for a few percent).
        force: Allow a floating-point leaf (which rarely compresses).

    Raises:
        TypeError: `level` is not an int or `force` not a bool.
        ValueError: `level` is 0 or out of range.
    """

    level: int = 1
    force: bool = False

    def __post_init__(self) -> None:
        level = self.level
        if isinstance(level, bool) or not isinstance(level, int):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Zstd(level) must be an int, got {type(level).__name__}")
        _check_force("Zstd", self.force)
        check_codec(self)  # the level's range, as the core defines it


@dataclass(frozen=True)
class Lz4:
    """LZ4: about 0.6x zstd-1's ratio on Atari frames, but 3-4x faster to decompress; for
    learners whose sampling rate matters more than memory.

    Args:
        force: Allow a floating-point leaf (which rarely compresses).

    Raises:
        TypeError: `force` is not a bool.
    """

    force: bool = False

    def __post_init__(self) -> None:
        _check_force("Lz4", self.force)


Codec = Zstd | Lz4
"""A codec: `Zstd(...)` or `Lz4()`."""

Compress = Union["Mapping[Any, Codec | None]", Literal["auto"], Zstd, Lz4, None]
"""What `Server(compress=)` takes."""

# Per leaf, the codec it is stored with (None: raw), as the native config reads it.
Resolved = tuple[Codec | None, ...]


def _accepted(codec: Codec) -> Codec:
    """`codec` with `force=True`: it has been accepted for its leaf (as the core reports
    codecs back, so that a resolved codec compares equal to a reported one)."""
    return Zstd(codec.level, force=True) if isinstance(codec, Zstd) else Lz4(force=True)


def _is_codec(value: object) -> bool:
    return isinstance(value, (Zstd, Lz4))


def _path_of(key: object) -> tuple[Any, ...]:
    if isinstance(key, tuple):
        return cast("tuple[Any, ...]", key)
    if isinstance(key, str):
        return tuple(key.split("/")) if "/" in key else (key,)
    return (key,)


def _auto(layout: TreeLayout, codec: Codec) -> Resolved:
    return tuple(
        _accepted(codec)
        if leaf.dtype.kind in "ui"
        and leaf.dtype.itemsize == 1
        and int(np.prod(leaf.shape)) >= AUTO_MIN_BYTES
        else None
        for leaf in layout.leaves
    )


def resolve(compress: object, layout: TreeLayout) -> Resolved:
    """Each leaf's codec (None: raw) from what `Server(compress=)` was given.

    Raises:
        TypeError: `compress` or a codec is of the wrong type.
        ValueError: A path names no leaf, or a codec is on a floating-point leaf without
            `force=True`, or on an empty leaf.
    """
    if compress is None:
        return (None,) * len(layout.leaves)
    if compress == "auto":
        return _auto(layout, Zstd(1))
    if _is_codec(compress):
        return _auto(layout, cast("Codec", compress))
    if isinstance(compress, str):
        raise ValueError(f'compress must be "auto", a codec or a mapping, got {compress!r}')
    if not hasattr(compress, "items"):
        raise TypeError(
            "compress must be a mapping of leaf paths to codecs (e.g. {'obs': echo.Zstd()}), "
            f'"auto" or a codec, got {type(compress).__name__}'
        )
    mapping = cast("Mapping[Any, object]", compress)
    chosen: list[Codec | None] = [None] * len(layout.leaves)
    for key, codec in mapping.items():
        path = _path_of(key)
        hits = [i for i, p in enumerate(layout.paths) if p[: len(path)] == path]
        if not hits:
            names = ", ".join(leaf.name for leaf in layout.leaves)
            raise ValueError(
                f"compress: no leaf at path {key!r}; the example's leaves are {names} "
                "(a path is a key, keys joined by '/', or a tuple of keys)"
            )
        if codec is None:
            continue
        if not _is_codec(codec):
            raise TypeError(
                f"compress[{key!r}] must be echo.Zstd(...), echo.Lz4() or None, got "
                f"{type(codec).__name__}"
            )
        typed = cast("Codec", codec)
        for i in hits:
            leaf = layout.leaves[i]
            if leaf.dtype.kind in "fc" and not typed.force:
                raise ValueError(
                    f"compress: leaf {leaf.name} is {leaf.dtype}, and floating-point data "
                    f"rarely compresses (low bits are noise); pass {type(typed).__name__}("
                    "force=True) to compress it anyway"
                )
            if int(np.prod(leaf.shape)) * leaf.dtype.itemsize == 0:
                raise ValueError(f"compress: leaf {leaf.name} is empty (0 bytes)")
            chosen[i] = _accepted(typed)
    return tuple(chosen)
