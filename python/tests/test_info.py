"""The public names, `SampleInfo` and `HistSnapshot`."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
from conftest import take

import echo

# Bound on any single blocking step before it counts as a hang.
WAIT_S = 10.0

SAMPLE_INFO_FIELDS = [
    "store_size",
    "active_connections",
    "queue_depth_sum",
    "queue_depth_max",
    "push_blocked_count",
    "samples_inserted_total",
    "notify_count",
    "cas_success_total",
    "cas_failure_total",
    "reservation_retries_total",
    "drain_round",
    "memcpy",
    "queue_dwell",
]
HISTOGRAMS = ["drain_round", "memcpy", "queue_dwell"]
HIST_FIELDS = ["count", "min_ns", "max_ns", "mean_ns", "p50_ns", "p90_ns", "p99_ns"]


def _one_info(make_server: Any, make_sample: Any) -> echo.SampleInfo:
    server = make_server(batch_size=2)
    server.submit(make_sample(0))
    server.submit(make_sample(1))
    sample = server.sample(timeout=WAIT_S)
    assert sample is not None
    return sample.info


def test_public_names_import() -> None:
    from echo import (  # noqa: F401 - the import itself is the test
        ConnectionClosedError,
        HistSnapshot,
        Sample,
        SampleInfo,
        Server,
        __version__,
    )


def test_version_is_a_non_empty_str() -> None:
    assert isinstance(echo.__version__, str)
    assert echo.__version__


def test_connection_closed_error_is_a_connection_error() -> None:
    assert issubclass(echo.ConnectionClosedError, ConnectionError)
    assert issubclass(echo.ConnectionClosedError, OSError)
    with pytest.raises(ConnectionError):
        raise echo.ConnectionClosedError("peer went away")


def test_sample_info_is_frozen(make_server: Any, make_sample: Any) -> None:
    info = _one_info(make_server, make_sample)
    for field in [*SAMPLE_INFO_FIELDS, "sequence", "wait_ns"]:
        with pytest.raises(AttributeError):
            setattr(info, field, 5)
    with pytest.raises(AttributeError):
        info.brand_new_attribute = 1  # type: ignore[attr-defined]
    assert info.store_size == 0


def test_hist_snapshot_is_frozen(make_server: Any, make_sample: Any) -> None:
    hist = _one_info(make_server, make_sample).memcpy
    assert isinstance(hist, echo.HistSnapshot)
    for field in HIST_FIELDS:
        with pytest.raises(AttributeError):
            setattr(hist, field, 5)


def test_sample_info_as_dict_has_every_spec_field(make_server: Any, make_sample: Any) -> None:
    info = _one_info(make_server, make_sample)
    as_dict = info.as_dict()
    assert isinstance(as_dict, dict)
    missing = set(SAMPLE_INFO_FIELDS) - set(as_dict)
    assert not missing, f"as_dict() lacks {sorted(missing)}"
    for field in SAMPLE_INFO_FIELDS:
        if field in HISTOGRAMS:
            assert as_dict[field] == getattr(info, field).as_dict()
            assert set(HIST_FIELDS) <= set(as_dict[field])
        else:
            assert isinstance(as_dict[field], int)
            assert as_dict[field] == getattr(info, field)


# Public properties of SampleInfo that as_dict() leaves out: the replay batch's per-item
# arrays, which are not counters (documented in the API reference).
NOT_IN_AS_DICT = {"keys", "probabilities", "times_sampled"}


def _properties(cls: type) -> set[str]:
    """The public data descriptors (properties, native getters) of `cls`."""
    return {
        name
        for name in dir(cls)
        if not name.startswith("_") and inspect.isdatadescriptor(getattr(cls, name))
    }


def test_sample_info_as_dict_has_every_public_property(make_server: Any, make_sample: Any) -> None:
    # Enumerated, not listed: a property added later cannot be forgotten by as_dict().
    frames = {"frame": np.zeros(4096, np.uint8)}
    server = make_server(
        frames, batch_size=2, sampler=echo.Uniform(), max_size=8, compress={"frame": echo.Lz4()}
    )
    server.submit(frames)
    server.submit(frames)
    info = take(server).info
    properties = _properties(echo.SampleInfo)
    assert {"compression_ratio", "store_size", "memcpy", "last_checkpoint_unix_s"} <= properties
    as_dict = info.as_dict()
    assert set(as_dict) == properties - NOT_IN_AS_DICT
    for name in properties - NOT_IN_AS_DICT:
        value = getattr(info, name)
        expected = value.as_dict() if isinstance(value, echo.HistSnapshot) else value
        assert as_dict[name] == expected, name
    assert as_dict["compression_ratio"] == info.compression_ratio > 1.0  # zeros compress
    assert server.stats().as_dict()["compression_ratio"] == server.stats().compression_ratio


def test_hist_snapshot_as_dict_has_every_public_property(
    make_server: Any, make_sample: Any
) -> None:
    hist = _one_info(make_server, make_sample).memcpy
    properties = _properties(echo.HistSnapshot)
    assert set(HIST_FIELDS) <= properties
    assert hist.as_dict() == {name: getattr(hist, name) for name in properties}


@pytest.mark.skipif(
    echo.DETAILED_METRICS, reason="the telemetry build records them (see test_metrics.py)"
)
def test_histograms_are_all_zero_in_the_default_build(make_server: Any, make_sample: Any) -> None:
    info = _one_info(make_server, make_sample)
    for name in HISTOGRAMS:
        hist = getattr(info, name)
        assert isinstance(hist, echo.HistSnapshot)
        for field in HIST_FIELDS:
            assert getattr(hist, field) == 0, f"{name}.{field}"
        assert hist.as_dict() == dict.fromkeys(HIST_FIELDS, 0)
    # The detailed counters are zero too without the `detailed-metrics` feature.
    assert info.cas_success_total == 0
    assert info.cas_failure_total == 0
    assert info.reservation_retries_total == 0


def test_reset_histograms_keeps_counters(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=1)
    server.submit(make_sample(0))
    assert server.sample(timeout=WAIT_S) is not None
    server.reset_histograms()
    server.submit(make_sample(1))
    sample = server.sample(timeout=WAIT_S)
    assert sample is not None
    assert sample.info.notify_count == 2
    assert sample.info.sequence == 1


def test_sequence_counts_batches_from_zero(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2, num_buffers=2)
    sequences = []
    for n in range(7):  # several laps of the ring
        server.submit(make_sample(2 * n))
        server.submit(make_sample(2 * n + 1))
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        sequences.append(sample.info.sequence)
    assert sequences == list(range(7))


def test_notify_count_is_the_number_of_completed_batches(
    make_filled: Any, make_sample: Any
) -> None:
    server = make_filled(5, batch_size=2, num_buffers=4)  # two full batches, a half batch
    assert take(server).info.notify_count == 2
    assert take(server).info.notify_count == 2
    server.submit(make_sample(5))
    assert take(server).info.notify_count == 3


def test_store_size_counts_committed_samples_not_yet_sampled(
    make_filled: Any, make_sample: Any
) -> None:
    server = make_filled(5, batch_size=2, num_buffers=4)
    assert take(server).info.store_size == 3  # samples 2, 3 and 4
    assert take(server).info.store_size == 1  # sample 4
    for i in range(5, 8):
        server.submit(make_sample(i))
    assert take(server).info.store_size == 2  # samples 6 and 7


def test_stats_store_size_excludes_the_batch_already_sampled(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(batch_size=2, num_buffers=4)
    assert server.stats().store_size == 0
    for i in range(3):
        server.submit(make_sample(i))
    assert server.stats().store_size == 3
    sample = server.sample(timeout=WAIT_S)
    assert sample is not None
    # The consumer holds samples 0 and 1 now: they have been sampled.
    assert sample.info.store_size == 1
    assert server.stats().store_size == 1
    assert server.stats().notify_count == 1


def test_submit_is_not_counted_as_inserted_by_drainers(make_server: Any, make_sample: Any) -> None:
    info = _one_info(make_server, make_sample)
    assert info.samples_inserted_total == 0
    assert info.active_connections == 0
    assert info.queue_depth_sum == 0
    assert info.queue_depth_max == 0
    assert info.push_blocked_count == 0


def test_wait_ns_is_a_non_negative_int(make_server: Any, make_sample: Any) -> None:
    info = _one_info(make_server, make_sample)
    assert isinstance(info.wait_ns, int)
    assert info.wait_ns >= 0
