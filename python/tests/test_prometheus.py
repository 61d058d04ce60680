"""echo.metrics: a real HTTP endpoint on loopback, scraped with urllib and parsed with
prometheus_client's own text parser. Every documented metric is present, counts equal what
the test sent, waiting and blocked times grow while a call waits, names follow Prometheus'
conventions, and the docs' table and the Grafana dashboard name only metrics that exist."""

from __future__ import annotations

import json
import math
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, poll, take

# prometheus_client is in the dev extra, so these tests run (and can fail) wherever the suite
# runs; without it the import fails loudly instead of skipping.
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import echo
from echo._metrics_http import HANDLER_THREAD_NAME
from echo.metrics import METRICS, EchoCollector, MetricsEndpoint, exposed_names

ROOT = Path(__file__).resolve().parents[2]
EXPORTED = tuple(m for m in METRICS if echo.DETAILED_METRICS or not m.detailed)

# Scraped series: {(sample name, frozenset of label items): value}.
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, str], Series]:
    """`({family name: type}, series)` of an exposition, read by prometheus_client's parser."""
    types: dict[str, str] = {}
    series: Series = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in series, f"duplicate series {key}"
            series[key] = s.value
    return types, series


def scrape(endpoint: MetricsEndpoint) -> Series:
    with urllib.request.urlopen(endpoint.url, timeout=WAIT_S) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse(response.read().decode())[1]


def value(series: Series, name: str, server: str = "default", **labels: str) -> float:
    key = (name, frozenset({"server": server, **labels}.items()))
    assert key in series, f"{name}{labels} of server {server!r} missing"
    return series[key]


@pytest.fixture
def serve() -> Iterator[Callable[..., MetricsEndpoint]]:
    """`serve(*servers)`: `echo.serve_metrics` on 127.0.0.1, an ephemeral port; closed after."""
    endpoints: list[MetricsEndpoint] = []

    def start(*servers: echo.Server) -> MetricsEndpoint:
        endpoint = echo.serve_metrics(*servers, port=0, host="127.0.0.1")
        endpoints.append(endpoint)
        return endpoint

    yield start
    for endpoint in endpoints:
        endpoint.close()


def test_every_documented_metric_is_exposed(make_server: Any, serve: Any) -> None:
    server = make_server()
    endpoint = serve(server)
    with urllib.request.urlopen(endpoint.url, timeout=WAIT_S) as response:
        types, series = parse(response.read().decode())
    names = {name for name, _ in series}
    assert names == exposed_names(EXPORTED)
    for spec in EXPORTED:
        family = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        assert types[family] == spec.kind, spec.name
    # The detailed metrics appear exactly in a detailed build.
    detailed = {m.name for m in METRICS if m.detailed}
    assert bool(detailed & names) == echo.DETAILED_METRICS


def test_names_follow_prometheus_conventions(make_server: Any) -> None:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EchoCollector(make_server()))
    types, series = parse(generate_latest(registry).decode())
    # Labels with a few fixed values only (never per connection or per key).
    allowed_labels = {"server", "reason", "protocol", "result", "path", "quantile"}
    info_labels = {"server", "sampler", "version", "detailed_metrics"}
    for spec in METRICS:
        assert re.fullmatch(r"echo_[a-z][a-z0-9_]*[a-z0-9]", spec.name), spec.name
        stem = spec.name.removesuffix("_total")
        assert (spec.name != stem) == (spec.kind == "counter"), f"{spec.name}: _total iff counter"
        # Base units only, and the unit last (before _total).
        for bad in ("_ms", "_ns", "_us", "_milliseconds", "_microseconds", "_kb", "_mb"):
            assert bad + "_" not in spec.name + "_", spec.name
        for unit in ("seconds", "bytes"):
            if unit in stem:
                assert stem.endswith("_" + unit), f"{spec.name}: unit not last"
                assert spec.unit == unit
        assert spec.help
        assert spec.source
    for (name, labels), _ in series.items():
        keys = {k for k, _ in labels}
        if name == "echo_server_info":
            assert keys == info_labels
        else:
            assert keys <= allowed_labels, (name, keys)
            assert "server" in keys
    assert types  # parsed something


def test_counts_equal_what_was_sent_over_tcp(
    make_server: Any, serve: Any, make_sample: Any
) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = make_server(batch_size=4, num_buffers=8, transport=transport)
    server.start()
    endpoint = serve(server)
    sent, batches = 24, 3
    client = echo.TcpClient("127.0.0.1", server.port, make_sample(0), shared_memory=False)
    try:
        for i in range(sent):
            client.send(make_sample(i))
        client.wait(timeout=WAIT_S)
        poll(server.stats, lambda s: s.samples_inserted_total == sent, "samples inserted")
        for _ in range(batches):
            take(server)
        series = scrape(endpoint)
        assert value(series, "echo_samples_inserted_total", path="ingress") == sent
        assert value(series, "echo_samples_inserted_total", path="submit") == 0
        assert value(series, "echo_samples_sampled_total") == batches * 4
        assert value(series, "echo_batches_completed_total") == sent // 4
        assert value(series, "echo_store_size") == sent - batches * 4
        assert value(series, "echo_store_capacity") == 4 * 8
        assert value(series, "echo_connections_active") == 1
        opened = sum(value(series, "echo_connections_opened_total", protocol=p) for p in "12")
        assert opened == 1
        assert value(series, "echo_ingress_buffered_max_bytes") == transport.max_buffered_bytes
        assert value(series, "echo_ingress_queue_capacity") == server.producer_queue_size
        assert value(series, "echo_ingress_samples_pending") == 0
        for reason in ("max_connections", "protocol", "auth", "layout"):
            assert value(series, "echo_connections_refused_total", reason=reason) == 0
        assert value(series, "echo_shm_connections_total") == 0
    finally:
        client.close(timeout=WAIT_S)
    poll(lambda: value(scrape(endpoint), "echo_connections_active"), lambda v: v == 0, "close")


@pytest.mark.skipif(sys.platform != "linux", reason="same-host shared memory is Linux only")
def test_shared_memory_workers_are_counted(make_server: Any, serve: Any, make_sample: Any) -> None:
    server = make_server(transport=echo.TcpTransport(port=0, host="127.0.0.1"))
    server.start()
    endpoint = serve(server)
    client = echo.TcpClient("127.0.0.1", server.port, make_sample(0), shared_memory=True)
    try:
        client.send(make_sample(0))
        client.wait(timeout=WAIT_S)
        poll(
            lambda: value(scrape(endpoint), "echo_shm_connections_total"),
            lambda v: v == 1,
            "shared-memory connection counted",
        )
        assert value(scrape(endpoint), "echo_shm_fallbacks_total") == 0
    finally:
        client.close(timeout=WAIT_S)


def test_learner_wait_grows_while_the_learner_waits(
    make_server: Any, serve: Any, spawn: Any, make_sample: Any
) -> None:
    server = make_server(batch_size=2)
    endpoint = serve(server)
    assert value(scrape(endpoint), "echo_learner_wait_seconds_total") == 0
    learner = spawn(server.sample, timeout=WAIT_S)
    # Grows between two scrapes while the learner is still waiting (nothing can unblock it).
    first = poll(
        lambda: value(scrape(endpoint), "echo_learner_wait_seconds_total"),
        lambda v: v > 0,
        "learner wait above 0",
    )
    poll(
        lambda: value(scrape(endpoint), "echo_learner_wait_seconds_total"),
        lambda v: v > first,
        "learner wait growing",
    )
    assert learner.is_alive(), "the learner's sample() ended before anything was submitted"
    during = value(scrape(endpoint), "echo_learner_wait_seconds_total")
    server.submit(make_sample(0))
    server.submit(make_sample(1))
    assert learner.finish() is not None
    after = value(scrape(endpoint), "echo_learner_wait_seconds_total")
    assert after >= during  # a counter never goes back
    assert value(scrape(endpoint), "echo_samples_sampled_total") == 2


def test_a_timed_out_wait_counts(make_server: Any, serve: Any) -> None:
    server = make_server()
    endpoint = serve(server)
    with pytest.raises(TimeoutError):
        server.sample(timeout=0.05)
    assert value(scrape(endpoint), "echo_learner_wait_seconds_total") > 0
    assert value(scrape(endpoint), "echo_samples_sampled_total") == 0


def test_limiter_blocked_time_grows_while_it_holds_producers_back(
    make_server: Any, serve: Any, spawn: Any, make_sample: Any
) -> None:
    limiter = echo.SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=2)
    server = make_server(
        batch_size=1, sampler=echo.Uniform(), max_size=16, rate_limiter=limiter, seed=1
    )
    endpoint = serve(server)

    def produce() -> int:
        for i in range(16):
            server.submit(make_sample(i), timeout=WAIT_S)
        return 16

    producer = spawn(produce)
    first = poll(
        lambda: value(scrape(endpoint), "echo_rate_limiter_insert_blocked_seconds_total"),
        lambda v: v > 0,
        "insert blocked time above 0",
    )
    poll(
        lambda: value(scrape(endpoint), "echo_rate_limiter_insert_blocked_seconds_total"),
        lambda v: v > first,
        "insert blocked time growing",
    )
    assert producer.is_alive(), "the producer was never held back"
    # Sampling lets the producer go on; it finishes once enough was sampled (one item a batch,
    # so a sample the limiter allows never waits for an insert that will not come: the window
    # allows one sample more than the 16 inserts).
    sampled = 0
    for _ in range(17):
        if not producer.is_alive():
            break
        take(server)
        sampled += 1
    assert producer.finish() == 16
    series = scrape(endpoint)
    assert value(series, "echo_samples_sampled_total") == sampled
    assert value(series, "echo_rate_limiter_sample_blocked_seconds_total") >= 0


def test_ring_and_backpressure_blocked_times_count_the_waits_of_a_full_ring(
    make_server: Any, serve: Any, make_sample: Any
) -> None:
    # A FIFO ring of 2 one-sample batches, a queue of 1: a TCP worker's samples fill the ring,
    # the drainer waits for a free slot, the connection's queue fills, its task waits.
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = make_server(
        batch_size=1, num_buffers=2, producer_queue_size=1, num_drainers=1, transport=transport
    )
    server.start()
    endpoint = serve(server)
    client = echo.TcpClient(
        "127.0.0.1", server.port, make_sample(0), max_inflight_msgs=16, shared_memory=False
    )
    try:
        for i in range(8):
            client.send(make_sample(i), timeout=WAIT_S)
        # The ring holds 2, the queue 1: with both full and the connection held back, the
        # drainer holds the third sample and waits for a free slot (a held-back push alone
        # can happen before the drainer first wakes, with the ring still empty).
        poll(
            server.stats,
            lambda s: s.push_blocked_count > 0 and s.store_size == 2 and s.queue_depth_sum == 1,
            "the ring and the connection's queue full, the connection held back",
        )
        for _ in range(8):
            take(server)
        client.wait(timeout=WAIT_S)
    finally:
        client.close()
    series = scrape(endpoint)
    assert value(series, "echo_ring_blocked_seconds_total") > 0
    assert value(series, "echo_ingress_push_blocked_seconds_total") > 0
    assert value(series, "echo_rate_limiter_insert_blocked_seconds_total") == 0


def test_replay_priorities_and_drops(make_server: Any, serve: Any, make_sample: Any) -> None:
    server = make_server(
        batch_size=2, sampler=echo.Prioritized(1.0), max_size=4, max_times_sampled=0, seed=3
    )
    for i in range(6):  # 2 evicted
        server.submit(make_sample(i), priority=1.0)
    sample = take(server)
    server.update_priorities(sample.keys, np.full(2, 2.0))
    server.update_priorities(np.array([10_000, 10_001, 10_002], np.uint64), np.ones(3))
    endpoint = serve(server)
    series = scrape(endpoint)
    assert value(series, "echo_priority_updates_total", result="applied") == 2
    assert value(series, "echo_priority_updates_total", result="ignored") == 3
    assert value(series, "echo_samples_dropped_total", reason="evicted") == 2
    assert value(series, "echo_samples_sampled_total") == 2
    assert value(series, "echo_store_size") == 4
    assert value(series, "echo_store_capacity") == 4
    assert (
        value(
            series,
            "echo_server_info",
            sampler="prioritized",
            version=echo.__version__,
            detailed_metrics=str(echo.DETAILED_METRICS).lower(),
        )
        == 1
    )


def test_dropped_at_close(make_server: Any, serve: Any, make_sample: Any) -> None:
    server = make_server(batch_size=4)
    for i in range(3):
        server.submit(make_sample(i))
    endpoint = serve(server)
    assert value(scrape(endpoint), "echo_samples_dropped_total", reason="closed") == 0
    server.close()
    assert value(scrape(endpoint), "echo_samples_dropped_total", reason="closed") == 3


def test_checkpoints_are_counted(
    make_server: Any, serve: Any, make_sample: Any, tmp_path: Path
) -> None:
    server = make_server(batch_size=2)
    server.submit(make_sample(0))
    endpoint = serve(server)
    series = scrape(endpoint)
    assert value(series, "echo_checkpoints_total") == 0
    assert value(series, "echo_checkpoint_last_success_timestamp_seconds") == 0
    server.checkpoint(tmp_path / "ckpt")
    series_after_one = scrape(endpoint)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "file").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        server.checkpoint(occupied)
    series = scrape(endpoint)
    assert value(series, "echo_checkpoints_total") == 1
    assert value(series, "echo_checkpoint_failures_total") == 1
    stats = server.stats()
    assert value(series, "echo_checkpoint_last_size_bytes") == stats.last_checkpoint_bytes > 0
    assert (
        value(series, "echo_checkpoint_last_success_timestamp_seconds")
        == stats.last_checkpoint_unix_s
        > 0
    )
    assert value(series, "echo_checkpoint_last_duration_seconds") == pytest.approx(
        stats.last_checkpoint_duration_s
    )
    age = value(series_after_one, "echo_checkpoint_age_seconds")
    assert 0 <= age < WAIT_S
    assert value(series, "echo_checkpoint_age_seconds") >= age


def test_checkpoint_age_is_infinite_until_the_first_checkpoint_completes(
    make_server: Any, serve: Any, make_sample: Any, tmp_path: Path
) -> None:
    # "No checkpoint for an hour" holds from the start: an alert on the age fires for a
    # server that never wrote one, however recently it started (or was restored).
    server = make_server(batch_size=2)
    server.submit(make_sample(0))
    endpoint = serve(server)
    assert value(scrape(endpoint), "echo_checkpoint_age_seconds") == math.inf
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "file").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        server.checkpoint(occupied)
    assert value(scrape(endpoint), "echo_checkpoint_age_seconds") == math.inf  # a failure
    server.checkpoint(tmp_path / "ckpt")
    assert value(scrape(endpoint), "echo_checkpoint_age_seconds") < WAIT_S
    server.close()
    restored = echo.Server.restore(tmp_path / "ckpt", name="restored")
    try:
        assert value(scrape(serve(restored)), "echo_checkpoint_age_seconds", "restored") == (
            math.inf
        )
    finally:
        restored.close()


def _counter_series(series: Series, server: str) -> Series:
    counters = {m.name for m in EXPORTED if m.kind == "counter"}
    return {
        (name, labels): v
        for (name, labels), v in series.items()
        if name in counters and ("server", server) in labels
    }


RESTARTS = {
    "fifo": {"batch_size": 2},
    "replay": {"batch_size": 2, "sampler": echo.Uniform(), "max_size": 8, "seed": 1},
    # A sequence table's restore carries its step, window and batch counters over.
    "sequence": {
        "batch_size": 2,
        "sampler": echo.Uniform(),
        "max_size": 32,
        "sequence": echo.Sequence(length=2),
        "seed": 1,
    },
}


@pytest.mark.parametrize("kind", RESTARTS)
def test_a_restored_server_counts_from_zero_like_a_restarted_process(
    make_server: Any, serve: Any, tmp_path: Path, kind: str
) -> None:
    # Prometheus' increase() and rate() handle a counter reset; a counter that restarts at
    # the checkpoint's value, below what the dead process exported, counts the steps
    # between the checkpoint and the crash twice. So the new process counts from 0, and
    # echo_server_start_time_seconds says when it started; stats() keeps the totals.
    options = RESTARTS[kind]
    one = {"x": np.zeros((), np.int64)}

    def submit(server: echo.Server, i: int) -> None:
        step = {"x": np.array(i, np.int64)}
        if kind == "sequence":
            server.submit(step, stream=0, end_episode=i == 5)
        else:
            server.submit(step)

    dead = make_server(one, name="learner", **options)
    for i in range(6):
        submit(dead, i)
    take(dead)
    take(dead)
    dead.checkpoint(tmp_path / "ckpt")
    before = scrape(serve(dead))
    assert value(before, "echo_samples_inserted_total", "learner", path="submit") == 6
    assert value(before, "echo_samples_sampled_total", "learner") == 4
    totals = dead.stats()
    dead.close()

    restored = echo.Server.restore(tmp_path / "ckpt")
    try:
        endpoint = serve(restored)
        after = scrape(endpoint)
        assert after.keys() == before.keys()  # the same series, under the same labels
        counters = _counter_series(after, "learner")
        assert counters
        assert all(v == 0 for v in counters.values()), {k: v for k, v in counters.items() if v}
        started = value(after, "echo_server_start_time_seconds", "learner")
        assert value(before, "echo_server_start_time_seconds", "learner") < started
        assert started == pytest.approx(time.time(), abs=WAIT_S)
        # stats() keeps what the checkpoint carried over.
        if kind == "sequence":
            assert restored.stats().steps_inserted_total == totals.steps_inserted_total == 6
            assert restored.stats().items_sampled_total == totals.items_sampled_total == 4
        # From then on the counters count what the new process does.
        for i in range(6, 9):
            submit(restored, i)
        take(restored)
        again = scrape(endpoint)
        assert value(again, "echo_samples_inserted_total", "learner", path="submit") == 3
        assert value(again, "echo_samples_sampled_total", "learner") == 2
        if kind == "sequence":
            assert value(again, "echo_sequence_steps_inserted_total", "learner") == 3
            assert restored.stats().steps_inserted_total == 9
    finally:
        restored.close()


def test_the_start_time_is_the_servers_creation(make_server: Any, serve: Any) -> None:
    made = time.time()
    server = make_server()
    started = value(scrape(serve(server)), "echo_server_start_time_seconds")
    assert made <= started <= time.time()


def test_in_process_submits_count_as_inserted_by_the_submit_path(
    make_server: Any, serve: Any, make_sample: Any
) -> None:
    server = make_server(batch_size=4, num_buffers=8)
    for i in range(5):
        server.submit(make_sample(i))
    rows = {"id": np.arange(5, 12, dtype=np.int64), "obs": np.zeros((7, 3), np.float32)}
    assert server.submit_batch(rows) == 7
    assert server.stats().samples_submitted_total == 12
    assert server.stats().samples_inserted_total == 0  # the transport's count
    series = scrape(serve(server))
    assert value(series, "echo_samples_inserted_total", path="submit") == 12
    assert value(series, "echo_samples_inserted_total", path="ingress") == 0


def test_two_servers_are_told_apart_by_name(make_server: Any, serve: Any, make_sample: Any) -> None:
    a = make_server(batch_size=2, name="a")
    b = make_server(batch_size=2, name="b")
    for i in range(4):
        a.submit(make_sample(i))
    b.submit(make_sample(0))
    take(a)
    series = scrape(serve(a, b))
    assert value(series, "echo_samples_sampled_total", server="a") == 2
    assert value(series, "echo_samples_sampled_total", server="b") == 0
    assert value(series, "echo_store_size", server="a") == 2
    assert value(series, "echo_store_size", server="b") == 1
    with pytest.raises(ValueError, match="named 'a'"):
        EchoCollector(a, make_server(name="a"))
    with pytest.raises(ValueError, match="named 'default'"):
        EchoCollector(make_server(), make_server())


def test_server_name_is_checked(make_server: Any) -> None:
    assert make_server().name == "default"
    assert make_server(name="learner-0").name == "learner-0"
    with pytest.raises(ValueError, match="name"):
        make_server(name="")
    with pytest.raises(TypeError, match="name"):
        make_server(name=3)


def test_collector_in_a_custom_registry(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2, name="mine")
    server.submit(make_sample(0))
    server.submit(make_sample(1))
    registry = CollectorRegistry()
    registry.register(EchoCollector(server))
    assert registry.get_sample_value("echo_store_size", {"server": "mine"}) == 2
    take(server)
    assert registry.get_sample_value("echo_samples_sampled_total", {"server": "mine"}) == 2
    # A second collector of the same metrics in one registry is refused by the registry.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(EchoCollector(make_server(name="other")))
    with pytest.raises(TypeError, match=re.escape("echo.Server")):
        EchoCollector(object())  # type: ignore[arg-type]


def test_endpoint_handle(make_server: Any) -> None:
    server = make_server()
    with echo.serve_metrics(server, port=0) as endpoint:
        assert endpoint.port > 0
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        assert endpoint.collector.servers == (server,)
        assert value(scrape(endpoint), "echo_store_size") == 0
        assert "closed=False" in repr(endpoint)
    assert endpoint.closed
    endpoint.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(endpoint.url, timeout=WAIT_S)
    with pytest.raises(ValueError, match="port"):
        echo.serve_metrics(server, port=70_000)


HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: not done


def handler_threads() -> int:
    return sum(t.name == HANDLER_THREAD_NAME for t in threading.enumerate())


def closed_by_the_endpoint(peer: socket.socket) -> bool:
    """Whether the endpoint closed `peer` (it reads end of file, or a reset, at once)."""
    peer.setblocking(False)
    try:
        return peer.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_requests_hold_at_most_max_connections_threads(make_server: Any) -> None:
    # A long timeout: what lets the scrape in below is the bound, not connections timing out.
    with echo.serve_metrics(make_server(), port=0, max_connections=4, timeout=60.0) as endpoint:
        peers: list[socket.socket] = []
        try:
            for _ in range(64):
                peer = socket.create_connection(("127.0.0.1", endpoint.port), timeout=WAIT_S)
                peer.sendall(HALF_A_REQUEST)
                peers.append(peer)
                assert handler_threads() <= 4
            # Each newcomer beyond the 4th had the oldest half-sent request closed for it.
            poll(
                lambda: sum(closed_by_the_endpoint(p) for p in peers),
                lambda closed: closed >= 60,
                "the endpoint closing the oldest half-sent requests",
            )
            assert handler_threads() <= 4
            # A scrape meanwhile (the peers still hold their sockets) is answered.
            assert value(scrape(endpoint), "echo_store_size") == 0
            assert handler_threads() <= 4
        finally:
            for peer in peers:
                peer.close()
    assert handler_threads() == 0  # close() joined them


def test_a_stalled_request_is_closed_after_the_timeout(make_server: Any) -> None:
    with echo.serve_metrics(make_server(), port=0, timeout=0.2) as endpoint:
        assert endpoint.timeout == 0.2
        assert endpoint.max_connections == 8
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=WAIT_S) as peer:
            peer.sendall(HALF_A_REQUEST)
            # The endpoint gives up on the rest of the request and closes the connection.
            assert peer.recv(1) == b""
        poll(handler_threads, lambda n: n == 0, "the handler thread ending")
        assert value(scrape(endpoint), "echo_store_size") == 0


def test_endpoint_limits_are_checked(make_server: Any) -> None:
    server = make_server()
    with pytest.raises(ValueError, match=r"max_connections must be in \[1, 65536\], got 0"):
        echo.serve_metrics(server, port=0, max_connections=0)
    with pytest.raises(TypeError, match="max_connections must be an int, got float"):
        echo.serve_metrics(server, port=0, max_connections=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        echo.serve_metrics(server, port=0, timeout=0)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds, got inf"):
        echo.serve_metrics(server, port=0, timeout=float("inf"))
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got str"):
        echo.serve_metrics(server, port=0, timeout="5")  # type: ignore[arg-type]


def test_import_error_names_the_extra(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "echo.metrics", raising=False)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=re.escape("id-echo[metrics]")):
        echo.serve_metrics(make_server(), port=0)


PROMETHEUS_GUIDE = ROOT / "docs" / "guides" / "prometheus.md"


def _docs_table_names(text: str) -> dict[str, str]:
    """`{name: type}` of a reference table's rows (first cell a backquoted echo_ name)."""
    rows = re.findall(r"^\| `(echo_[a-z0-9_]+)` \| (\w+) \|", text, re.MULTILINE)
    return dict(rows)


def _docs_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The reference's two tables, `{name: type}` each: what every build serves, and what
    only the detailed build serves."""
    text = PROMETHEUS_GUIDE.read_text()
    every = text.index("### Served by every build")
    detailed = text.index("### Detailed build only")
    end = text.index("\n## ", detailed)
    return _docs_table_names(text[every:detailed]), _docs_table_names(text[detailed:end])


def test_docs_reference_table_lists_every_metric() -> None:
    every, detailed = _docs_tables()
    assert not every.keys() & detailed.keys()
    assert every | detailed == _docs_table_names(PROMETHEUS_GUIDE.read_text())
    assert every == {m.name: m.kind for m in METRICS if not m.detailed}
    assert detailed == {m.name: m.kind for m in METRICS if m.detailed}


def test_docs_default_build_table_is_exactly_what_the_build_serves(make_server: Any) -> None:
    # Scraped from this build: the default one serves exactly the first table's series, a
    # detailed one the first table's and the second's.
    every, detailed = _docs_tables()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EchoCollector(make_server()))
    served = {name for name, _ in parse(generate_latest(registry).decode())[1]}
    specs = {m.name: m for m in METRICS}
    expected = [specs[name] for name in every]
    if echo.DETAILED_METRICS:
        expected += [specs[name] for name in detailed]
    assert served == exposed_names(expected)


def _dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, child in node.items():
            if key in ("expr", "definition") and isinstance(child, str):
                yield child
            else:
                yield from _dashboard_exprs(child)
    elif isinstance(node, list):
        for child in node:
            yield from _dashboard_exprs(child)


def test_grafana_dashboard_refers_only_to_emitted_metrics() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "echo.json").read_text())
    assert dashboard["title"]
    panels = dashboard["panels"]
    assert len(panels) >= 6
    exprs = list(_dashboard_exprs(dashboard))
    assert len(exprs) >= len([p for p in panels if p.get("type") != "row"])
    known = exposed_names(METRICS)
    used: set[str] = set()
    for expr in exprs:
        for name in re.findall(r"\becho_[a-z0-9_]+", expr):
            assert name in known, f"dashboard query {expr!r} names unknown metric {name}"
            used.add(name)
    # The bottleneck panels the guide describes are there.
    for name in (
        "echo_learner_wait_seconds_total",
        "echo_ingress_push_blocked_total",
        "echo_rate_limiter_insert_blocked_seconds_total",
        "echo_store_size",
        "echo_samples_inserted_total",
    ):
        assert name in used, name
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles))


def test_grafana_panels_on_detailed_series_say_detailed_build_only() -> None:
    # The default build does not serve them: a panel on them shows "No data" there, and
    # says why in its title and description. No other panel claims it.
    dashboard = json.loads((ROOT / "docs" / "grafana" / "echo.json").read_text())
    detailed = exposed_names([m for m in METRICS if m.detailed])
    marked = 0
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            continue
        names = {n for e in _dashboard_exprs(panel) for n in re.findall(r"\becho_[a-z0-9_]+", e)}
        title, description = panel["title"], panel.get("description", "")
        if names & detailed:
            assert names <= detailed, f"{title!r} mixes detailed and default series"
            assert title.endswith("(detailed build only)"), title
            assert description.startswith("Detailed build only (cargo feature detailed-metrics)")
            marked += 1
        else:
            assert "detailed build only" not in (title + description).lower(), title
    assert marked == 2
