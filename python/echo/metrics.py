"""Prometheus metrics for echo servers: a collector and an HTTP endpoint.

`EchoCollector(*servers)` reads each server's counters (`Server.stats()`) when Prometheus
scrapes, never per sample, and hands them out as Prometheus metric families, one series per
server, labelled `server="<Server.name>"`. `serve_metrics(*servers)` serves them over HTTP
in the Prometheus text format. Both need `prometheus_client`: `pip install 'id-echo[metrics]'`.

Names follow Prometheus' conventions: the `echo_` prefix, base units (`_seconds`, `_bytes`),
counters end in `_total`, and the only labels besides `server` have a handful of fixed
values (a drop's or a refusal's reason, a wire protocol). `METRICS` lists every metric with
the `stats()` field it mirrors; the metrics guide (docs/guides/prometheus.md) has the table.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

try:
    from prometheus_client import CollectorRegistry, make_wsgi_app  # pyright: ignore[reportUnknownVariableType]
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        Metric,
        SummaryMetricFamily,
    )
except ImportError as e:  # pragma: no cover - exercised by test_prometheus with a blocked import
    raise ImportError(
        "echo.metrics needs prometheus_client, which echo installs with the `metrics` extra: "
        "pip install 'id-echo[metrics]'"
    ) from e

from echo._echo import DETAILED_METRICS, HistSnapshot, SampleInfo, __version__
from echo._metrics_http import MetricsHTTPServer
from echo._validate import check_int, check_seconds
from echo.replay import Fifo

if TYPE_CHECKING:
    from echo._tally import Tally
    from echo.server import Server

__all__ = [
    "METRICS",
    "EchoCollector",
    "MetricSpec",
    "MetricsEndpoint",
    "exposed_names",
    "serve_metrics",
]

Kind = Literal["counter", "gauge", "summary"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric `EchoCollector` exports.

    Attributes:
        name: The exposed name (counters with `_total`; a summary's series add
            `{quantile=...}`, `_count` and `_sum`).
        kind: `"counter"`, `"gauge"` or `"summary"`.
        unit: `"seconds"`, `"bytes"` or `""` (a count).
        help: What it counts (the `# HELP` line).
        source: The `stats()` field (or `Server` attribute) it mirrors.
        label: The one label besides `server`, if any.
        detailed: Only exported by a build with the cargo feature `detailed-metrics`
            (`echo.DETAILED_METRICS`), where the field is recorded at all.
    """

    name: str
    kind: Kind
    unit: str
    help: str
    source: str
    label: str | None = None
    detailed: bool = False


def _spec(
    name: str,
    kind: Kind,
    help: str,
    source: str,
    *,
    label: str | None = None,
    detailed: bool = False,
) -> MetricSpec:
    stem = name.removesuffix("_total")
    unit = next((u for u in ("seconds", "bytes") if stem.endswith("_" + u)), "")
    return MetricSpec(name, kind, unit, help, source, label, detailed)


# Every metric, in exposition order. The docs' reference table is checked against this list
# (python/tests/test_prometheus.py), and so is the Grafana dashboard.
METRICS: tuple[MetricSpec, ...] = (
    _spec(
        "echo_server_info",
        "gauge",
        "Always 1; the labels say the sampler, the echo version and whether the build records "
        "the detailed metrics.",
        "Server.sampler, echo.__version__, echo.DETAILED_METRICS",
        label="sampler, version, detailed_metrics",
    ),
    _spec(
        "echo_server_start_time_seconds",
        "gauge",
        "When the server started counting, Unix time: its creation, or the end of the "
        "Server.restore that made it. Every counter starts at 0 then, as a restarted "
        "process's do, so a change of this value marks a counter reset.",
        "Server() or Server.restore() returning",
    ),
    # Samples in and out.
    _spec(
        "echo_samples_inserted_total",
        "counter",
        'Samples put into the ring or table, by path: path="ingress" the transport (TCP '
        "and same-host shared memory, counted before the commit that makes each visible), "
        'path="submit" in-process submit()/submit_batch() (counted as each returns).',
        "samples_inserted_total (ingress), samples_submitted_total (submit)",
        label="path",
    ),
    _spec(
        "echo_samples_sampled_total",
        "counter",
        "Samples handed to the learner: batches times batch_size (FIFO), items drawn (replay).",
        "FIFO: (sample.info.sequence + 1) * batch_size; replay: items_sampled_total",
    ),
    _spec(
        "echo_batches_completed_total",
        "counter",
        "Batches completed by writers (FIFO: each wakes the learner once).",
        "notify_count",
    ),
    _spec(
        "echo_samples_dropped_total",
        "counter",
        "Samples removed without reaching the learner (again): evicted from a full replay "
        "table, removed after max_times_sampled draws, dropped by a plain close(), or older "
        "than max_staleness versions (at insert, or when a replay draw met them).",
        "evicted_total, removed_max_times_sampled_total, Server.dropped_at_close, "
        "samples_stale_at_insert_total, samples_stale_at_sample_total",
        label="reason",
    ),
    _spec(
        "echo_samples_versioned_total",
        "counter",
        "Samples handed to the learner with a policy version (a server with "
        "policy_versions=True or max_staleness; a sequence table's windows are not counted).",
        "samples_versioned_total",
    ),
    _spec(
        "echo_sample_version_lag_total",
        "counter",
        "The sum of those samples' lags behind the latest published version as they were "
        "handed out: over echo_samples_versioned_total, the mean lag.",
        "version_lag_total",
    ),
    _spec(
        "echo_sample_version_lag_max",
        "gauge",
        "The largest lag behind the latest published version of a sample handed out.",
        "version_lag_max",
    ),
    _spec(
        "echo_params_version",
        "gauge",
        "The latest version of the published parameters (0: none).",
        "params_version",
    ),
    _spec(
        "echo_params_published_total",
        "counter",
        "Server.publish() calls.",
        "params_published_total",
    ),
    _spec(
        "echo_params_served_chunks_total",
        "counter",
        "Chunks of parameters served to workers (one per fetch request).",
        "params_chunks_served_total",
    ),
    _spec(
        "echo_params_served_bytes_total",
        "counter",
        "Bytes of parameters served to workers.",
        "params_bytes_served_total",
    ),
    _spec(
        "echo_samples_deduplicated_total",
        "counter",
        "Samples reconnecting clients did not resend because the server had them already.",
        "samples_deduplicated_total",
    ),
    _spec(
        "echo_samples_received_in_place_total",
        "counter",
        "Of echo_samples_inserted_total, large samples read from the socket straight into "
        "the ring.",
        "samples_received_in_place_total",
    ),
    # The store.
    _spec(
        "echo_store_size",
        "gauge",
        "Samples (replay: items; sequence tables: windows) the learner can still be handed.",
        "store_size",
    ),
    _spec(
        "echo_store_capacity",
        "gauge",
        "What the store holds at most: batch_size * num_buffers (FIFO), max_size (replay; "
        "steps for a sequence table).",
        "Server.batch_size * Server.num_buffers, Server.max_size",
    ),
    _spec(
        "echo_stored_bytes",
        "gauge",
        "Bytes the data held takes as stored (a replay or sequence table's compress= leaves "
        "compressed).",
        "stored_bytes",
    ),
    _spec("echo_raw_bytes", "gauge", "Bytes the same data takes raw.", "raw_bytes"),
    _spec("echo_sequence_steps_stored", "gauge", "Sequence tables: steps stored.", "steps_stored"),
    _spec(
        "echo_sequence_steps_inserted_total",
        "counter",
        "Sequence tables: steps inserted (in-process and over the transport).",
        "steps_inserted_total",
    ),
    _spec(
        "echo_sequence_steps_evicted_total",
        "counter",
        "Sequence tables: steps evicted to make room.",
        "steps_evicted_total",
    ),
    _spec(
        "echo_sequence_streams_open",
        "gauge",
        "Sequence tables: streams with an open episode.",
        "streams_open",
    ),
    _spec(
        "echo_sequence_episodes_ended_total",
        "counter",
        "Sequence tables: episodes ended.",
        "episodes_ended_total",
    ),
    _spec(
        "echo_sequence_windows_stored",
        "gauge",
        "Sequence tables: windows that can be sampled now.",
        "windows_stored",
    ),
    _spec(
        "echo_sequence_windows_inserted_total",
        "counter",
        "Sequence tables: windows made.",
        "windows_inserted_total",
    ),
    _spec(
        "echo_sequence_windows_evicted_total",
        "counter",
        "Sequence tables: windows removed because a step of theirs was evicted.",
        "windows_evicted_total",
    ),
    # Connections.
    _spec(
        "echo_connections_active",
        "gauge",
        "Open transport connections (TCP and same-host shared memory).",
        "active_connections",
    ),
    _spec(
        "echo_connections_opened_total",
        "counter",
        "Connections that completed their handshake, by wire protocol.",
        "v1_connections_total, v2_connections_total",
        label="protocol",
    ),
    _spec(
        "echo_connections_refused_total",
        "counter",
        "Connections refused: every max_connections slot busy, a malformed handshake (or v1 at "
        "a server with a token), a missing or wrong token, another sample layout.",
        "connections_refused_total, handshakes_refused_{protocol,auth,layout}_total",
        label="reason",
    ),
    _spec(
        "echo_connections_evicted_total",
        "counter",
        "Idle connections closed to admit new ones.",
        "connections_evicted_total",
    ),
    _spec(
        "echo_sessions_resumed_total",
        "counter",
        "Reconnecting v2 clients that resumed their session.",
        "sessions_resumed_total",
    ),
    _spec(
        "echo_shm_connections_total",
        "counter",
        "Connections whose samples came through same-host shared memory.",
        "shm_connections_total",
    ),
    _spec(
        "echo_shm_fallbacks_total",
        "counter",
        "Connections that asked for shared memory and send over TCP instead.",
        "shm_fallbacks_total",
    ),
    _spec(
        "echo_samples_received_compressed_total",
        "counter",
        "Samples that arrived compressed over TCP (the workers compressed the compress= leaves).",
        "samples_received_compressed_total",
    ),
    _spec(
        "echo_received_compressed_bytes_total",
        "counter",
        "Bytes those compressed samples took on the wire.",
        "compressed_bytes_received_total",
    ),
    # Ingress.
    _spec(
        "echo_ingress_buffered_bytes",
        "gauge",
        "Bytes of sample buffers the TCP ingress holds (queues, pools, shared-memory segments).",
        "buffered_bytes",
    ),
    _spec(
        "echo_ingress_buffered_max_bytes",
        "gauge",
        "The bound on echo_ingress_buffered_bytes (0 without a transport).",
        "TcpTransport.max_buffered_bytes",
    ),
    _spec(
        "echo_ingress_samples_pending",
        "gauge",
        "Samples that reached the learner and are not yet in the ring or table: "
        "acknowledged TCP samples, and samples committed to a shared-memory segment.",
        "samples_pending",
    ),
    _spec(
        "echo_ingress_queue_depth",
        "gauge",
        "Samples waiting in the connection queues (a shared-memory connection's queue is its "
        "segment), as the drainers and shared-memory connections last saw them.",
        "queue_depth_sum",
    ),
    _spec(
        "echo_ingress_queue_depth_max",
        "gauge",
        "Samples waiting in the fullest connection queue or segment, as last seen.",
        "queue_depth_max",
    ),
    _spec(
        "echo_ingress_queue_capacity",
        "gauge",
        "Samples each connection queue holds (producer_queue_size).",
        "Server.producer_queue_size",
    ),
    # Who waits for whom.
    _spec(
        "echo_learner_wait_seconds_total",
        "counter",
        "Time sample() calls spent waiting for a batch: completed waits, waits that timed out "
        "and the wait in progress.",
        "sum of sample.info.wait_ns",
    ),
    _spec(
        "echo_ingress_push_blocked_total",
        "counter",
        "Times a connection's task waited for room (its queue full, its buffers in use, or "
        "a full ring for shared memory): backpressure on the workers.",
        "push_blocked_count",
    ),
    _spec(
        "echo_ingress_push_blocked_seconds_total",
        "counter",
        "Time connections' tasks spent in those waits, summed over connections: how long the "
        "workers were held back (backpressure).",
        "push_blocked_ns_total",
    ),
    _spec(
        "echo_ring_blocked_seconds_total",
        "counter",
        "FIFO: time writers (drainers, shared-memory connections, submit()) spent waiting for "
        "free ring slots, summed over writers: the learner not keeping up.",
        "ring_blocked_ns_total",
    ),
    _spec(
        "echo_rate_limiter_insert_blocked_seconds_total",
        "counter",
        "Replay: time inserts spent held back by the rate limiter (submit(), drainers, and "
        "shared-memory connections).",
        "insert_blocked_ns_total",
    ),
    _spec(
        "echo_rate_limiter_sample_blocked_seconds_total",
        "counter",
        "Replay: time sample() spent held back by the rate limiter or an empty table.",
        "sample_blocked_ns_total",
    ),
    # Priorities.
    _spec(
        "echo_priority_updates_total",
        "counter",
        "Replay: priorities update_priorities() set (applied) or skipped as unknown keys "
        "(ignored).",
        "priority_updates_total, unknown_keys_total",
        label="result",
    ),
    # Checkpoints.
    _spec(
        "echo_checkpoints_total",
        "counter",
        "Checkpoints completed (checkpoint() calls and periodic ones).",
        "Server.checkpoint() returning",
    ),
    _spec(
        "echo_checkpoint_failures_total",
        "counter",
        "Checkpoints that failed (checkpoint() raised; periodic ones log it and retry).",
        "Server.checkpoint() raising",
    ),
    _spec(
        "echo_checkpoint_last_duration_seconds",
        "gauge",
        "How long the last completed checkpoint took (0 before one completes).",
        "last_checkpoint_duration_s",
    ),
    _spec(
        "echo_checkpoint_last_size_bytes",
        "gauge",
        "Bytes of the last completed checkpoint's files (0 before one completes).",
        "last_checkpoint_bytes",
    ),
    _spec(
        "echo_checkpoint_last_success_timestamp_seconds",
        "gauge",
        "When the last checkpoint completed, Unix time (0 before one completes).",
        "last_checkpoint_unix_s",
    ),
    _spec(
        "echo_checkpoint_age_seconds",
        "gauge",
        "Seconds since the server's last checkpoint completed; +Inf until its first one "
        "completes (also after a restore): what an alert on missing checkpoints compares.",
        "now - last_checkpoint_unix_s",
    ),
    # Detailed build only (the docs' second table, the dashboard's "detailed build only" panels).
    _spec(
        "echo_ring_full_waits_total",
        "counter",
        "Times a writer found the ring full and waited for the learner.",
        "reservation_retries_total",
        detailed=True,
    ),
    _spec(
        "echo_reservations_total",
        "counter",
        "Ring slot reservations (one successful compare-and-swap each).",
        "cas_success_total",
        detailed=True,
    ),
    _spec(
        "echo_reservation_cas_failures_total",
        "counter",
        "Failed compare-and-swaps on the write cursor: contention between writers.",
        "cas_failure_total",
        detailed=True,
    ),
    _spec(
        "echo_drain_round_seconds",
        "summary",
        "A drainer round that popped something, waiting for ring space included.",
        "drain_round",
        detailed=True,
    ),
    _spec(
        "echo_memcpy_seconds",
        "summary",
        "Copying one reservation's samples into the ring.",
        "memcpy",
        detailed=True,
    ),
    _spec(
        "echo_queue_dwell_seconds",
        "summary",
        "A sample's time in its connection queue, from push to a drainer's pop.",
        "queue_dwell",
        detailed=True,
    ),
)

# The quantiles a summary exports from a HistSnapshot: min and max as 0 and 1.
_QUANTILES = (("0", "min_ns"), ("0.5", "p50_ns"), ("0.9", "p90_ns"), ("0.99", "p99_ns"))
_QUANTILES_MAX = ("1", "max_ns")

# One server's values: a number, or {label value: number} for a labelled metric, or a
# HistSnapshot for a summary.
_Value = float | dict[str, float] | HistSnapshot


def _exported() -> tuple[MetricSpec, ...]:
    return tuple(m for m in METRICS if DETAILED_METRICS or not m.detailed)


def _values(server: Server, info: SampleInfo, tally: Tally | None, now: float) -> dict[str, _Value]:
    """The value of every metric for one server, from one `stats()` snapshot; with
    `tally=None`, the counters as they were when the server started counting (`info` is
    then the restored server's `stats()` at that moment, and what the server's tally counts
    was 0)."""
    fifo = isinstance(server.sampler, Fifo) and server.sequence is None
    transport = server.transport
    dropped = None if tally is None else server.dropped_at_close
    batches = 0 if tally is None else tally.batches
    last_ckpt = info.last_checkpoint_unix_s
    ns = 1e-9
    return {
        "echo_server_info": 1.0,
        "echo_server_start_time_seconds": 0.0 if tally is None else tally.started_unix_s,
        "echo_samples_inserted_total": {
            "ingress": info.samples_inserted_total,
            "submit": info.samples_submitted_total,
        },
        # A ragged server counts the samples it hands out (its FIFO batches vary in size).
        "echo_samples_sampled_total": info.items_sampled_total
        or (batches * server.batch_size if fifo else 0),
        "echo_batches_completed_total": info.notify_count,
        "echo_samples_dropped_total": {
            "evicted": info.evicted_total,
            "max_times_sampled": info.removed_max_times_sampled_total,
            "closed": 0 if dropped is None else dropped,
            "stale_at_insert": info.samples_stale_at_insert_total,
            "stale_at_sample": info.samples_stale_at_sample_total,
        },
        "echo_samples_versioned_total": info.samples_versioned_total,
        "echo_sample_version_lag_total": info.version_lag_total,
        "echo_sample_version_lag_max": info.version_lag_max,
        "echo_params_version": info.params_version,
        "echo_params_published_total": info.params_published_total,
        "echo_params_served_chunks_total": info.params_chunks_served_total,
        "echo_params_served_bytes_total": info.params_bytes_served_total,
        "echo_samples_deduplicated_total": info.samples_deduplicated_total,
        "echo_samples_received_in_place_total": info.samples_received_in_place_total,
        "echo_store_size": info.store_size,
        "echo_store_capacity": server.capacity,
        "echo_stored_bytes": info.stored_bytes,
        "echo_raw_bytes": info.raw_bytes,
        "echo_sequence_steps_stored": info.steps_stored,
        "echo_sequence_steps_inserted_total": info.steps_inserted_total,
        "echo_sequence_steps_evicted_total": info.steps_evicted_total,
        "echo_sequence_streams_open": info.streams_open,
        "echo_sequence_episodes_ended_total": info.episodes_ended_total,
        "echo_sequence_windows_stored": info.windows_stored,
        "echo_sequence_windows_inserted_total": info.windows_inserted_total,
        "echo_sequence_windows_evicted_total": info.windows_evicted_total,
        "echo_connections_active": info.active_connections,
        "echo_connections_opened_total": {
            "1": info.v1_connections_total,
            "2": info.v2_connections_total,
        },
        "echo_connections_refused_total": {
            "max_connections": info.connections_refused_total,
            "protocol": info.handshakes_refused_protocol_total,
            "auth": info.handshakes_refused_auth_total,
            "layout": info.handshakes_refused_layout_total,
        },
        "echo_connections_evicted_total": info.connections_evicted_total,
        "echo_sessions_resumed_total": info.sessions_resumed_total,
        "echo_shm_connections_total": info.shm_connections_total,
        "echo_shm_fallbacks_total": info.shm_fallbacks_total,
        "echo_samples_received_compressed_total": info.samples_received_compressed_total,
        "echo_received_compressed_bytes_total": info.compressed_bytes_received_total,
        "echo_ingress_buffered_bytes": info.buffered_bytes,
        "echo_ingress_buffered_max_bytes": 0 if transport is None else transport.max_buffered_bytes,
        "echo_ingress_samples_pending": info.samples_pending,
        "echo_ingress_queue_depth": info.queue_depth_sum,
        "echo_ingress_queue_depth_max": info.queue_depth_max,
        "echo_ingress_queue_capacity": server.producer_queue_size,
        "echo_learner_wait_seconds_total": 0 if tally is None else tally.learner_wait_ns() * ns,
        "echo_ingress_push_blocked_total": info.push_blocked_count,
        "echo_ingress_push_blocked_seconds_total": info.push_blocked_ns_total * ns,
        "echo_ring_blocked_seconds_total": info.ring_blocked_ns_total * ns,
        "echo_rate_limiter_insert_blocked_seconds_total": info.insert_blocked_ns_total * ns,
        "echo_rate_limiter_sample_blocked_seconds_total": info.sample_blocked_ns_total * ns,
        "echo_ring_full_waits_total": info.reservation_retries_total,
        "echo_priority_updates_total": {
            "applied": info.priority_updates_total,
            "ignored": info.unknown_keys_total,
        },
        "echo_checkpoints_total": 0 if tally is None else tally.checkpoints,
        "echo_checkpoint_failures_total": 0 if tally is None else tally.checkpoint_failures,
        "echo_checkpoint_last_duration_seconds": info.last_checkpoint_duration_s,
        "echo_checkpoint_last_size_bytes": info.last_checkpoint_bytes,
        "echo_checkpoint_last_success_timestamp_seconds": last_ckpt,
        # +Inf before the first checkpoint: "no checkpoint for an hour" is true then, and an
        # alert on it must fire, also for a learner that restarts before it writes one.
        "echo_checkpoint_age_seconds": max(0.0, now - last_ckpt) if last_ckpt > 0 else math.inf,
        "echo_reservations_total": info.cas_success_total,
        "echo_reservation_cas_failures_total": info.cas_failure_total,
        "echo_drain_round_seconds": info.drain_round,
        "echo_memcpy_seconds": info.memcpy,
        "echo_queue_dwell_seconds": info.queue_dwell,
    }


def _since_start(values: dict[str, _Value], at_start: dict[str, _Value]) -> None:
    """Subtracts from each counter of `values` its value `at_start`: a restored server's
    counters count from 0 when its restore returned, as a restarted process's do."""
    for spec in METRICS:
        if spec.kind != "counter" or spec.name not in values:
            continue
        now, then = values[spec.name], at_start[spec.name]
        if isinstance(now, dict):
            assert isinstance(then, dict)
            values[spec.name] = {label: v - then.get(label, 0) for label, v in now.items()}
        else:
            assert not isinstance(now, HistSnapshot | dict)
            assert not isinstance(then, HistSnapshot | dict)
            values[spec.name] = now - then


def _family(spec: MetricSpec) -> Metric:
    labels = ["server"]
    if spec.label is not None:
        labels += [part.strip() for part in spec.label.split(",")]
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=labels, unit=spec.unit)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=labels, unit=spec.unit)
    return SummaryMetricFamily(spec.name, spec.help, labels=labels, unit=spec.unit)


def _add(family: Metric, spec: MetricSpec, server: Server, value: _Value) -> None:
    name = server.name
    if isinstance(value, HistSnapshot):
        assert isinstance(family, SummaryMetricFamily)
        ns = 1e-9
        for quantile, field in (*_QUANTILES, _QUANTILES_MAX):
            family.add_sample(
                spec.name, {"server": name, "quantile": quantile}, getattr(value, field) * ns
            )
        family.add_metric([name], value.count, value.mean_ns * value.count * ns)
    elif isinstance(value, dict):
        assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
        for label, v in value.items():
            family.add_metric([name, label], v)
    elif spec.name == "echo_server_info":
        assert isinstance(family, GaugeMetricFamily)
        sampler = "sequence" if server.sequence is not None else type(server.sampler).__name__
        detailed = "true" if DETAILED_METRICS else "false"
        family.add_metric([name, sampler.lower(), __version__, detailed], value)
    else:
        assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
        family.add_metric([name], value)


class EchoCollector:
    """A Prometheus collector over one or more echo servers.

    Each scrape calls every server's `stats()` once (the default build reads its counters in
    well under a microsecond) and turns the snapshot into the metric families of
    `echo.metrics.METRICS`, one series per server labelled `server="<name>"`. Nothing runs
    between scrapes. Counters count from 0 when the server starts counting
    (`echo_server_start_time_seconds`): a server made by `Server.restore` exports what it
    did since the restore, as a restarted process does, while its `stats()` keeps the totals
    the checkpoint carried over. Register it in any `prometheus_client` registry:

        registry.register(EchoCollector(server))

    Args:
        *servers: The servers to export; their `name`s label the series and must differ.

    Raises:
        ValueError: Two servers have the same `name` (give each `Server(..., name=...)`).
        TypeError: An argument is not an `echo.Server`.
    """

    def __init__(self, *servers: Server) -> None:
        from echo.server import Server

        names: set[str] = set()
        for server in servers:
            if not isinstance(server, Server):  # pyright: ignore[reportUnnecessaryIsInstance]
                raise TypeError(f"expected echo.Server objects, got {type(server).__name__}")
            if server.name in names:
                raise ValueError(
                    f"two servers are named {server.name!r}: give each a distinct "
                    "Server(..., name=...), which labels its series"
                )
            names.add(server.name)
        self._servers: tuple[Server, ...] = servers
        # Per restored server (by index): its counters when its restore returned, which
        # each scrape subtracts. Computed at the first scrape.
        self._at_start: dict[int, dict[str, _Value]] = {}

    @property
    def servers(self) -> tuple[Server, ...]:
        """The servers this collector exports."""
        return self._servers

    def describe(self) -> Iterable[Metric]:
        """The metric families without samples (what a registry checks for duplicates)."""
        return [_family(spec) for spec in _exported()]

    def collect(self) -> Iterator[Metric]:
        """One snapshot of every server, as metric families (called by each scrape)."""
        specs = _exported()
        families = [_family(spec) for spec in specs]
        now = time.time()
        for index, server in enumerate(self._servers):
            tally = server._tally  # pyright: ignore[reportPrivateUsage]
            values = _values(server, server.stats(), tally, now)
            if tally.started is not None:
                at_start = self._at_start.get(index)
                if at_start is None:
                    at_start = self._at_start[index] = _values(server, tally.started, None, now)
                _since_start(values, at_start)
            for spec, family in zip(specs, families, strict=True):
                _add(family, spec, server, values[spec.name])
        yield from families


class MetricsEndpoint:
    """A running HTTP endpoint serving `EchoCollector(*servers)` (see `serve_metrics`).

    Closing it stops the HTTP thread, closes the connections being served and frees the
    port; the servers are not touched. Also a context manager (closes on exit).
    """

    def __init__(
        self,
        collector: EchoCollector,
        host: str,
        port: int,
        *,
        max_connections: int = 8,
        timeout: float = 5.0,
    ) -> None:
        self._collector = collector
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(collector)
        httpd = MetricsHTTPServer(
            host,
            port,
            make_wsgi_app(self._registry),  # pyright: ignore[reportUnknownArgumentType]
            max_connections=max_connections,
            timeout_s=timeout,
        )
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="echo-metrics-http", daemon=True
        )
        self._thread.start()
        self._host = host
        self._port = int(httpd.server_address[1])
        self._max_connections = max_connections
        self._timeout = timeout
        self._closed = False

    @property
    def collector(self) -> EchoCollector:
        """The collector this endpoint serves."""
        return self._collector

    @property
    def registry(self) -> CollectorRegistry:
        """The endpoint's own registry, holding only `collector`."""
        return self._registry

    @property
    def host(self) -> str:
        """The address the endpoint is bound to."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the one chosen by the OS when `port=0` was asked for)."""
        return self._port

    @property
    def url(self) -> str:
        """`http://host:port/metrics` (an IPv6 host in brackets)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}/metrics"

    @property
    def max_connections(self) -> int:
        """The most connections served at once (each by one thread)."""
        return self._max_connections

    @property
    def timeout(self) -> float:
        """Seconds each read or write of a connection may wait."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Stops serving, closes the connections being served and frees the port; waits up
        to `timeout` seconds for the HTTP threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._httpd.close_connections(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(repr(s.name) for s in self._collector.servers)
        return f"MetricsEndpoint({self.url}, servers=[{names}], closed={self._closed})"


def serve_metrics(
    *servers: Server,
    port: int = 9464,
    host: str = "127.0.0.1",
    max_connections: int = 8,
    timeout: float = 5.0,
) -> MetricsEndpoint:
    """Serves the servers' metrics over HTTP in the Prometheus text format, from a daemon
    thread, at `http://host:port/metrics` (any path answers).

    Each scrape reads every server's `stats()` once; nothing runs between scrapes. The
    endpoint has its own registry holding only echo's metrics; to add echo's metrics to an
    existing endpoint instead, register `EchoCollector(*servers)` in its registry.

    What a peer can hold is bounded: at most `max_connections` connections are served at
    once, each by one thread; each read or write of a connection waits at most `timeout`
    seconds; when every slot is taken, the oldest connection still sending its request is
    closed for the newcomer (which is closed at once if no such connection frees a slot
    within a second); the listen backlog is 128. See the threat model page.

    Args:
        *servers: The servers to export, told apart by `Server(..., name=...)`.
        port: The TCP port; 9464 by default, 0 for one the OS picks (see `.port`).
        host: The bind address: loopback by default, `"0.0.0.0"` for a Prometheus on
            another machine (the endpoint has no authentication).
        max_connections: The most connections served at once (>= 1), and so the most
            threads serving them.
        timeout: Seconds (> 0) each read of a request and each write of a response may
            wait before the connection is closed.

    Returns:
        The running endpoint: `.port`, `.url`, `.close()`; a context manager.

    Raises:
        ValueError: Two servers have the same name, or `port`, `max_connections` or
            `timeout` is out of range.
        TypeError: `max_connections` is not an int or `timeout` not a number.
        OSError: The port is taken or cannot be bound.
        ImportError: prometheus_client is not installed (the `metrics` extra).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    max_connections = check_int("max_connections", max_connections, 1, 1 << 16)
    seconds = check_seconds("timeout", timeout, optional=False)
    if seconds is None or math.isinf(seconds):
        raise ValueError(f"timeout must be a finite number of seconds, got {timeout!r}")
    return MetricsEndpoint(
        EchoCollector(*servers), host, port, max_connections=max_connections, timeout=seconds
    )


def exposed_names(specs: Iterable[MetricSpec] = METRICS) -> set[str]:
    """The metric names a scrape shows for `specs` (summaries: also `_count`, `_sum`)."""
    out: set[str] = set()
    for spec in specs:
        out.add(spec.name)
        if spec.kind == "summary":
            out |= {spec.name + "_count", spec.name + "_sum"}
    return out
