"""`SampleInfo` (also what `stats()` returns) and `HistSnapshot` are plain values: `==` by
value (equal after a pickle round trip, unequal when any field differs), a hash that agrees
with `==`, and a `repr` that shows the fields without dumping long arrays."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from conftest import take

import echo
from echo import _echo

HIST_FIELDS = ["count", "min_ns", "max_ns", "mean_ns", "p50_ns", "p90_ns", "p99_ns"]
HISTOGRAMS = ["drain_round", "memcpy", "queue_dwell"]
REPLAY_ARRAYS = ["keys", "probabilities", "times_sampled"]
# Computed from the fields, not fields themselves.
DERIVED = ("compression_ratio",)
SCALARS = sorted(
    name
    for name in dir(echo.SampleInfo)
    if not name.startswith("_")
    and name != "as_dict"
    and name not in DERIVED
    and name not in HISTOGRAMS
    and name not in REPLAY_ARRAYS
)
PROTOCOLS = range(2, pickle.HIGHEST_PROTOCOL + 1)


def _hist(**fields: Any) -> echo.HistSnapshot:
    values: dict[str, Any] = {
        "count": 7,
        "min_ns": 10,
        "max_ns": 900,
        "mean_ns": 123.5,
        "p50_ns": 100,
        "p90_ns": 700,
        "p99_ns": 890,
    }
    return echo.HistSnapshot(**{**values, **fields})


def _state(**changes: Any) -> dict[str, Any]:
    """Distinct values in every field of a SampleInfo (what unpickling reads), then
    `changes`."""
    state: dict[str, Any] = {name: 1000 + i for i, name in enumerate(SCALARS)}
    for i, name in enumerate(HISTOGRAMS):
        state[name] = _hist(count=i + 1)
    state["keys"] = np.arange(4, dtype=np.uint64)
    state["probabilities"] = np.full(4, 0.25)
    state["times_sampled"] = np.ones(4, np.uint32)
    return {**state, **changes}


def _info(**changes: Any) -> echo.SampleInfo:
    return _echo._sample_info(_state(**changes))  # pyright: ignore[reportPrivateUsage]


# --- HistSnapshot ---------------------------------------------------------------------------


def test_hist_snapshot_equals_its_pickle_round_trip_and_hashes_alike() -> None:
    hist = _hist()
    for protocol in PROTOCOLS:
        copy = pickle.loads(pickle.dumps(hist, protocol))
        assert copy is not hist
        assert copy == hist
        assert not copy != hist  # noqa: SIM202 - `!=` is its own slot
        assert hash(copy) == hash(hist)
    assert len({hist, _hist(), pickle.loads(pickle.dumps(hist))}) == 1


@pytest.mark.parametrize("field", HIST_FIELDS)
def test_hist_snapshots_differing_in_one_field_are_unequal(field: str) -> None:
    other = _hist(**{field: 1.5 if field == "mean_ns" else 1})
    assert other != _hist()
    assert not other == _hist()  # noqa: SIM201 - `==` is its own slot


def test_hist_snapshot_is_unequal_to_other_types_and_zero_means_hash_alike() -> None:
    hist = _hist()
    assert hist != hist.as_dict()
    assert hist != tuple(hist.as_dict().values())
    assert hist != 7
    # -0.0 == 0.0, so the two hash alike.
    assert _hist(mean_ns=-0.0) == _hist(mean_ns=0.0)
    assert hash(_hist(mean_ns=-0.0)) == hash(_hist(mean_ns=0.0))


def test_hist_snapshot_repr_names_every_field() -> None:
    assert repr(_hist()) == (
        "HistSnapshot(count=7, min_ns=10, max_ns=900, mean_ns=123.5, p50_ns=100, p90_ns=700, "
        "p99_ns=890)"
    )


# --- SampleInfo -----------------------------------------------------------------------------


def test_sample_info_equals_its_pickle_round_trip_and_hashes_alike() -> None:
    info = _info()
    for protocol in PROTOCOLS:
        copy = pickle.loads(pickle.dumps(info, protocol))
        assert copy is not info
        assert copy.keys is not info.keys  # the arrays come back as copies, still equal
        assert copy == info
        assert not copy != info  # noqa: SIM202 - `!=` is its own slot
        assert hash(copy) == hash(info)
    assert len({info, _info()}) == 1


@pytest.mark.parametrize("field", SCALARS + HISTOGRAMS + REPLAY_ARRAYS)
def test_sample_infos_differing_in_one_field_are_unequal(field: str) -> None:
    changed: dict[str, Any] = {
        **{name: 1 for name in SCALARS},
        **{name: _hist(count=99) for name in HISTOGRAMS},
        "keys": np.arange(1, 5, dtype=np.uint64),  # other elements
        "probabilities": np.full(4, 0.25, np.float32),  # other dtype, same values
        "times_sampled": np.ones(5, np.uint32),  # other shape
    }
    other = _info(**{field: changed[field]})
    assert other != _info()
    assert not other == _info()  # noqa: SIM201 - `==` is its own slot
    if field in REPLAY_ARRAYS:
        assert _info(**{field: None}) != _info()


def test_sample_info_is_unequal_to_other_types() -> None:
    info = _info()
    assert info != info.as_dict()
    assert info != _hist()
    assert info != None  # noqa: E711 - the comparison itself is under test


def test_two_snapshots_of_an_idle_server_are_equal(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2)
    for i in range(3):
        server.submit(make_sample(i))
    take(server)
    first, second = server.stats(), server.stats()
    assert first is not second
    assert first == second
    assert hash(first) == hash(second)
    server.submit(make_sample(3))  # completes a batch: the counters move
    assert server.stats() != first


def test_a_replay_batch_info_equals_its_pickle_round_trip(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(sampler=echo.Uniform(), max_size=16, seed=3)
    for i in range(6):
        server.submit(make_sample(i), timeout=0)
    info = take(server).info
    assert info.keys is not None
    copy = pickle.loads(pickle.dumps(info))
    assert copy == info
    assert hash(copy) == hash(info)
    assert take(server).info != info  # another batch


def test_sample_info_repr_shows_fields_and_elides_long_ones() -> None:
    big = np.arange(10_000, dtype=np.uint64)
    fields: dict[str, Any] = {name: 0 for name in SCALARS}
    fields.update(
        sequence=5,
        store_size=12,
        samples_inserted_total=34,
        last_checkpoint_duration_s=0.5,
        memcpy=_hist(),
        drain_round=echo.HistSnapshot(),
        queue_dwell=echo.HistSnapshot(),
        keys=big,
        probabilities=None,
        times_sampled=None,
    )
    text = repr(_info(**fields))
    assert text.startswith("SampleInfo(sequence=5, wait_ns=0, ")
    for part in (
        "store_size=12",
        "samples_inserted_total=34",
        "last_checkpoint_duration_s=0.5",
        f"memcpy={_hist()!r}",
        "keys=<uint64 array of shape (10000,)>",
    ):
        assert part in text, text
    # Zero counters, empty histograms and absent arrays are counted, not listed.
    assert "notify_count" not in text
    assert "drain_round" not in text
    assert "probabilities" not in text
    zero = len(SCALARS) - 5 + 2 + 2  # scalars but the five above, two histograms, two arrays
    assert text.endswith(f", <{zero} more fields are 0>)"), text
    assert len(text) < 600


def test_compression_ratio_is_raw_over_stored_bytes_and_one_when_empty() -> None:
    assert _info(raw_bytes=1000, stored_bytes=125).compression_ratio == 8.0
    assert _info(raw_bytes=0, stored_bytes=0).compression_ratio == 1.0
