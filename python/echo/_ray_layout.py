"""What `echo.ray` records of a shard's samples and checks a worker's example against: each
leaf's name, dtype and shape (a ragged leaf's shape as `("0..max_len", *inner_shape)`)."""

from __future__ import annotations

from typing import Any

from echo._pytree import TreeLayout
from echo._ragged_server import RaggedServer
from echo.ragged import RaggedLayout, has_ragged_leaves
from echo.server import Server

Record = list[tuple[str, str, tuple[Any, ...]]]
"""A layout as a registration records it: (name, dtype, shape) per leaf."""


def layout_record(layout: TreeLayout) -> Record:
    return [(leaf.name, str(leaf.dtype), tuple(leaf.shape)) for leaf in layout.leaves]


def ragged_record(layout: RaggedLayout) -> Record:
    """A ragged example's leaves: a ragged leaf's shape is `("0..max_len", *inner_shape)`."""
    return [
        (
            leaf.name,
            str(leaf.dtype),
            tuple(leaf.shape)
            if leaf.ragged is None
            else (f"0..{leaf.ragged.max_len}", *leaf.shape),
        )
        for leaf in layout.leaves
    ]


def example_record(example: Any) -> Record:
    """The leaves of a worker's example, as a registration records a shard's."""
    if has_ragged_leaves(example):
        return ragged_record(RaggedLayout(example))
    return layout_record(TreeLayout(example))


def server_record(server: Server) -> Record:
    if isinstance(server, RaggedServer):
        return ragged_record(server._buffer.layout)  # pyright: ignore[reportPrivateUsage]
    return layout_record(server._layout)  # pyright: ignore[reportPrivateUsage]


def layout_mismatch(theirs: Record, ours: Record) -> str | None:
    """What differs between a shard's layout and an example's, or `None`."""
    their_names = [name for name, _, _ in theirs]
    our_names = [name for name, _, _ in ours]
    if their_names != our_names:
        missing = [n for n in their_names if n not in our_names]
        extra = [n for n in our_names if n not in their_names]
        if missing or extra:
            return f"leaves the example lacks: {missing}; leaves the shard lacks: {extra}"
        return f"the leaves are in another order: the shard's are {their_names}"
    for (name, their_dtype, their_shape), (_, our_dtype, our_shape) in zip(
        theirs, ours, strict=True
    ):
        if their_dtype != our_dtype or tuple(their_shape) != tuple(our_shape):
            return (
                f"leaf {name!r}: the shard stores {their_dtype} {tuple(their_shape)}, the "
                f"example has {our_dtype} {tuple(our_shape)}"
            )
    return None
