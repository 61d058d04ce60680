"""The samples of the wire-compression tests across hosts (`test_multihost.py`), imported by
their learner and worker processes: a token leaf that compresses well (one value repeated),
ragged or padded to a fixed shape, and an id."""

from __future__ import annotations

from typing import Any

import numpy as np

import echo

#: What the learner asks its workers to compress.
COMPRESS = {"tokens": echo.Zstd(1)}


def example(kind: str) -> dict[str, Any]:
    if kind == "ragged":
        return {"tokens": echo.Ragged(512, np.int32), "id": np.zeros((), np.int64)}
    return {"tokens": np.zeros((300,), np.int32), "id": np.zeros((), np.int64)}


def make(kind: str, i: int) -> dict[str, Any]:
    rows = 64 + i % 300 if kind == "ragged" else 300
    return {"tokens": np.full(rows, i % 7, np.int32), "id": np.int64(i)}
