"""Type stubs for the native module `echo._echo` (checked against it by mypy.stubtest)."""

from collections.abc import Callable
from typing import Any, Final, Literal, final

import numpy as np
import numpy.typing as npt

from echo._pytree import TreeLayout
from echo._server_args import ServerConfig
from echo.client import _ClientSettings  # pyright: ignore[reportPrivateUsage]
from echo.compression import Codec
from echo.transport import TcpTransport

__version__: Final[str]
RING_ALIGN: Final[int]
CHECKPOINT_FORMAT_VERSION: Final[int]
"""The newest checkpoint format version this echo reads."""
DETAILED_METRICS: Final[bool]
"""Whether this build records the detailed metrics (cargo feature `detailed-metrics`)."""

class ConnectionClosedError(ConnectionError):
    """The connection to the peer is closed (by `close()` or because the peer went away)."""

class ServerClosedError(ConnectionClosedError, RuntimeError):
    """The server was closed: nothing more can be submitted or started, and a worker's
    connection to it is closed for good. A `ConnectionClosedError` and a `RuntimeError`."""

class CheckpointError(ValueError):
    """A checkpoint cannot be restored: a file is missing, truncated or corrupted (its SHA-256
    differs from the manifest's), its format version is newer than this echo reads, or the
    example does not match its layout. The message names the file and what is wrong."""

class SharedMemoryError(ConnectionError):
    """`shared_memory=True` and the same-host shared-memory path cannot be had (the message
    says why)."""

@final
class HistSnapshot:
    """A latency histogram snapshot in nanoseconds; all zero without `detailed-metrics`.
    A plain value: equal when every field is, hashable, picklable (the copy is equal)."""

    def __new__(
        cls,
        count: int = 0,
        min_ns: int = 0,
        max_ns: int = 0,
        mean_ns: float = 0.0,
        p50_ns: int = 0,
        p90_ns: int = 0,
        p99_ns: int = 0,
    ) -> HistSnapshot:
        """A snapshot with these values (what unpickling calls; echo builds its own)."""
    def __reduce__(
        self,
    ) -> tuple[type[HistSnapshot], tuple[int, int, int, float, int, int, int]]: ...
    @property
    def count(self) -> int: ...
    @property
    def min_ns(self) -> int: ...
    @property
    def max_ns(self) -> int: ...
    @property
    def mean_ns(self) -> float: ...
    @property
    def p50_ns(self) -> int: ...
    @property
    def p90_ns(self) -> int: ...
    @property
    def p99_ns(self) -> int: ...
    def as_dict(self) -> dict[str, int | float]:
        """The fields as a plain dict."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class SampleInfo:
    """What the server looked like when a batch was handed out, or at `stats()`: a frozen,
    plain value. Equal when every field is (the replay arrays by dtype, shape and elements),
    hashable (the hash leaves the arrays out, so it agrees with `==`), picklable (the copy is
    equal); the `repr` lists the fields that are not 0."""

    @property
    def store_size(self) -> int:
        """Committed samples not yet handed to the consumer."""
    @property
    def active_connections(self) -> int:
        """Open transport connections."""
    @property
    def queue_depth_sum(self) -> int:
        """Samples waiting in all ingress queues."""
    @property
    def queue_depth_max(self) -> int:
        """Samples waiting in the fullest ingress queue."""
    @property
    def push_blocked_count(self) -> int:
        """Times a transport task found its queue full and waited."""
    @property
    def push_blocked_ns_total(self) -> int:
        """Nanoseconds transport tasks spent in those waits (backpressure time)."""
    @property
    def ring_blocked_ns_total(self) -> int:
        """FIFO: nanoseconds writers spent waiting for free ring slots (0 for replay)."""
    @property
    def samples_inserted_total(self) -> int:
        """Samples moved into the ring by drainers (`submit()` is not counted)."""
    @property
    def samples_submitted_total(self) -> int:
        """Samples put in by in-process `submit()`/`submit_batch()`, counted as each returns."""
    @property
    def samples_stale_at_insert_total(self) -> int:
        """Samples older than `max_staleness` versions, dropped as they went in."""
    @property
    def samples_stale_at_sample_total(self) -> int:
        """Samples skipped when the learner's draw or batch met them older than
        `max_staleness` versions."""
    @property
    def samples_versioned_total(self) -> int:
        """Samples handed to the learner with a policy version."""
    @property
    def version_lag_total(self) -> int:
        """The sum of their lags behind the latest version as they were handed out."""
    @property
    def version_lag_max(self) -> int:
        """The largest such lag."""
    @property
    def params_version(self) -> int:
        """The latest published parameter version (0: none)."""
    @property
    def params_published_total(self) -> int:
        """`publish()` calls."""
    @property
    def params_chunks_served_total(self) -> int:
        """Parameter chunks served to workers."""
    @property
    def params_bytes_served_total(self) -> int:
        """Bytes of parameters served to workers."""
    @property
    def buffered_bytes(self) -> int:
        """Bytes of sample buffers the TCP ingress holds now (queued samples, buffer pools,
        same-host shared-memory segments), at most `TcpTransport.max_buffered_bytes`."""
    @property
    def connections_refused_total(self) -> int:
        """Connections refused because every slot was taken by a working connection."""
    @property
    def connections_evicted_total(self) -> int:
        """Idle connections closed to admit new ones (see the TCP guide's connection limit)."""
    @property
    def samples_pending(self) -> int:
        """Samples acknowledged to TCP workers and not yet in the ring (queued in the ingress)."""
    @property
    def samples_received_in_place_total(self) -> int:
        """Of `samples_inserted_total`, samples the TCP ingress read from their socket straight
        into the FIFO ring (large samples already whole in the kernel's buffer): one copy
        fewer than through a connection queue."""
    @property
    def v1_connections_total(self) -> int:
        """TCP connections that negotiated wire protocol 1 (id-echo 0.2.1, `protocol=1`)."""
    @property
    def v2_connections_total(self) -> int:
        """TCP connections that negotiated wire protocol 2."""
    @property
    def sessions_resumed_total(self) -> int:
        """v2 reconnections that resumed their session on this server."""
    @property
    def samples_deduplicated_total(self) -> int:
        """Samples reconnecting clients did not resend because they were already queued."""
    @property
    def handshakes_refused_protocol_total(self) -> int:
        """Handshakes refused as malformed, or v1 clients at a server with a token."""
    @property
    def handshakes_refused_auth_total(self) -> int:
        """Handshakes refused for a missing or wrong token."""
    @property
    def handshakes_refused_layout_total(self) -> int:
        """Handshakes refused because the client's samples have another dtype, leaf name or
        shape."""
    @property
    def shm_connections_total(self) -> int:
        """v2 connections whose samples came through same-host shared memory."""
    @property
    def shm_fallbacks_total(self) -> int:
        """v2 connections that wanted shared memory and sent over TCP instead (another host,
        `TcpTransport(shared_memory=False)`, or the attach failed)."""
    @property
    def samples_received_compressed_total(self) -> int:
        """Samples that arrived over TCP in compressed frames (the worker compressed the
        leaves the learner's `compress=` names)."""
    @property
    def compressed_bytes_received_total(self) -> int:
        """Bytes those samples took on the wire (the frames' bodies)."""
    @property
    def notify_count(self) -> int:
        """Consumer wake-ups: one per completed batch."""
    @property
    def cas_success_total(self) -> int: ...
    @property
    def cas_failure_total(self) -> int: ...
    @property
    def reservation_retries_total(self) -> int: ...
    @property
    def drain_round(self) -> HistSnapshot: ...
    @property
    def memcpy(self) -> HistSnapshot: ...
    @property
    def queue_dwell(self) -> HistSnapshot: ...
    @property
    def items_sampled_total(self) -> int:
        """Replay only (0 for FIFO): items handed out; a batch counts `batch_size`."""
    @property
    def evicted_total(self) -> int:
        """Replay only: items evicted by the remover because the table was full."""
    @property
    def removed_max_times_sampled_total(self) -> int:
        """Replay only: items removed after `max_times_sampled` draws."""
    @property
    def priority_updates_total(self) -> int:
        """Replay only: priorities changed by `update_priorities`."""
    @property
    def unknown_keys_total(self) -> int:
        """Replay only: keys `update_priorities` skipped (evicted, removed or never seen)."""
    @property
    def insert_blocked_ns_total(self) -> int:
        """Replay only: nanoseconds inserts spent waiting for the rate limiter."""
    @property
    def sample_blocked_ns_total(self) -> int:
        """Replay only: nanoseconds `sample()` spent waiting."""
    @property
    def steps_stored(self) -> int:
        """Sequence tables only: steps stored now."""
    @property
    def steps_inserted_total(self) -> int:
        """Sequence tables only: steps ever inserted."""
    @property
    def steps_evicted_total(self) -> int:
        """Sequence tables only: steps evicted to make room."""
    @property
    def streams_open(self) -> int:
        """Sequence tables only: streams with an open episode."""
    @property
    def episodes_ended_total(self) -> int:
        """Sequence tables only: episodes ended (terminated, truncated or their stream gone)."""
    @property
    def windows_stored(self) -> int:
        """Sequence tables only: windows that can be sampled now (`store_size` there)."""
    @property
    def windows_inserted_total(self) -> int:
        """Sequence tables only: windows made."""
    @property
    def windows_evicted_total(self) -> int:
        """Sequence tables only: windows removed because a step of theirs was evicted."""
    @property
    def last_checkpoint_unix_s(self) -> float:
        """When the last checkpoint (manual or periodic) completed, Unix seconds; 0 before."""
    @property
    def last_checkpoint_duration_s(self) -> float:
        """How long the last completed checkpoint took, seconds; 0 before one completes."""
    @property
    def last_checkpoint_bytes(self) -> int:
        """Bytes of the last completed checkpoint's files; 0 before one completes."""
    @property
    def stored_bytes(self) -> int:
        """Bytes the data held now takes as stored: a replay table's items with their
        `compress=` leaves compressed; otherwise the raw bytes of what is held."""
    @property
    def raw_bytes(self) -> int:
        """Bytes the same data takes raw."""
    @property
    def compression_ratio(self) -> float:
        """`raw_bytes / stored_bytes` (1.0 when nothing is held)."""
    @property
    def wait_ns(self) -> int:
        """Nanoseconds the consumer waited inside `sample()` for this batch."""
    @property
    def sequence(self) -> int:
        """0-based number of this batch since the server started."""
    @property
    def keys(self) -> npt.NDArray[np.uint64] | None:
        """Replay batches only (`None` for FIFO and `stats()`): `Sample.keys`."""
    @property
    def probabilities(self) -> npt.NDArray[np.float64] | None:
        """Replay batches only: `Sample.probabilities`."""
    @property
    def times_sampled(self) -> npt.NDArray[np.uint32] | None:
        """Replay batches only: `Sample.times_sampled`."""
    def as_dict(self) -> dict[str, Any]:
        """Every public property as a plain dict: the counters, the float fields and
        `compression_ratio` (histograms as nested dicts; no replay arrays)."""
    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class RingLease:
    """The numpy `base` of every batch view: keeps the ring memory alive."""

@final
class RaggedCopy:
    """The numpy base of a gathered or padded part of a ragged batch (echo internal)."""

@final
class RaggedCore:
    """The ragged table behind a `Server` whose example has `echo.Ragged` leaves (echo
    internal; see `echo.ragged`)."""

    def __new__(
        cls,
        leaves: list[tuple[str, tuple[int, ...], np.dtype[Any], tuple[int, str | None] | None]],
        sampler: str,
        exponent: float,
        batch_size: int,
        max_size: int,
        max_bytes: int | None,
        batch_tokens: tuple[str, int] | None,
        min_size: int,
        max_times_sampled: int,
        seed: int | None,
        compress: list[Any] = ...,
        policy_versions: bool = False,
        max_staleness: int | None = None,
        admission: str = "drop",
    ) -> RaggedCore: ...
    def set_reader(self, keys: list[str] | None, flatten: Callable[[Any], list[Any]]) -> None: ...
    def submit(
        self,
        sample: Any,
        *,
        timeout: float | None = None,
        priority: float | None = None,
        stream: int | None = None,
        end_episode: bool = False,
        truncated: bool = False,
        version: int | None = None,
    ) -> None: ...
    def submit_group(
        self,
        samples: list[list[Any]],
        timeout: float | None = None,
        priority: float | None = None,
        version: int | list[int] | None = None,
    ) -> int | None: ...
    def _publish(
        self,
        leaves: list[tuple[list[int], int, npt.NDArray[np.uint8]]],
        version: int | None = None,
        description: bytes | None = None,
        compress: Any = None,
    ) -> int: ...
    def publish_version(self, version: int | None = None, announce: bool = False) -> int: ...
    def note_persisted(self, sessions: list[tuple[bytes, int]]) -> None: ...
    @property
    def params_version(self) -> int: ...
    @property
    def policy_versions(self) -> bool: ...
    @property
    def max_staleness(self) -> int | None: ...
    def sample(
        self, timeout: float | None = None, padded: bool = False, multiple: int = 1
    ) -> (
        tuple[
            list[np.ndarray[Any, Any]],
            list[tuple[np.ndarray[Any, Any], ...]],
            npt.NDArray[np.uint64],
            npt.NDArray[np.float64] | None,
            npt.NDArray[np.uint32] | None,
            int,
            int,
            int,
        ]
        | None
    ): ...
    def update_priorities(
        self, keys: npt.NDArray[np.uint64], priorities: npt.NDArray[np.float64]
    ) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def export(
        self,
    ) -> tuple[
        list[npt.NDArray[np.uint8]],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        npt.NDArray[np.float64],
        npt.NDArray[np.uint32],
        list[tuple[bytes, int]],
    ]: ...
    def set_times_sampled(self, key: int, times: int) -> bool: ...
    def start_tcp(
        self,
        host: str,
        port: int,
        token: bytes | None = None,
        max_connections: int = 1024,
        max_buffered_bytes: int = ...,
        shared_memory: bool = True,
        session_timeout: float = 300.0,
        sessions: list[tuple[bytes, int]] | None = None,
        heartbeat_timeout: float | None = ...,
    ) -> int: ...
    @property
    def port(self) -> int | None: ...
    def close(self, drain: bool = False, restarting: bool = False) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def groups(self) -> list[str]: ...
    @property
    def leaf_groups(self) -> list[int | None]: ...
    @property
    def arena_capacity(self) -> int: ...

@final
class RaggedSender:
    """A worker's connection to a ragged server (echo internal; see `echo.TcpClient`)."""

    def __new__(
        cls,
        host: str,
        port: int,
        leaves: list[tuple[str, tuple[int, ...], np.dtype[Any], tuple[int, str | None] | None]],
        token: bytes | None = None,
        connect_timeout: float = 10.0,
        max_inflight: int = 256,
        shared_memory: bool | None = None,
        reconnect_timeout: float | None = None,
        resolver: Callable[[tuple[str, int, str] | None], tuple[str, int] | None] | None = None,
        dial_timeout: float | None = None,
        durable_bytes: int | None = None,
        wire_compression: bool = True,
        heartbeat_timeout: float | None = None,
    ) -> RaggedSender: ...
    def set_reader(self, keys: list[str] | None, flatten: Callable[[Any], list[Any]]) -> None: ...
    def send(
        self,
        sample: Any,
        priority: float | None = None,
        timeout: float | None = None,
        version: int | None = None,
    ) -> None: ...
    def send_group(
        self,
        samples: list[list[Any]],
        priority: float | None = None,
        timeout: float | None = None,
        version: int | None = None,
    ) -> None: ...
    @property
    def wire_codecs(self) -> list[Codec | None] | None: ...
    def wait_persisted(self, timeout: float | None = None) -> None: ...
    @property
    def persisted(self) -> int: ...
    @property
    def durable_waits(self) -> tuple[int, float]: ...
    def fetch_params(
        self, size: int, min_version: int = 0, timeout: float | None = None
    ) -> tuple[int, npt.NDArray[np.uint8]]: ...
    def fetch_params_description(self, timeout: float | None = None) -> bytes: ...
    @property
    def params_fetches(self) -> tuple[int, float]: ...
    @property
    def params_version(self) -> int: ...
    @property
    def admission_waits(self) -> tuple[int, float]: ...
    @property
    def keeps_versions(self) -> bool: ...
    @property
    def policy_version(self) -> int: ...
    @policy_version.setter
    def policy_version(self, version: int) -> None: ...
    def flush(self, timeout: float | None = None) -> None: ...
    def close(self) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def recoveries(self) -> tuple[int, int]: ...
    @property
    def counts(self) -> tuple[int, int]: ...
    @property
    def server_closing(self) -> Literal["final", "restarting"] | None: ...
    @property
    def resumed_from(self) -> int | None: ...
    @property
    def retained_bytes(self) -> int: ...

@final
class BatchCopy:
    """The numpy `base` of a `copy=True` batch's leaf: owns its memory, which goes back to
    the server's pool for the next copy once no array uses it."""

@final
class ServerCore:
    """The native half of `echo.Server`, over the FIFO ring or a replay table: flattened
    leaves in, batches of views out."""

    def __new__(cls, layout: TreeLayout, config: ServerConfig) -> ServerCore: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def num_buffers(self) -> int | None:
        """Batches the FIFO ring holds; `None` for a replay table."""
    @property
    def max_size(self) -> int | None:
        """Items a replay table holds (steps, for a sequence table); `None` for FIFO."""
    @property
    def capacity(self) -> int:
        """The most samples the server holds at once."""
    @property
    def meta_names(self) -> list[str]:
        """Names of the per-item arrays `sample` returns after the leaves."""
    @property
    def sequence_length(self) -> int | None:
        """Steps per window of a sequence table; `None` otherwise."""
    def end_stream(self, stream: int, terminated: bool) -> bool:
        """Ends an in-process stream's open episode; returns whether it had one."""
    @property
    def producer_queue_size(self) -> int:
        """Capacity of each connection's ingress queue (given or chosen)."""
    @property
    def payload_size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def pinned(self) -> bool: ...
    def pin_host_memory(self, cuda_runtimes: list[str]) -> None:
        """Page-locks the batch memory with cudaHostRegister (RuntimeError without CUDA)."""
    def start(self, transport: TcpTransport) -> int:
        """Starts the drainers and the TCP server; returns the bound port."""
    def submit(
        self,
        sample: object,
        *,
        timeout: float | None = None,
        priority: float | None = None,
        stream: int | None = None,
        end_episode: bool | None = None,
        truncated: bool | None = None,
        version: int | None = None,
    ) -> None:
        """Checks and copies one sample (a pytree like the example); a sequence table's step
        of `stream`, ending its episode with `end_episode` (terminated) or `truncated`."""
    def submit_batch(
        self,
        tree: object,
        timeout: float | None = None,
        priority: object = None,
        stream: int | None = None,
        end_episode: object = None,
        truncated: object = None,
        version: int | None = None,
    ) -> int:
        """Checks and copies a batch of samples, one per row; returns the row count. A
        sequence table takes row `i` as a step of stream `stream + i`, ending as
        `end_episode` and `truncated` say (each a bool for all rows, or one per row)."""
    def sample(
        self, timeout: float | None = None, copy: bool = False, writable: bool = False
    ) -> tuple[list[npt.NDArray[Any]], SampleInfo, tuple[npt.NDArray[Any], ...]] | None:
        """`(leaves, info, meta)`; `meta` holds the arrays `meta_names` names (`()` for
        FIFO). `writable`: the leaves' views are writeable."""
    def update_priorities(
        self, keys: npt.NDArray[np.uint64], priorities: npt.NDArray[np.float64]
    ) -> int:
        """Sets priorities by key; returns how many keys were unknown."""
    def priority(self, key: int) -> float | None:
        """The priority of the item with `key`, `None` if it is not in the table."""
    def stats(self) -> SampleInfo: ...
    def reset_histograms(self) -> None: ...
    def close(self, drain: bool = False, restarting: bool = False) -> None: ...
    @property
    def dropped_at_close(self) -> int | None:
        """Samples that never reached the learner, counted at the final close."""
    def _waiting(self) -> tuple[int, int]:
        """`(inserts, samples)` parked in the backend right now (for tests)."""
    def _checkpoint(
        self,
        path: str,
        extra: tuple[bytes, list[tuple[str, tuple[int, ...], npt.NDArray[np.uint8]]]] | None = None,
        hook: Callable[[str], object] | None = None,
    ) -> int:
        """Writes a checkpoint of this server to `path` (every file, the manifest included,
        written by the core with the GIL released, then swapped in atomically), with the
        encoded `extra` (`extra.json`'s bytes and each array as `(descr literal, shape,
        bytes)`); `hook(stage)` runs at each stage. Returns the bytes its files hold."""
    def _publish(
        self,
        leaves: list[tuple[list[int], int, npt.NDArray[np.uint8]]],
        version: int | None = None,
        description: bytes | None = None,
        compress: Codec | None = None,
    ) -> int:
        """Publishes the parameters' leaves as `(shape, itemsize, bytes)`, compressed with
        `compress` for TCP workers; their version."""
    @property
    def params_version(self) -> int:
        """The latest version of the published parameters (0: none)."""
    def writer(self, timeout: float | None = None) -> SampleWriter:
        """A `SampleWriter` into this server (FIFO or replay)."""
    @property
    def leaf_names(self) -> list[str]:
        """The example's leaves' names in flattened order."""
    def push_leaves(self, leaves: tuple[Any, ...], timeout: float | None) -> None:
        """Copies one sample given as its leaves, positionally."""
    def _restore(self, opened: OpenedCheckpoint) -> None:
        """Fills this new server with the opened checkpoint's data (CheckpointError naming
        what does not fit; nothing is inserted then)."""
    @property
    def _is_restoring(self) -> bool:
        """Whether a restore's samples are still going in (other inserts wait for them)."""
    def describe(self) -> str:
        """`num_buffers=3` or `max_size=100, sampler=Uniform()`."""

@final
class SampleWriter:
    """`Server.writer()`: inserts single samples given as their leaves, positionally."""

    def __call__(self, *leaves: Any) -> None:
        """Copies one sample whose leaves are `leaves`, in the example's flattened order."""
    @property
    def leaves(self) -> list[str]:
        """The leaves' names, in the order a call takes them."""
    @property
    def timeout(self) -> float | None:
        """Seconds each call waits for room (None: as long as it takes)."""

@final
class OpenedCheckpoint:
    """A checkpoint whose manifest and files are checked (`open_checkpoint`)."""

    @property
    def kind(self) -> Literal["replay", "fifo", "sequence"]: ...
    @property
    def kind_description(self) -> str:
        """`a replay table`, `a FIFO ring` or `a sequence table`."""
    @property
    def root(self) -> str:
        """The checkpoint's directory, its link resolved."""
    @property
    def extra(self) -> str | None:
        """The extra's tree file, None without one."""
    def lists(self, name: str) -> bool:
        """Whether the manifest lists `name`."""
    @property
    def policy_versions(self) -> bool:
        """Whether the checkpoint's server kept each sample's policy version."""
    def dict_leaves(self) -> list[tuple[list[str], tuple[int, ...], Any]]:
        """Each leaf's `(keys, shape, dtype descr)` for an example of nested dicts."""
    def check_example(self, layout: TreeLayout) -> None:
        """CheckpointError if `layout` differs from the checkpoint's."""
    def server_kwargs(self) -> dict[str, Any]:
        """The settings that are part of the data, as `Server` keyword arguments."""
    def tuning(self) -> dict[str, Any]:
        """The settings that only tune, as recorded."""

def open_checkpoint(path: str, extra_only: bool = False) -> OpenedCheckpoint:
    """Opens and checks the checkpoint at `path` (every file, or only the extra's)."""

def clean_checkpoint_leftovers(parent: str, name: str, keep: str | None = None) -> None:
    """Removes what replaced or killed checkpoints of `name` left in `parent`."""

@final
class TcpSender:
    """The native half of `echo.TcpClient`: flattened leaves out, acks in."""

    def __new__(
        cls,
        host: str,
        port: int,
        layout: TreeLayout,
        settings: _ClientSettings,
        resolver: Callable[[tuple[str, int, str] | None], tuple[str, int] | None] | None = None,
    ) -> TcpSender: ...
    def send(
        self,
        sample: object,
        timeout: float | None = None,
        priority: float | None = None,
        end_episode: bool = False,
        truncated: bool = False,
        version: int | None = None,
    ) -> None:
        """Checks and sends one sample (a pytree like the example); `end_episode` or
        `truncated` ends its episode (a sequence table); `version` is the policy version it
        carries to a server that keeps them (`None`: `policy_version`)."""
    @property
    def policy_version(self) -> int:
        """The version samples carry when a send names none (the newest fetched)."""
    @policy_version.setter
    def policy_version(self, version: int) -> None: ...
    @property
    def policy_versions(self) -> int | None:
        """The admission bound when the server keeps versions (2**64-1: none), else `None`."""
    @property
    def params_fetches(self) -> tuple[int, float]:
        """Whole versions fetched, and the seconds the fetches took in all."""
    @property
    def admission_waits(self) -> tuple[int, float]:
        """Sends that waited for newer parameters, and the seconds in all."""
    def send_batch(
        self,
        tree: object,
        timeout: float | None = None,
        priority: object = None,
        end_episode: object = None,
        truncated: object = None,
        version: int | None = None,
    ) -> int:
        """Checks and sends a batch of samples, one per row; returns the row count. To a
        sequence table row `i` is a step of this client's stream `i`, ending as
        `end_episode` and `truncated` say (each a bool for all rows, or one per row)."""
    @property
    def takes_steps(self) -> int | None:
        """`max_rows` when the server is a sequence table; `None` otherwise."""
    def wait(self, timeout: float | None = None) -> None: ...
    def wait_persisted(self, timeout: float | None = None) -> None:
        """Durable acknowledgements: waits until every sent sample is persisted."""
    def fetch_params_description(self, timeout: float | None = None) -> bytes:
        """The learner's description of its parameters (empty: none)."""
    def fetch_params(
        self, size: int, min_version: int = 0, timeout: float | None = None
    ) -> tuple[int, npt.NDArray[np.uint8]]:
        """A whole version of the learner's parameters (`size` bytes), at least
        `min_version`: its version and its bytes."""
    @property
    def params_version(self) -> int:
        """The latest parameter version the server announced (0: none)."""
    def close(self, timeout: float | None = None) -> bool: ...
    @property
    def persisted(self) -> int:
        """Every sample before this one is in a checkpoint the server completed."""
    @property
    def retained_bytes(self) -> int: ...
    @property
    def durable_waits(self) -> tuple[int, float]:
        """Sends that waited for the durable byte budget, and the seconds in all."""
    @property
    def server_closing(self) -> Literal["final", "restarting"] | None: ...
    @property
    def sent(self) -> int: ...
    @property
    def acked(self) -> int: ...
    @property
    def protocol(self) -> int: ...
    @property
    def reconnects(self) -> int: ...
    @property
    def resent(self) -> int: ...
    @property
    def resumed_from(self) -> int | None:
        """The sample the latest reconnection resumed at; `None` before any."""
    @property
    def transport_path(self) -> Literal["shm", "tcp"]: ...
    @property
    def wire_codecs(self) -> list[Codec | None] | None:
        """Per leaf, the codec this connection sends it with (`None` raw); `None` when
        every leaf goes raw."""
    @property
    def payload_size(self) -> int: ...

def _interpreter_exiting() -> None: ...
def reset_log_cache() -> None:
    """Forgets the cached Python logger levels (call after changing `logging` levels)."""

def _sample_info(state: dict[str, Any]) -> SampleInfo:
    """Rebuilds a `SampleInfo` from its pickled state (fields by name; unknown ones skipped)."""

def check_codec(codec: object) -> None:
    """Checks a codec's values (the zstd level's range) where the core defines them.

    Raises:
        TypeError: `codec` is not `echo.Zstd(...)` or `echo.Lz4()`.
        ValueError: The level is out of range.
    """

def check_strategy(strategy: object) -> None:
    """Checks a replay strategy's values (ValueError saying what is wrong)."""
