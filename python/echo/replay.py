"""Replay strategies: which items a `Server` hands out, which it evicts, and how it paces
inserts against samples. Pass them to `Server(..., sampler=, remover=, rate_limiter=)`.

`Fifo()` (the default sampler) keeps the zero-copy FIFO ring: every sample is handed out
exactly once. Any other sampler turns the server into a replay table of `max_size` items
that are drawn many times, with DeepMind Reverb's semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from echo._echo import check_strategy
from echo._validate import check_int

__all__ = [
    "Fifo",
    "Lifo",
    "MinPriority",
    "MinSize",
    "Prioritized",
    "Queue",
    "RateLimiter",
    "Remover",
    "SampleToInsertRatio",
    "Sampler",
    "Sequence",
    "Uniform",
]


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


@dataclass(frozen=True)
class Fifo:
    """Oldest first. As a sampler: the FIFO ring (each sample once, zero-copy views). As a
    remover: evict the oldest item."""


@dataclass(frozen=True)
class Lifo:
    """Newest first. As a sampler: each batch is the newest items, newest first (use
    `max_times_sampled=1` for a stack). As a remover: evict the newest item."""


@dataclass(frozen=True)
class Uniform:
    """Sampler: every item equally likely, with replacement."""


@dataclass(frozen=True)
class Prioritized:
    """Sampler: item `i` with probability `p_i**exponent / sum_j p_j**exponent`
    (prioritized experience replay; a batch is drawn stratified over the priority mass).

    Args:
        exponent: 0 is uniform, 1 proportional to priority. The paper's default is 0.6.

    Raises:
        TypeError: `exponent` is not a number.
        ValueError: `exponent` is negative, NaN or infinite.
    """

    exponent: float = 0.6

    def __post_init__(self) -> None:
        object.__setattr__(self, "exponent", _check_float("Prioritized(exponent)", self.exponent))
        check_strategy(self)


@dataclass(frozen=True)
class MinPriority:
    """Remover: evict the item with the lowest priority; among equal priorities the oldest."""


@dataclass(frozen=True)
class MinSize:
    """Rate limiter: sampling waits until the table holds `min_size` items; inserts never
    wait (a full table evicts).

    Raises:
        TypeError / ValueError: `min_size` is not an int >= 1.
    """

    min_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_size", check_int("MinSize(min_size)", self.min_size, 1))


@dataclass(frozen=True)
class SampleToInsertRatio:
    """Rate limiter with Reverb's meaning: each item is sampled `samples_per_insert` times on
    average. Inserts wait when samples fall behind and samples wait when inserts do, so that
    `inserts * samples_per_insert - samples` stays within `error_buffer` of
    `min_size_to_sample * samples_per_insert`. Sampling also waits until the table holds
    `min_size_to_sample` items.

    Args:
        samples_per_insert: Target samples per inserted item (> 0).
        min_size_to_sample: Items the table needs before the first sample (>= 1).
        error_buffer: Half-width of the allowed window (a number), or the window itself as
            `(min_diff, max_diff)`. Must span at least `2 * max(1, samples_per_insert)`, or
            inserts and samples could block each other forever.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument is out of range.
    """

    samples_per_insert: float
    min_size_to_sample: int
    error_buffer: float | tuple[float, float]

    def __post_init__(self) -> None:
        spi = _check_float("SampleToInsertRatio(samples_per_insert)", self.samples_per_insert)
        object.__setattr__(self, "samples_per_insert", spi)
        min_size = check_int("SampleToInsertRatio(min_size_to_sample)", self.min_size_to_sample, 1)
        object.__setattr__(self, "min_size_to_sample", min_size)
        self.window  # noqa: B018 -- checks error_buffer's type and shape
        check_strategy(self)  # the values: positive ratio, a wide enough finite window

    @property
    def window(self) -> tuple[float, float]:
        """`(min_diff, max_diff)`: the bounds on `inserts * samples_per_insert - samples`."""
        buffer = self.error_buffer
        if isinstance(buffer, tuple):
            if len(buffer) != 2:
                raise ValueError(
                    "SampleToInsertRatio: error_buffer must be a number or "
                    f"(min_diff, max_diff), got {buffer}"
                )
            return (
                _check_float("SampleToInsertRatio(error_buffer[0])", buffer[0]),
                _check_float("SampleToInsertRatio(error_buffer[1])", buffer[1]),
            )
        half = _check_float("SampleToInsertRatio(error_buffer)", buffer)
        centre = self.min_size_to_sample * self.samples_per_insert
        return (centre - half, centre + half)


@dataclass(frozen=True)
class Queue:
    """Rate limiter: at most `size` unsampled items. Inserts wait while `size` items are
    unsampled, samples while none are. With the FIFO sampler this sizes the ring instead
    (`ceil(size / batch_size)` batches, at least 2).

    Raises:
        TypeError / ValueError: `size` is not an int >= 1.
    """

    size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", check_int("Queue(size)", self.size, 1))


Sampler = Fifo | Lifo | Uniform | Prioritized
Remover = Fifo | Lifo | MinPriority
RateLimiter = MinSize | SampleToInsertRatio | Queue


AtEnd = Literal["pad", "shift", "drop"]


@dataclass(frozen=True)
class Sequence:
    """Makes the server a *sequence table*: samples are steps of streams, each stored once,
    and the server samples windows of `length` consecutive steps of one episode (R2D2,
    Dreamer, n-step returns). Pass it as `Server(example_step, batch_size,
    sequence=Sequence(length=T), max_size=<steps>, sampler=...)`.

    Windows start at steps 0, `period`, 2 `period`, ... of each episode and can be sampled
    once their `length` steps are in. Each leaf of a batch is `(batch_size, length,
    *step_shape)`, and `Sample.mask` `(batch_size, length)` says which steps are real.

    Args:
        length: Steps per window (`T`, >= 1).
        period: Steps between window starts (>= 1); default `length` (windows do not
            overlap). R2D2 uses `length // 2`.
        at_end: The window that would run past an episode's end is `"pad"`ded (zeros, `mask`
            false there; every start before the end gets its window), `"shift"`ed back to end
            on the episode's last step (no padding; not made twice), or `"drop"`ped. An
            episode shorter than `length` gets one padded window with `"pad"` and `"shift"`.
        max_streams: Streams per producer: in-process streams are `0` to `max_streams - 1`,
            and a TCP client may send the rows `0` to `max_streams - 1` (its `send_batch`
            rows). Each stream the table knows costs about `4 * length + 64` bytes until it
            is gone.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: `length`, `period` or `max_streams` below 1, or an unknown `at_end`.
    """

    length: int
    period: int | None = None
    at_end: AtEnd = "pad"
    max_streams: int = 4096

    def __post_init__(self) -> None:
        length = check_int("Sequence(length)", self.length, 1, 2**30 - 1)
        object.__setattr__(self, "length", length)
        period = length if self.period is None else self.period
        object.__setattr__(self, "period", check_int("Sequence(period)", period, 1, 2**30 - 1))
        if not isinstance(self.at_end, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Sequence(at_end) must be a str, got {type(self.at_end).__name__}")
        streams = check_int("Sequence(max_streams)", self.max_streams, 1, 2**32)
        object.__setattr__(self, "max_streams", streams)
        check_strategy(self)  # at_end's word, as the core knows it
