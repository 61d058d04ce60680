"""What goes in comes out: pytree structure, dtypes, shapes and bytes survive the ring, and
batch leaves are read-only, C-contiguous views that own a reference to the ring."""

from __future__ import annotations

from typing import Any, NamedTuple

import hypothesis.extra.numpy as hnp
import numpy as np
import optree
import pytest
from hypothesis import given
from hypothesis import strategies as st

import echo

COMMON_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
]


class Point(NamedTuple):
    x: np.ndarray
    y: np.ndarray


def _assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    # Bytes, not values: NaN payloads, -0.0 and every bit pattern must survive.
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _stacked(samples: list[Any]) -> Any:
    """The batch a list of samples must produce: every leaf stacked along a new axis 0."""
    # `astype`: np.stack returns native byte order; a batch keeps the example's dtype.
    return optree.tree_map(
        lambda *leaves: np.stack(leaves).astype(leaves[0].dtype), *samples, none_is_leaf=False
    )


def _submit_and_sample(server: echo.Server, samples: list[Any], copy: bool = False) -> Any:
    for s in samples:
        server.submit(s)
    got = server.sample(timeout=10, copy=copy)
    assert got is not None
    return got.batch


def _assert_tree_bit_exact(got: Any, want: Any) -> None:
    assert optree.tree_structure(got, none_is_leaf=False) == optree.tree_structure(
        want, none_is_leaf=False
    )
    for g, w in zip(
        optree.tree_leaves(got, none_is_leaf=False),
        optree.tree_leaves(want, none_is_leaf=False),
        strict=True,
    ):
        assert isinstance(g, np.ndarray)
        _assert_bit_exact(g, w)


# --- structure -------------------------------------------------------------------------------


def test_nested_pytree_with_none_nodes_round_trips(make_server: Any) -> None:
    def make(i: int) -> Any:
        return {
            "agent": {
                "obs": np.full((2, 3), i, np.float32),
                "extras": (np.array(i, np.int16), [np.full((1,), -i, np.int64), None]),
            },
            "point": Point(x=np.array(i * 0.5, np.float64), y=np.full((4,), i, np.uint8)),
            "list": [np.array(i % 2 == 0), Point(np.full((2,), i, np.int8), np.array(i, np.int32))],
            "none": None,
        }

    server = make_server(ex=make(0), batch_size=3)
    samples = [make(i) for i in range(1, 4)]
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))
    # The containers are the example's own types.
    assert type(batch) is dict
    assert type(batch["agent"]["extras"]) is tuple
    assert type(batch["agent"]["extras"][1]) is list
    assert batch["agent"]["extras"][1][1] is None
    assert type(batch["point"]) is Point
    assert type(batch["list"][1]) is Point
    assert batch["none"] is None
    assert batch["point"].x.shape == (3,)
    assert batch["agent"]["obs"].shape == (3, 2, 3)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda i: np.full((2,), i, np.float32), id="bare-array"),
        pytest.param(lambda i: (np.full((2,), i, np.float32),), id="one-tuple"),
        pytest.param(lambda i: [np.array(i, np.int64), np.full((2,), i, np.uint8)], id="list"),
        pytest.param(lambda i: Point(np.array(i), np.array(-i)), id="namedtuple"),
        pytest.param(lambda i: {"b": np.array(i), "a": {"z": np.array(2 * i)}}, id="dict"),
    ],
)
def test_root_container_kinds_round_trip(make_server: Any, make: Any) -> None:
    server = make_server(ex=make(0), batch_size=2)
    samples = [make(7), make(9)]
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))
    assert type(batch) is type(samples[0])


def test_dict_key_order_of_a_sample_does_not_matter(make_server: Any) -> None:
    server = make_server(ex={"b": np.zeros(2, np.int32), "a": np.zeros((), np.int64)}, batch_size=2)
    server.submit({"a": np.array(1, np.int64), "b": np.array([2, 3], np.int32)})
    server.submit({"b": np.array([5, 6], np.int32), "a": np.array(4, np.int64)})
    sample = server.sample(timeout=10)
    assert sample is not None
    np.testing.assert_array_equal(sample.batch["a"], [1, 4])
    np.testing.assert_array_equal(sample.batch["b"], [[2, 3], [5, 6]])


def test_zero_dimensional_leaves_give_batch_shape_batch_size(make_server: Any) -> None:
    example = {"r": np.zeros((), np.float32), "done": np.zeros((), np.bool_)}
    server = make_server(ex=example, batch_size=5)
    samples = [{"r": np.array(i / 4, np.float32), "done": np.array(i == 3)} for i in range(5)]
    batch = _submit_and_sample(server, samples)
    assert batch["r"].shape == (5,)
    assert batch["done"].shape == (5,)
    np.testing.assert_array_equal(batch["r"], np.arange(5, dtype=np.float32) / 4)
    np.testing.assert_array_equal(batch["done"], [False, False, False, True, False])


def test_empty_leaf_next_to_a_non_empty_one_round_trips(make_server: Any) -> None:
    example = {"empty": np.zeros((0, 3), np.float64), "x": np.zeros((2,), np.int16)}
    server = make_server(ex=example, batch_size=3)
    samples = [{"empty": np.zeros((0, 3)), "x": np.array([i, -i], np.int16)} for i in range(3)]
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))
    assert batch["empty"].shape == (3, 0, 3)
    assert not batch["empty"].flags.writeable
    assert not batch["x"].flags.writeable


# --- dtypes ----------------------------------------------------------------------------------


def _random_values(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    # Arbitrary bit patterns (NaN payloads, infinities, subnormals, extremes included).
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", COMMON_DTYPES, ids=lambda d: np.dtype(d).name)
def test_common_dtypes_round_trip_bit_exactly(make_server: Any, dtype: Any) -> None:
    rng = np.random.default_rng(1234)
    example = {"scalar": np.zeros((), dtype), "matrix": np.zeros((2, 3), dtype)}
    server = make_server(ex=example, batch_size=4)
    for round_ in range(3):  # several laps of the 3-batch ring
        samples = [
            {"scalar": _random_values(rng, dtype, ()), "matrix": _random_values(rng, dtype, (2, 3))}
            for _ in range(4)
        ]
        batch = _submit_and_sample(server, samples)
        _assert_tree_bit_exact(batch, _stacked(samples))
        assert batch["matrix"].dtype == np.dtype(dtype), round_


def test_all_dtypes_in_one_sample_round_trip_bit_exactly(make_server: Any) -> None:
    rng = np.random.default_rng(99)
    example = {np.dtype(d).name: np.zeros((3,), d) for d in COMMON_DTYPES}
    server = make_server(ex=example, batch_size=3)
    samples = [
        {np.dtype(d).name: _random_values(rng, d, (3,)) for d in COMMON_DTYPES} for _ in range(3)
    ]
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(">i4"),
        np.dtype(">f8"),
        np.dtype("S5"),
        np.dtype("U3"),
        np.dtype("datetime64[ns]"),
        np.dtype([("a", np.float32), ("b", np.int8, (2,))]),
    ],
    ids=str,
)
def test_other_fixed_size_dtypes_round_trip(make_server: Any, dtype: np.dtype[Any]) -> None:
    rng = np.random.default_rng(5)
    server = make_server(ex={"x": np.zeros((2,), dtype)}, batch_size=2)
    samples = [
        {"x": rng.integers(0, 256, size=2 * dtype.itemsize, dtype=np.uint8).view(dtype)}
        for _ in range(2)
    ]
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))


# --- property tests --------------------------------------------------------------------------


@st.composite
def _layouts(draw: st.DrawFn) -> list[tuple[np.dtype[Any], tuple[int, ...]]]:
    leaves = draw(
        st.lists(
            st.tuples(
                st.sampled_from([np.dtype(d) for d in COMMON_DTYPES]),
                hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
            ),
            min_size=1,
            max_size=4,
        )
    )
    # At least one leaf must hold data.
    if all(int(np.prod(shape)) == 0 for _, shape in leaves):
        leaves.append((np.dtype(np.uint8), ()))
    return leaves


@given(layout=_layouts(), batch_size=st.integers(1, 4), copy=st.booleans(), data=st.data())
def test_property_arbitrary_values_and_shapes_round_trip_bit_exactly(
    layout: list[tuple[np.dtype[Any], tuple[int, ...]]],
    batch_size: int,
    copy: bool,
    data: st.DataObject,
) -> None:
    example = [np.zeros(shape, dtype) for dtype, shape in layout]
    server = echo.Server(example, batch_size=batch_size, num_buffers=2)
    try:
        for _ in range(2):
            samples = [
                [data.draw(hnp.arrays(dtype, shape)) for dtype, shape in layout]
                for _ in range(batch_size)
            ]
            batch = _submit_and_sample(server, samples, copy=copy)
            _assert_tree_bit_exact(batch, _stacked(samples))
    finally:
        server.close()


_LEAF = "LEAF"


def _trees() -> st.SearchStrategy[Any]:
    keys = st.text(alphabet="abcxyz", min_size=1, max_size=3)
    return st.recursive(
        st.just(_LEAF) | st.none(),
        lambda children: (
            st.lists(children, max_size=3)
            | st.lists(children, max_size=3).map(tuple)
            | st.tuples(children, children).map(lambda t: Point(*t))
            | st.dictionaries(keys, children, max_size=3)
        ),
        max_leaves=8,
    )


def _fill(tree: Any, value: int) -> tuple[Any, int]:
    """`tree` with each `_LEAF` replaced by a distinct small int16 array derived from `value`."""
    counter = 0

    def leaf(_: Any) -> np.ndarray:
        nonlocal counter
        counter += 1
        return np.array([value, counter], np.int16)

    filled = optree.tree_map(leaf, tree, none_is_leaf=False)
    return filled, counter


@given(tree=_trees(), batch_size=st.integers(1, 3))
def test_property_arbitrary_pytrees_round_trip_with_structure(tree: Any, batch_size: int) -> None:
    example, num_leaves = _fill(tree, 0)
    if num_leaves == 0:
        with pytest.raises(ValueError, match="no leaves"):
            echo.Server(example, batch_size=batch_size)
        return
    server = echo.Server(example, batch_size=batch_size)
    try:
        samples = [_fill(tree, i + 1)[0] for i in range(batch_size)]
        batch = _submit_and_sample(server, samples)
        _assert_tree_bit_exact(batch, _stacked(samples))
    finally:
        server.close()


# --- non-contiguous input --------------------------------------------------------------------


def test_non_contiguous_inputs_are_stored_correctly(make_server: Any) -> None:
    example = {
        "strided": np.zeros((5,), np.float64),
        "fortran": np.zeros((3, 4), np.float32),
        "transposed": np.zeros((4, 3), np.int32),
        "reversed": np.zeros((6,), np.int16),
        "column": np.zeros((3,), np.uint8),
        "unaligned": np.zeros((3,), np.float64),
        "readonly": np.zeros((2, 2), np.int64),
    }
    server = make_server(ex=example, batch_size=3)

    def make(i: int) -> dict[str, np.ndarray]:
        grid = np.arange(12, dtype=np.int32).reshape(3, 4) + 100 * i
        raw = np.zeros(3 * 8 + 1, np.uint8)
        unaligned = raw[1:].view(np.float64)
        unaligned[:] = [i, -i, 0.5 * i]
        readonly = np.full((2, 2), i, np.int64)
        readonly.flags.writeable = False
        return {
            "strided": (np.arange(10, dtype=np.float64) + i)[::2],
            "fortran": np.asfortranarray(grid.astype(np.float32)),
            "transposed": grid.T,
            "reversed": (np.arange(6, dtype=np.int16) * (i + 1))[::-1],
            "column": (np.arange(12, dtype=np.uint8).reshape(3, 4) + i)[:, 2],
            "unaligned": unaligned,
            "readonly": readonly,
        }

    samples = [make(i) for i in range(3)]
    for s in samples:
        assert not s["strided"].flags.c_contiguous
        assert not s["fortran"].flags.c_contiguous
        assert not s["transposed"].flags.c_contiguous
        assert not s["reversed"].flags.c_contiguous
        assert not s["column"].flags.c_contiguous
        assert not s["unaligned"].flags.aligned
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))
    np.testing.assert_array_equal(batch["transposed"][1], np.arange(12).reshape(3, 4).T + 100)


def test_large_non_contiguous_input_is_stored_correctly(make_server: Any) -> None:
    # Over 64 KiB per sample: the copy runs with the GIL released.
    example = {"big": np.zeros((200, 100), np.float64), "tag": np.zeros((), np.int64)}
    server = make_server(ex=example, batch_size=2)
    rng = np.random.default_rng(3)
    samples = [
        {"big": np.asfortranarray(rng.standard_normal((200, 100))), "tag": np.array(0, np.int64)},
        {"big": rng.standard_normal((100, 200)).T, "tag": np.array(1, np.int64)},
    ]
    batch = _submit_and_sample(server, samples)
    _assert_tree_bit_exact(batch, _stacked(samples))


def test_submit_copies_so_later_changes_to_the_input_do_not_leak(make_server: Any) -> None:
    server = make_server(ex={"x": np.zeros((3,), np.float32)}, batch_size=2)
    arr = np.array([1, 2, 3], np.float32)
    server.submit({"x": arr})
    arr[:] = -1
    server.submit({"x": arr})
    batch = _submit_and_sample(server, [])
    np.testing.assert_array_equal(batch["x"], [[1, 2, 3], [-1, -1, -1]])


# --- batch leaves ----------------------------------------------------------------------------


def test_batch_leaves_are_read_only_c_contiguous_views_with_a_base(make_server: Any) -> None:
    example = {"obs": np.zeros((2, 3), np.float32), "id": np.zeros((), np.int64)}
    server = make_server(ex=example, batch_size=4)
    samples = [{"obs": np.full((2, 3), i, np.float32), "id": np.array(i)} for i in range(4)]
    batch = _submit_and_sample(server, samples)
    for name, leaf in batch.items():
        assert isinstance(leaf, np.ndarray)
        assert leaf.shape == (4, *example[name].shape)
        assert leaf.dtype == example[name].dtype
        assert leaf.flags.c_contiguous
        assert not leaf.flags.writeable
        assert leaf.base is not None
        with pytest.raises(ValueError, match="read-only"):
            leaf[0] = 1
        with pytest.raises(ValueError, match="read-only"):
            leaf += 1
        # Nor can the flag be flipped back: nothing may write into the ring through a view.
        with pytest.raises(ValueError, match="WRITEABLE"):
            leaf.flags.writeable = True
    np.testing.assert_array_equal(batch["id"], [0, 1, 2, 3])


def test_sample_is_a_named_tuple_of_batch_and_info(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=1)
    server.submit(make_sample(3))
    got = server.sample(timeout=10)
    assert isinstance(got, echo.Sample)
    batch, info = got
    assert batch is got.batch
    assert info is got.info
    assert isinstance(info, echo.SampleInfo)
