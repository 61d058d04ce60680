"""Numpy scalars as leaves of shape `()`: `np.float32(1.5)` is what indexing a column gives,
and what most rollout code passes for a reward or an action.

A scalar of exactly the leaf's numpy type (a number of native byte order) is read directly,
with no array made of it; every other scalar still goes through `numpy.asarray` and the
array checks. Either way the stored bytes are the scalar's, exactly, in `submit`,
`SampleWriter` and `TcpClient.send`, and a scalar of another dtype is the same `TypeError`
naming both dtypes.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from echo import Server, TcpClient, TcpTransport

WAIT_S = 10.0

# Each fixed-size number type numpy has, with values that use every byte (signs, extremes,
# fractions, NaN payloads, both halves of a complex).
VALUES: dict[Any, list[Any]] = {
    np.bool_: [True, False],
    np.int8: [-128, 127, -1],
    np.uint8: [0, 255],
    np.int16: [-32768, 12345],
    np.uint16: [65535, 1],
    np.int32: [-(2**31), 2**31 - 1],
    np.uint32: [2**32 - 1, 7],
    np.int64: [-(2**63), 2**63 - 1],
    np.uint64: [2**64 - 1, 2**40 + 3],
    np.float16: [-0.0, 65504.0, 1e-7],
    np.float32: [np.pi, -np.inf, np.float32(1) / 3],
    np.float64: [np.e, np.nextafter(0.0, 1.0), -1e300],
    np.longdouble: [np.longdouble(1) / 3, -2.5],
    np.complex64: [1.5 - 2.25j, complex(np.inf, -0.0)],
    np.complex128: [np.pi + np.e * 1j, -1j],
}


def _bits(value: Any, dtype: Any) -> bytes:
    return np.asarray(value, dtype=dtype).tobytes()


@pytest.mark.parametrize("scalar_type", list(VALUES), ids=lambda t: np.dtype(t).name)
def test_a_scalar_of_the_leafs_type_is_stored_bit_for_bit(scalar_type: Any) -> None:
    values = [scalar_type(v) for v in VALUES[scalar_type]]
    example = {"x": np.zeros((), scalar_type), "id": np.zeros((), np.int64)}
    server = Server(example, batch_size=len(values) * 2)
    writer = server.writer()
    for i, value in enumerate(values):
        assert type(value) is scalar_type
        server.submit({"x": value, "id": np.int64(i)})
    for i, value in enumerate(values):
        # SampleWriter takes the leaves in `leaf_names` order.
        leaves = {"['x']": value, "['id']": np.int64(100 + i)}
        writer(*(leaves[name] for name in server.leaf_names))
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    ids = [int(i) for i in got.batch["id"]]
    assert ids == [*range(len(values)), *range(100, 100 + len(values))]
    for row, value in enumerate(values * 2):
        if scalar_type is np.longdouble:
            # x86's 80-bit extended precision in 16 bytes: the last 6 are padding that
            # numpy itself leaves as it finds them.
            assert got.batch["x"][row] == value, (row, value)
        else:
            assert got.batch["x"][row].tobytes() == _bits(value, scalar_type), (row, value)
    server.close()


def test_scalars_of_another_dtype_are_type_errors_naming_both() -> None:
    server = Server({"x": np.zeros((), np.float32)}, batch_size=1)
    wrongs = [(np.float64(1.0), "float64"), (np.int32(1), "int32"), (np.bool_(1), "bool")]
    for wrong, name in wrongs:
        with pytest.raises(TypeError, match=rf"leaf \['x'\]: expected dtype float32, got {name}"):
            server.submit({"x": wrong})
    assert server.stats().samples_inserted_total == 0
    server.close()


def test_a_scalar_for_a_leaf_with_dimensions_is_a_shape_error() -> None:
    server = Server({"x": np.zeros((1,), np.float32)}, batch_size=1)
    with pytest.raises(ValueError, match=r"leaf \['x'\]: expected shape \(1,\), got \(\)"):
        server.submit({"x": np.float32(1.0)})
    server.close()


def test_a_non_native_leaf_takes_only_an_array_of_its_byte_order() -> None:
    swapped = ">f4" if sys.byteorder == "little" else "<f4"
    server = Server({"x": np.zeros((), swapped)}, batch_size=2)
    # A numpy scalar is always in native byte order: not this leaf's dtype.
    with pytest.raises(TypeError, match=rf"leaf \['x'\]: expected dtype {swapped}, got float32"):
        server.submit({"x": np.float32(1.5)})
    server.submit({"x": np.asarray(1.5, swapped)})
    server.submit({"x": np.asarray(-2.0, swapped)})
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert got.batch["x"].tolist() == [1.5, -2.0]
    server.close()


def test_scalars_of_an_equivalent_type_and_subclasses_go_through_numpy() -> None:
    """`np.longlong` is another type object than `np.int64` but the same dtype; a subclass of
    `np.float32` is not exactly its type: both are converted by numpy and checked as arrays."""

    class Reward(np.float32):
        pass

    server = Server({"a": np.zeros((), np.int64), "r": np.zeros((), np.float32)}, batch_size=2)
    server.submit({"a": np.longlong(-5), "r": Reward(0.25)})
    server.submit({"a": np.int64(6), "r": np.float32(0.5)})
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert got.batch["a"].tolist() == [-5, 6]
    assert got.batch["r"].tolist() == [0.25, 0.5]
    server.close()


def test_datetime_scalars_keep_their_unit_check() -> None:
    server = Server({"t": np.zeros((), "datetime64[s]")}, batch_size=1)
    with pytest.raises(TypeError, match=r"expected dtype datetime64\[s\], got datetime64\[ms\]"):
        server.submit({"t": np.datetime64(5, "ms")})
    server.submit({"t": np.datetime64(7, "s")})
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert got.batch["t"][()] == np.datetime64(7, "s")
    server.close()


def test_tcp_client_sends_numpy_scalars_bit_for_bit() -> None:
    example = {
        "r": np.zeros((), np.float64),
        "d": np.zeros((), np.bool_),
        "a": np.zeros((), np.uint16),
    }
    server = Server(example, batch_size=4, transport=TcpTransport(host="127.0.0.1", port=0))
    server.start()
    assert server.port is not None
    rows = [(np.float64(np.pi * k), np.bool_(k % 2), np.uint16(65535 - k)) for k in range(4)]
    client = TcpClient("127.0.0.1", server.port, example)
    try:
        for r, d, a in rows:
            client.send({"r": r, "d": d, "a": a})
        client.wait(WAIT_S)
    finally:
        client.close()
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert got.batch["r"].tobytes() == np.array([r for r, _, _ in rows]).tobytes()
    assert got.batch["d"].tolist() == [False, True, False, True]
    assert got.batch["a"].tolist() == [65535, 65534, 65533, 65532]
    server.close()
