"""What `Server` checks and derives from its arguments beside the pytree: where the CUDA
runtime is looked for, the keys and priorities of `update_priorities`, the periodic
checkpoint settings, and the settings a `restore()` takes back from a checkpoint."""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from echo._pytree import TreeLayout
from echo._validate import check_bool, check_int, check_seconds
from echo.compression import Codec, Compress
from echo.replay import Fifo, RateLimiter, Remover, Sampler, Sequence


def cuda_runtime_candidates() -> list[str]:
    """Where to look for the CUDA runtime, most specific first: $ECHO_CUDART, the runtimes of
    the NVIDIA wheels (`nvidia-cuda-runtime-cu12` installs `nvidia/cuda_runtime/lib`, the CUDA
    13 wheel `nvidia/cu13/lib`; PyTorch and JAX pull them in), then the loader's search path."""
    candidates: list[str] = []
    explicit = os.environ.get("ECHO_CUDART")
    if explicit:
        candidates.append(explicit)
    try:
        import nvidia  # pyright: ignore

        for root in nvidia.__path__:  # pyright: ignore
            pattern = os.path.join(str(root), "*", "lib", "libcudart.so*")  # pyright: ignore
            candidates += sorted(glob.glob(pattern), reverse=True)
    except ImportError:
        pass
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    return candidates


def keys_array(keys: Any) -> npt.NDArray[np.uint64]:
    array = np.asarray(keys)
    if array.size == 0 and array.ndim == 1:  # `[]` is float64 to numpy; nothing to update
        return np.zeros(0, np.uint64)
    if array.dtype.kind not in "ui":
        raise TypeError(
            f"keys must be integers (the uint64 Sample.keys of a batch), got dtype {array.dtype}"
        )
    if array.ndim != 1:
        raise ValueError(f"keys must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "i" and array.size and int(array.min()) < 0:
        raise ValueError(f"keys must be >= 0, got {int(array.min())}")
    return np.ascontiguousarray(array, dtype=np.uint64)


def priorities_array(priorities: Any) -> npt.NDArray[np.float64]:
    array = np.asarray(priorities)
    if array.dtype.kind not in "uif":
        raise TypeError(f"priorities must be real numbers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"priorities must be 1-D, got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.float64)


# How long `close()` waits for a periodic checkpoint in progress before leaving its thread.
PERIODIC_JOIN_S = 60.0


@dataclass(frozen=True)
class Periodic:
    """Checked arguments of periodic checkpoints."""

    directory: str
    every: float
    keep: int
    extra: Callable[[], Any] | None


def periodic_args(
    checkpoint_dir: Any, checkpoint_every: Any, checkpoint_keep: Any, checkpoint_extra: Any
) -> Periodic | None:
    """The checked periodic checkpoint settings, or None when off."""
    keep = check_int("checkpoint_keep", checkpoint_keep, 1)
    if checkpoint_extra is not None and not callable(checkpoint_extra):
        raise TypeError(
            "checkpoint_extra must be a callable taking no arguments (it returns the extra "
            f"tree of each periodic checkpoint), got {type(checkpoint_extra).__name__}"
        )
    if checkpoint_dir is None:
        if checkpoint_every is not None:
            raise ValueError("checkpoint_every needs checkpoint_dir (where to write them)")
        if checkpoint_extra is not None:
            raise ValueError(
                "checkpoint_extra needs checkpoint_dir and checkpoint_every: it is called for "
                "periodic checkpoints (pass extra= to checkpoint() for a manual one)"
            )
        return None
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_dir must be a str or os.PathLike, got {type(checkpoint_dir).__name__}"
        )
    path_like: str | os.PathLike[Any] = checkpoint_dir  # pyright: ignore[reportUnknownVariableType]
    directory: object = os.fspath(path_like)  # pyright: ignore[reportUnknownArgumentType]
    if not isinstance(directory, str):
        raise TypeError("checkpoint_dir must be a str path, got bytes")
    if checkpoint_every is None:
        raise ValueError("checkpoint_dir needs checkpoint_every (seconds between checkpoints)")
    every = check_seconds("checkpoint_every", checkpoint_every, optional=False)
    assert every is not None
    if not math.isfinite(every):
        raise ValueError(f"checkpoint_every must be finite, got {checkpoint_every!r}")
    return Periodic(directory, every, keep, cast("Callable[[], Any] | None", checkpoint_extra))


def versions_args(policy_versions: Any, max_staleness: Any, admission: Any) -> dict[str, Any]:
    """The checked policy version settings, as `ServerConfig` fields."""
    kept = check_bool("policy_versions", policy_versions)
    bound = None if max_staleness is None else check_int("max_staleness", max_staleness, 0, 2**63)
    if not isinstance(admission, str):
        raise TypeError(f"admission must be a str, got {type(admission).__name__}")
    if admission not in ("drop", "block"):
        raise ValueError(f"admission must be 'drop' or 'block', got {admission!r}")
    if admission == "block" and bound is None:
        raise ValueError(
            "admission='block' needs max_staleness (how many versions a worker may lag "
            "before its send() waits for newer parameters)"
        )
    return {
        "policy_versions": kept or bound is not None,
        "max_staleness": bound,
        "admission": admission,
    }


# The settings a checkpoint records as part of its data: `restore()` takes them only as checks.
_DATA_SETTINGS = (
    "batch_size",
    "sampler",
    "remover",
    "max_size",
    "rate_limiter",
    "max_times_sampled",
    "sequence",
)


def restored_settings(opened: Any, given: dict[str, Any], path: str) -> dict[str, Any]:
    """The checkpoint's data settings as `Server` keyword arguments, after checking the ones
    `restore()` was given against them (ValueError naming the setting and both values).
    `opened`: the checkpoint (`echo._echo.OpenedCheckpoint`)."""
    recorded: dict[str, Any] = opened.server_kwargs()
    kind: str = opened.kind_description
    theirs_of = dict(recorded)
    if opened.kind == "fifo":
        theirs_of["sampler"] = Fifo()
    for name in _DATA_SETTINGS:
        mine = given[name]
        if mine is None:
            continue
        if name in ("batch_size", "max_size", "max_times_sampled"):
            mine = check_int(name, mine, 0)
        if name not in theirs_of:
            hint = " (pass num_buffers= to size the ring)" if name == "rate_limiter" else ""
            raise ValueError(
                f"restore(): {name}={mine!r} does not apply: the checkpoint at {path} is {kind}, "
                f"which has no {name}{hint}"
            )
        theirs = theirs_of[name]
        if mine != theirs:
            raise ValueError(
                f"restore(): {name}={mine!r} conflicts with the checkpoint's {name}={theirs!r} "
                f"({path}): {name} is part of what the checkpoint recorded (the data and how "
                f"it is sampled), so a restore keeps it; omit {name}, or pass {theirs!r}"
            )
    return recorded


def recorded_compress(example: Any, tuning: dict[str, Any]) -> Compress:
    """The checkpoint's `compress` (a codec or None per leaf, as recorded in its `tuning`) as a
    mapping of the example's leaf paths to codecs (None: none)."""
    recorded: list[Codec | None] | None = tuning.get("compress")
    if recorded is None:
        return None
    layout = TreeLayout(example)
    return {
        path: codec for path, codec in zip(layout.paths, recorded, strict=True) if codec is not None
    }


@dataclass(frozen=True)
class ServerConfig:
    """`Server`'s arguments as `ServerCore` reads them (src/python/config.rs): their types
    checked here, their values and how they combine checked natively, in one place."""

    batch_size: int
    num_buffers: int
    num_drainers: int
    producer_queue_size: int | None
    sampler: Sampler
    remover: Remover | None
    rate_limiter: RateLimiter | None
    max_size: int | None
    max_times_sampled: int
    seed: int | None
    sequence: Sequence | None
    # Per leaf: its codec or None, resolved from `compress=` against the layout.
    compress: tuple[Codec | None, ...] = ()
    max_bytes: int | None = None
    # The `server` label of its metrics; checkpoints record it, restores keep it.
    name: str = "default"
    # Whether samples carry their policy version, the staleness bound, and what happens to
    # samples past it ("drop" or "block").
    policy_versions: bool = False
    max_staleness: int | None = None
    admission: str = "drop"
