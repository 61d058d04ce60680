"""Bad input to `Server(...)` and `Server.submit()` gets a clear exception, and a rejected
`submit()` writes nothing to the ring."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest

import echo

EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}


def good(i: int = 0) -> dict[str, np.ndarray]:
    return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}


# --- the example -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_example",
    [
        pytest.param({"a": 1.0}, id="float"),
        pytest.param({"a": 3}, id="int"),
        pytest.param({"a": "text"}, id="str"),
        pytest.param({"a": b"bytes"}, id="bytes"),
        pytest.param({"a": [1.0, 2.0]}, id="list-of-floats"),
        pytest.param({"a": np.float32(1.0)}, id="numpy-scalar"),
        pytest.param({"a": np.zeros(3), "b": object()}, id="object-next-to-array"),
        pytest.param(np.float64(2.0), id="root-numpy-scalar"),
    ],
)
def test_example_with_a_non_array_leaf_is_a_type_error(bad_example: Any) -> None:
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        echo.Server(bad_example, batch_size=2)


@pytest.mark.parametrize(
    "bad_example",
    [
        pytest.param({"a": np.array([None, 1], dtype=object)}, id="object"),
        pytest.param(
            {"a": np.zeros((2,), dtype=[("x", np.float32), ("y", object)])},
            id="structured-with-object-field",
        ),
        pytest.param({"ok": np.zeros(3), "bad": np.empty((0,), dtype=object)}, id="empty-object"),
    ],
)
def test_example_with_object_dtype_is_a_type_error(bad_example: Any) -> None:
    with pytest.raises(TypeError, match="Python objects"):
        echo.Server(bad_example, batch_size=2)


@pytest.mark.parametrize(
    "bad_example",
    [
        pytest.param({}, id="empty-dict"),
        pytest.param([], id="empty-list"),
        pytest.param((), id="empty-tuple"),
        pytest.param(None, id="none"),
        pytest.param({"a": None, "b": {"c": ()}}, id="only-empty-nodes"),
    ],
)
def test_example_without_leaves_is_a_value_error(bad_example: Any) -> None:
    with pytest.raises(ValueError, match="no leaves"):
        echo.Server(bad_example, batch_size=2)


@pytest.mark.parametrize(
    "bad_example",
    [
        pytest.param({"a": np.zeros((0,), np.float32)}, id="one-empty"),
        pytest.param(
            {"a": np.zeros((0, 3), np.float64), "b": np.zeros((2, 0), np.int8)}, id="two-empty"
        ),
        pytest.param(np.zeros((4, 0, 2), np.uint8), id="root-empty"),
    ],
)
def test_example_with_only_empty_leaves_is_a_value_error(bad_example: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        echo.Server(bad_example, batch_size=2)


# --- integer arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -1}, "batch_size"),
        ({"batch_size": -(2**40)}, "batch_size"),
        ({"num_buffers": 1}, "num_buffers"),
        ({"num_buffers": 0}, "num_buffers"),
        ({"num_buffers": -3}, "num_buffers"),
        ({"num_drainers": 0}, "num_drainers"),
        ({"num_drainers": -1}, "num_drainers"),
        ({"producer_queue_size": 0}, "producer_queue_size"),
        ({"producer_queue_size": -1}, "producer_queue_size"),
    ],
)
def test_out_of_range_arguments_are_value_errors(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = {"batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        echo.Server(EXAMPLE, **args)


@pytest.mark.parametrize(
    "name", ["batch_size", "num_buffers", "num_drainers", "producer_queue_size"]
)
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(True, id="true"),
        pytest.param(False, id="false"),
        pytest.param(2.0, id="float"),
        pytest.param(float("nan"), id="nan"),
        pytest.param("4", id="str"),
        pytest.param(None, id="none"),
        pytest.param(np.bool_(True), id="numpy-bool"),
    ],
)
def test_non_integer_arguments_are_type_errors(name: str, value: object) -> None:
    args: dict[str, Any] = {"batch_size": 4, name: value}
    if name == "producer_queue_size" and value is None:
        # None is the default: the queue is sized by bytes (64 KiB of samples, 8 to 256).
        assert echo.Server(EXAMPLE, **args).producer_queue_size == 256
        return
    with pytest.raises(TypeError, match=name):
        echo.Server(EXAMPLE, **args)


def test_numpy_integers_are_accepted_as_arguments() -> None:
    server = echo.Server(
        EXAMPLE,
        batch_size=np.int64(2),  # pyright: ignore[reportArgumentType]
        num_buffers=np.uint8(3),  # pyright: ignore[reportArgumentType]
    )
    try:
        assert server.batch_size == 2
        assert server.num_buffers == 3
    finally:
        server.close()


def test_smallest_valid_arguments_work(make_sample: Any, batch_ids: Any) -> None:
    server = echo.Server(
        EXAMPLE, batch_size=1, num_buffers=2, num_drainers=1, producer_queue_size=1
    )
    try:
        server.submit(make_sample(7))
        sample = server.sample(timeout=10)
        assert sample is not None
        assert batch_ids(sample.batch) == [7]
    finally:
        server.close()


# --- submit() --------------------------------------------------------------------------------


class _Pair(NamedTuple):
    id: np.ndarray
    obs: np.ndarray


WRONG_STRUCTURE = [
    pytest.param({"id": good()["id"]}, id="missing-key"),
    pytest.param({**good(), "extra": np.zeros(3, np.float32)}, id="extra-key"),
    pytest.param({"id": good()["id"], "OBS": good()["obs"]}, id="renamed-key"),
    pytest.param((good()["id"], good()["obs"]), id="tuple-instead-of-dict"),
    pytest.param([good()["id"], good()["obs"]], id="list-instead-of-dict"),
    pytest.param(_Pair(good()["id"], good()["obs"]), id="namedtuple-instead-of-dict"),
    pytest.param({"id": good()["id"], "obs": (good()["obs"],)}, id="leaf-wrapped-in-tuple"),
    pytest.param({"id": good()["id"], "obs": {"x": good()["obs"]}}, id="leaf-wrapped-in-dict"),
    pytest.param({"id": good()["id"], "obs": None}, id="leaf-replaced-by-none"),
    pytest.param(good()["obs"], id="bare-array"),
    pytest.param(None, id="none"),
]

WRONG_SHAPE = [
    pytest.param({"id": good()["id"], "obs": np.zeros((4,), np.float32)}, id="longer"),
    pytest.param({"id": good()["id"], "obs": np.zeros((2,), np.float32)}, id="shorter"),
    pytest.param({"id": good()["id"], "obs": np.zeros((1, 3), np.float32)}, id="extra-dim"),
    pytest.param({"id": good()["id"], "obs": np.zeros((3, 1), np.float32)}, id="trailing-dim"),
    pytest.param({"id": good()["id"], "obs": np.array(1.0, np.float32)}, id="0d-for-vector"),
    pytest.param({"id": good()["id"], "obs": np.zeros((0,), np.float32)}, id="empty"),
    pytest.param({"id": good()["id"], "obs": np.float32(1.0)}, id="numpy-scalar-for-vector"),
    pytest.param({"id": np.zeros((1,), np.int64), "obs": good()["obs"]}, id="vector-for-0d"),
    pytest.param({"id": np.zeros((2,), np.int64), "obs": good()["obs"]}, id="pair-for-0d"),
]

WRONG_DTYPE = [
    pytest.param({"id": good()["id"], "obs": np.zeros(3, np.float64)}, id="float64"),
    pytest.param({"id": good()["id"], "obs": np.zeros(3, np.float16)}, id="float16"),
    pytest.param({"id": good()["id"], "obs": np.zeros(3, np.int32)}, id="int32-same-itemsize"),
    pytest.param({"id": good()["id"], "obs": np.zeros(3, np.uint32)}, id="uint32-same-itemsize"),
    pytest.param({"id": good()["id"], "obs": np.zeros(3, ">f4")}, id="byteswapped"),
    pytest.param({"id": np.array(0, np.int32), "obs": good()["obs"]}, id="int32-id"),
    pytest.param({"id": np.array(0, np.uint64), "obs": good()["obs"]}, id="uint64-id"),
    pytest.param({"id": np.array(0, np.float64), "obs": good()["obs"]}, id="float64-id"),
    pytest.param(
        {"id": good()["id"], "obs": np.array([None, None, None], dtype=object)}, id="object"
    ),
]

NON_ARRAY_LEAF = [
    pytest.param({"id": 0, "obs": good()["obs"]}, id="int"),
    pytest.param({"id": good()["id"], "obs": 1.5}, id="float"),
    pytest.param({"id": good()["id"], "obs": "abc"}, id="str"),
    pytest.param({"id": good()["id"], "obs": bytes(12)}, id="bytes"),
    pytest.param({"id": good()["id"], "obs": memoryview(bytes(12))}, id="memoryview"),
    pytest.param({"id": good()["id"], "obs": object()}, id="object"),
]


def _assert_ring_untouched(server: echo.Server, make_sample: Any, batch_ids: Any) -> None:
    """Proves nothing went into the ring: the next full batch holds exactly the next
    `batch_size` good samples, in order."""
    assert server.stats().store_size == 0
    ids = list(range(1000, 1000 + server.batch_size))
    for i in ids:
        server.submit(make_sample(i))
    sample = server.sample(timeout=10)
    assert sample is not None
    assert batch_ids(sample.batch) == ids
    assert sample.info.sequence == 0
    assert sample.info.store_size == 0


# Each bad sample with the exception and message it must raise: (kind, cases, type, match).
REJECTED = [
    ("structure", WRONG_STRUCTURE, ValueError, "structure"),
    ("shape", WRONG_SHAPE, ValueError, "shape"),
    ("dtype", WRONG_DTYPE, TypeError, "dtype"),
    ("non-array", NON_ARRAY_LEAF, TypeError, r"numpy\.ndarray"),
]


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        pytest.param(*case.values, error, match, id=f"{kind}-{case.id}")
        for kind, cases, error, match in REJECTED
        for case in cases
    ],
)
def test_a_rejected_submit_raises_a_precise_error_and_writes_nothing(
    make_server: Any, make_sample: Any, batch_ids: Any, bad: Any, error: type, match: str
) -> None:
    server = make_server(batch_size=3)
    for _ in range(3):
        with pytest.raises(error, match=match):
            server.submit(bad)
    _assert_ring_untouched(server, make_sample, batch_ids)


def test_numpy_scalar_for_a_0d_leaf_is_stored_like_a_0d_array(
    make_server: Any, batch_ids: Any
) -> None:
    # An addition to the spec: a numpy scalar is a 0-d array in all but type.
    server = make_server(batch_size=2)
    server.submit({"id": np.int64(5), "obs": np.full((3,), 5, np.float32)})
    server.submit({"id": np.array(6, np.int64), "obs": np.full((3,), 6, np.float32)})
    with pytest.raises(TypeError, match="dtype"):
        server.submit({"id": np.int32(7), "obs": np.full((3,), 7, np.float32)})
    sample = server.sample(timeout=10)
    assert sample is not None
    assert batch_ids(sample.batch) == [5, 6]


def test_error_messages_name_the_offending_leaf(make_server: Any) -> None:
    server = make_server(ex={"outer": {"inner": np.zeros((2,), np.float32)}}, batch_size=1)
    with pytest.raises(ValueError, match=r"'outer'.*'inner'.*\(2,\).*\(5,\)"):
        server.submit({"outer": {"inner": np.zeros((5,), np.float32)}})
    with pytest.raises(TypeError, match=r"'outer'.*'inner'.*float32.*float64"):
        server.submit({"outer": {"inner": np.zeros((2,), np.float64)}})


@pytest.mark.parametrize("timeout", [-1.0, -1e-9, float("nan"), float("-inf")])
def test_submit_with_invalid_timeout_is_a_value_error_and_writes_nothing(
    make_server: Any, make_sample: Any, batch_ids: Any, timeout: float
) -> None:
    server = make_server(batch_size=2)
    with pytest.raises(ValueError, match="timeout"):
        server.submit(make_sample(1), timeout=timeout)
    _assert_ring_untouched(server, make_sample, batch_ids)


def test_rejected_submits_between_good_ones_leave_no_gap(
    make_server: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = make_server(batch_size=4)
    bad_cases: list[tuple[type[Exception], Any]] = [
        (ValueError, {"id": good()["id"]}),
        (ValueError, {"id": good()["id"], "obs": np.zeros(4, np.float32)}),
        (TypeError, {"id": good()["id"], "obs": np.zeros(3, np.float64)}),
        (TypeError, {"id": 3, "obs": good()["obs"]}),
    ]
    for i, (exc, bad) in enumerate(bad_cases):
        server.submit(make_sample(i))
        with pytest.raises(exc):
            server.submit(bad)
    sample = server.sample(timeout=10)
    assert sample is not None
    assert batch_ids(sample.batch) == [0, 1, 2, 3]
    assert sample.info.store_size == 0


def test_a_missing_key_whose_example_value_is_none_is_a_structure_error() -> None:
    server = echo.Server({"a": np.zeros(2), "b": None}, batch_size=1)
    try:
        with pytest.raises(ValueError, match="structure"):
            server.submit({"a": np.zeros(2)})
        server.submit({"a": np.ones(2), "b": None})
        got = server.sample(timeout=5)
        assert got is not None
        assert got.batch["b"] is None
        np.testing.assert_array_equal(got.batch["a"], np.ones((1, 2)))
    finally:
        server.close()
