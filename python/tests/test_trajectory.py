"""`TrajectoryAccumulator`: timescale rules, every error with its exception and message,
`build()`'s aliasing and fill checks, a built trajectory travelling as one sample, and what
`id-echo` 0.2.1 accepted (kept) or silently corrupted (refused)."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optree
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import echo
from echo import TrajectoryAccumulator

T = 4
OBS = 3


# The leaves of one step: their dtypes, in order.
STEP_DTYPES = {"obs": np.float32, "action": np.int64, "reward": np.float32, "done": np.bool_}


def rollout_example(horizon: int = T, obs: int = OBS) -> dict[str, Any]:
    """T steps of (obs, action, reward, done) plus one bootstrap observation."""
    step_shapes = {"obs": (obs,), "action": (), "reward": (), "done": ()}
    return {
        "steps": {
            name: np.zeros((horizon, *step_shapes[name]), dtype)
            for name, dtype in STEP_DTYPES.items()
        },
        "bootstrap": {"obs": np.zeros((1, obs), np.float32)},
    }


def step(t: int, obs: int = OBS) -> dict[str, Any]:
    """Step `t` of a rollout: every value encodes `t`."""
    return {
        "obs": np.full((obs,), t, np.float32),
        "action": np.int64(t),
        "reward": np.float32(t / 2),
        "done": np.bool_(t % 2),
    }


def fill(acc: TrajectoryAccumulator, offset: int = 0, horizon: int = T) -> None:
    for t in range(horizon):
        acc.add("steps", step(offset + t))
    acc.add("bootstrap", {"obs": np.full((OBS,), offset + horizon, np.float32)})


def expected_rollout(offset: int = 0, horizon: int = T) -> dict[str, Any]:
    steps = [step(offset + t) for t in range(horizon)]
    return {
        "steps": {key: np.stack([s[key] for s in steps]) for key in steps[0]},
        "bootstrap": {"obs": np.full((1, OBS), offset + horizon, np.float32)},
    }


def assert_tree_equal(actual: Any, expected: Any) -> None:
    assert optree.tree_structure(actual) == optree.tree_structure(expected)
    for got, want in zip(optree.tree_leaves(actual), optree.tree_leaves(expected), strict=True):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_is_exported() -> None:
    assert "TrajectoryAccumulator" in echo.__all__
    assert echo.TrajectoryAccumulator is TrajectoryAccumulator


# --- timescales --------------------------------------------------------------------------------


def test_timescale_kinds_capacities_and_counters() -> None:
    acc = TrajectoryAccumulator(
        {
            "steps": {"obs": np.zeros((5, 2), np.float32), "r": np.zeros((5,), np.float32)},
            "bootstrap": {"obs": np.zeros((1, 2), np.float32)},
            "meta": {"id": np.zeros((), np.int64), "vec": np.zeros((3,), np.float32)},
            "bare": np.zeros((7,), np.uint8),
        }
    )
    assert acc.timescales == ("steps", "bootstrap", "meta", "bare")
    assert [acc.capacity(n) for n in acc.timescales] == [5, 1, 1, 7]
    assert [acc.is_buffered(n) for n in acc.timescales] == [True, False, False, True]
    assert [acc.size(n) for n in acc.timescales] == [0, 0, 0, 0]
    assert not acc.ready
    acc.add("steps", {"obs": np.zeros((2,), np.float32), "r": np.float32(1)})
    acc.add("bare", np.uint8(3))
    assert acc.size("steps") == 1
    assert acc.size("bare") == 1
    assert repr(acc) == (
        "TrajectoryAccumulator('steps': 1/5, 'bootstrap': 0/1, 'meta': 0/1, 'bare': 1/7)"
    )


def test_buffered_item_is_one_slot_of_every_leaf() -> None:
    acc = TrajectoryAccumulator({"s": {"img": np.zeros((2, 3, 4), np.uint8)}})
    acc.add("s", {"img": np.ones((3, 4), np.uint8)})
    acc.add("s", {"img": np.full((1, 3, 4), 2, np.uint8)})  # a leading dim of 1 is optional
    np.testing.assert_array_equal(acc.build()["s"]["img"], [np.ones((3, 4)), np.full((3, 4), 2)])
    acc.add("s", {"img": np.ones((3, 4), np.uint8)})
    with pytest.raises(
        ValueError,
        match=r"add\('s'\): leaf \['s'\]\['img'\]: expected shape \(3, 4\) "
        r"\(one slot of the \(2, 3, 4\) leaf\), got \(2, 3, 4\)",
    ):
        acc.add("s", {"img": np.ones((2, 3, 4), np.uint8)})


@pytest.mark.parametrize("shape", [(4,), (1, 4)], ids=["without", "with"])
def test_leading_dim_1_takes_the_item_with_or_without_that_dim(shape: tuple[int, ...]) -> None:
    acc = TrajectoryAccumulator({"b": {"obs": np.zeros((1, 4), np.float32)}})
    assert acc.capacity("b") == 1
    assert not acc.is_buffered("b")
    acc.add("b", {"obs": np.arange(4, dtype=np.float32).reshape(shape)})
    built = acc.build()
    assert built["b"]["obs"].shape == (1, 4)
    np.testing.assert_array_equal(built["b"]["obs"], [[0, 1, 2, 3]])


@pytest.mark.parametrize("shape", [(2, 4), (4, 1), (2,), ()])
def test_leading_dim_1_refuses_other_shapes(shape: tuple[int, ...]) -> None:
    acc = TrajectoryAccumulator({"b": {"obs": np.zeros((1, 4), np.float32)}})
    with pytest.raises(
        ValueError,
        match=r"add\('b'\): leaf \['b'\]\['obs'\]: expected shape \(4,\) "
        rf"\(one slot of the \(1, 4\) leaf\), got {re.escape(str(shape))}$",
    ):
        acc.add("b", {"obs": np.ones(shape, np.float32)})


def test_a_0d_leaf_makes_the_item_the_whole_timescale() -> None:
    # The 0-d leaf leaves no slot axis: even the (1, 2) and (3,) leaves take their full shapes.
    example = {
        "meta": {
            "id": np.zeros((), np.int64),
            "one": np.zeros((1, 2), np.float32),
            "vec": np.zeros((3,), np.float32),
        }
    }
    acc = TrajectoryAccumulator(example)
    assert acc.capacity("meta") == 1
    item = {
        "id": np.int64(7),
        "one": np.ones((1, 2), np.float32),
        "vec": np.arange(3, dtype=np.float32),
    }
    with pytest.raises(
        ValueError,
        match=r"add\('meta'\): leaf \['meta'\]\['one'\]: expected shape \(1, 2\) \(the whole "
        r"leaf: a 0-d leaf makes 'meta' single-item\), got \(2, 2\)$",
    ):
        acc.add("meta", {**item, "one": np.ones((2, 2), np.float32)})
    with pytest.raises(
        ValueError, match=r"leaf \['meta'\]\['id'\]: expected shape \(\), got \(2,\)$"
    ):
        acc.add("meta", {**item, "id": np.zeros((2,), np.int64)})
    acc.add("meta", item)
    assert_tree_equal(acc.build(), {"meta": item})
    # Leading dims of 1 are optional here too: (2,) fills the (1, 2) leaf, (1,) the 0-d one.
    acc.add("meta", {**item, "id": np.full((1,), 7, np.int64), "one": np.ones((2,), np.float32)})
    assert_tree_equal(acc.build(), {"meta": item})


@pytest.mark.parametrize(
    ("leaf", "item"),
    [
        pytest.param(np.zeros((1, 2), np.float32), np.ones(2, np.float32), id="leading-dim-1"),
        pytest.param(np.zeros((), np.float32), np.float32(1), id="0-d"),
    ],
)
def test_a_second_add_to_a_single_item_timescale_is_an_index_error(
    leaf: np.ndarray, item: Any
) -> None:
    acc = TrajectoryAccumulator({"b": {"x": leaf}})
    acc.add("b", {"x": item})
    with pytest.raises(
        IndexError,
        match=r"add\('b'\): timescale 'b' is full \(1 of 1 slots\): call build\(\) or reset",
    ):
        acc.add("b", {"x": item * 2})
    assert acc.size("b") == 1
    np.testing.assert_array_equal(acc.build()["b"]["x"], np.ones_like(leaf))  # the first item
    for _ in range(2):  # one add() again after build() and after reset()
        acc.add("b", {"x": item * 3})
        acc.reset()
    acc.add("b", {"x": item * 3})
    np.testing.assert_array_equal(acc.build()["b"]["x"], np.full_like(leaf, 3))


def test_timescales_keep_their_own_lengths() -> None:
    acc = TrajectoryAccumulator(
        {"fast": np.zeros((6,), np.int32), "slow": np.zeros((2,), np.int32)}
    )
    for i in range(6):
        acc.add("fast", np.int32(i))
    for i in range(2):
        acc.add("slow", np.int32(10 + i))
    built = acc.build()
    np.testing.assert_array_equal(built["fast"], np.arange(6))
    np.testing.assert_array_equal(built["slow"], [10, 11])


class Transition(NamedTuple):
    obs: np.ndarray
    extras: tuple[Any, list[Any]]


def test_nested_pytrees_keep_their_structure() -> None:
    example = collections.OrderedDict(
        [
            (
                "steps",
                Transition(
                    obs=np.zeros((3, 2), np.float32),
                    extras=(np.zeros((3,), np.int8), [np.zeros((3, 1), np.float64)]),
                ),
            ),
            ("none_is_empty", {"x": np.zeros((1,), np.int16), "skip": None}),
        ]
    )
    acc = TrajectoryAccumulator(example)
    for t in range(3):
        acc.add(
            "steps",
            Transition(
                obs=np.full((2,), t, np.float32),
                extras=(np.int8(-t), [np.full((1,), t * 10, np.float64)]),
            ),
        )
    with pytest.raises(ValueError, match=r"expected PyTreeSpec\(\{'skip': None, 'x': \*\}\)"):
        acc.add("none_is_empty", {"x": np.int16(5)})
    acc.add("none_is_empty", {"x": np.int16(5), "skip": None})
    built = acc.build()
    assert type(built) is collections.OrderedDict
    assert isinstance(built["steps"], Transition)
    assert optree.tree_structure(built) == optree.tree_structure(example)
    np.testing.assert_array_equal(built["steps"].obs, [[0, 0], [1, 1], [2, 2]])
    np.testing.assert_array_equal(built["steps"].extras[0], [0, -1, -2])
    np.testing.assert_array_equal(built["steps"].extras[1][0], [[0], [10], [20]])
    np.testing.assert_array_equal(built["none_is_empty"]["x"], [5])


def test_items_may_be_numpy_scalars_0d_arrays_or_non_contiguous() -> None:
    acc = TrajectoryAccumulator({"s": {"x": np.zeros((3, 2), np.float32), "r": np.zeros((3,))}})
    strided = np.arange(8, dtype=np.float32)[::4]  # (2,), not contiguous
    assert not strided.flags.c_contiguous
    acc.add("s", {"x": strided, "r": np.float64(1.5)})
    acc.add("s", {"x": np.zeros((2,), np.float32), "r": np.array(2.5)})
    acc.add("s", {"x": np.ones((2,), np.dtype("<f4")), "r": np.array(3.5, np.dtype("=f8"))})
    built = acc.build()
    np.testing.assert_array_equal(built["s"]["x"], [[0, 4], [0, 0], [1, 1]])
    np.testing.assert_array_equal(built["s"]["r"], [1.5, 2.5, 3.5])


# --- add(): errors --------------------------------------------------------------------------------


def test_add_to_an_unknown_timescale_is_a_key_error() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    with pytest.raises(KeyError, match=r"unknown timescale 'step': the example has 'steps', "):
        acc.add("step", step(0))
    for query in (acc.capacity, acc.size, acc.is_buffered):
        with pytest.raises(KeyError, match="unknown timescale 'nope'"):
            query("nope")


def test_add_to_a_full_buffered_timescale_is_an_index_error() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    fill(acc)
    with pytest.raises(
        IndexError,
        match=r"add\('steps'\): timescale 'steps' is full \(4 of 4 slots\): "
        r"call build\(\) or reset\(\) first",
    ):
        acc.add("steps", step(99))
    assert acc.size("steps") == T
    assert_tree_equal(acc.build(), expected_rollout())  # the rejected step wrote nothing


@pytest.mark.parametrize(
    ("item", "got"),
    [
        pytest.param({"obs": np.zeros(OBS, np.float32)}, r"\{'obs': \*\}", id="missing-key"),
        pytest.param({**step(0), "extra": np.zeros(1)}, r"'extra': \*", id="extra-key"),
        pytest.param(tuple(step(0).values()), r"PyTreeSpec\(\(\*, \*, \*, \*\)\)", id="tuple"),
        pytest.param(None, r"PyTreeSpec\(None\)", id="none-item"),
        pytest.param(np.zeros(4), r"PyTreeSpec\(\*\)", id="array-item"),
    ],
)
def test_add_with_another_structure_is_a_value_error(item: Any, got: str) -> None:
    acc = TrajectoryAccumulator(rollout_example())
    with pytest.raises(
        ValueError,
        match=r"add\('steps'\): item structure does not match timescale 'steps': "
        rf"expected PyTreeSpec\(\{{.*\}}\), got .*{got}",
    ):
        acc.add("steps", item)
    assert acc.size("steps") == 0


def _wrong_leaf(leaf: str, value: Any, error: type, expected: str, name: str) -> Any:
    return pytest.param(leaf, value, error, expected, id=name)


@pytest.mark.parametrize(
    ("leaf", "value", "error", "expected"),
    [
        *(
            _wrong_leaf(
                "reward",
                value,
                TypeError,
                r"a numpy array \(or a scalar or list numpy turns into one\) of dtype float32, "
                f"got {got}",
                name,
            )
            for value, got, name in [
                (object(), "object", "object"),
                (None, "NoneType", "none"),
                ({"x": np.float32(0)}, "dict", "dict"),
                (np.array(1.5, object), "ndarray", "object-array"),
            ]
        ),
        *(
            _wrong_leaf(
                leaf,
                value,
                TypeError,
                rf"dtype {want}, or one that numpy casts to it within its kind \('same_kind'\), "
                rf"got {got}; convert it first \(\.astype\)",
                name,
            )
            for leaf, value, want, got, name in [
                ("action", np.float32(1.0), "int64", "float32", "float-to-int"),
                ("action", 1.0, "int64", "float64", "python-float-to-int"),
                ("done", np.float32(1.0), "bool", "float32", "float-to-bool"),
                ("reward", np.complex64(1), "float32", "complex64", "complex-to-float"),
                ("reward", "1.5", "float32", "<U3", "str"),
            ]
        ),
        _wrong_leaf(
            "reward",
            [[1.0], [2.0, 3.0]],
            TypeError,
            r"a numpy array, or a value numpy turns into one, got list \(.*\)",
            "ragged-list",
        ),
        *(
            _wrong_leaf(leaf, value, OverflowError, rf"{want}, got {got}", name)
            for leaf, value, want, got, name in [
                ("done", np.int64(2), r"values that fit dtype bool \(0 to 1\)", "2", "int-to-bool"),
                ("action", 2**64, "a value that fits dtype int64", "18446744073709551616", "int"),
                (
                    "action",
                    np.uint64(2**63),
                    r"values that fit dtype int64 \(-9223372036854775808 to 9223372036854775807\)",
                    "9223372036854775808",
                    "uint64",
                ),
            ]
        ),
        *(
            _wrong_leaf(
                "obs",
                value,
                ValueError,
                rf"shape \(3,\) \(one slot of the \(4, 3\) leaf\), got {got}",
                name,
            )
            for value, got, name in [
                (np.zeros((OBS + 1,), np.float32), r"\(4,\)", "longer"),
                (np.zeros((2, OBS), np.float32), r"\(2, 3\)", "extra-dim"),
                (np.zeros((T, OBS), np.float32), r"\(4, 3\)", "whole-leaf"),
                (np.float32(0), r"\(\)", "scalar-not-broadcast"),
                (np.zeros((1,), np.float32), r"\(1,\)", "length-1-not-broadcast"),
                ([1.0, 2.0], r"\(2,\)", "list"),
            ]
        ),
    ],
)
def test_add_with_a_wrong_leaf_names_the_leaf_and_what_it_expected(
    leaf: str, value: Any, error: type, expected: str
) -> None:
    acc = TrajectoryAccumulator(rollout_example())
    with pytest.raises(
        error, match=rf"add\('steps'\): leaf \['steps'\]\['{leaf}'\]: expected {expected}$"
    ):
        acc.add("steps", {**step(0), leaf: value})
    assert acc.size("steps") == 0


def test_out_of_range_integers_name_the_range() -> None:
    acc = TrajectoryAccumulator({"a": np.zeros((2, 3), np.uint8)})
    with pytest.raises(
        OverflowError,
        match=r"add\('a'\): leaf \['a'\]: expected values that fit dtype uint8 \(0 to 255\), "
        r"got values from -1 to 300$",
    ):
        acc.add("a", np.array([1, 300, -1]))


def test_a_rejected_add_writes_nothing() -> None:
    acc = TrajectoryAccumulator(
        {"s": {"a": np.zeros((2,), np.int64), "z": np.zeros((2,), np.int64)}, "one": np.zeros(())}
    )
    acc.add("s", {"a": np.int64(1), "z": np.int64(1)})
    # 'a' (first in leaf order) is fine, 'z' is not: not even 'a' may be written.
    with pytest.raises(TypeError, match=r"\['s'\]\['z'\]: expected dtype int64"):
        acc.add("s", {"a": np.int64(99), "z": np.float64(99)})
    with pytest.raises(
        OverflowError,
        match=r"\['s'\]\['z'\]: expected values that fit dtype int64 .*, got 9223372036854775808",
    ):
        acc.add("s", {"a": np.int64(99), "z": np.uint64(2**63)})
    with pytest.raises(ValueError, match=r"\['s'\]\['z'\]: expected shape \(\)"):
        acc.add("s", {"a": np.int64(99), "z": np.zeros(2, np.int64)})
    with pytest.raises(TypeError, match=r"\['one'\]: expected dtype float64"):
        acc.add("one", np.complex128(99))
    acc.add("one", np.float64(1.0))
    assert acc.size("s") == 1
    acc.add("s", {"a": np.int64(2), "z": np.int64(2)})
    built = acc.build()
    np.testing.assert_array_equal(built["s"]["a"], [1, 2])
    np.testing.assert_array_equal(built["s"]["z"], [1, 2])
    assert built["one"] == 1.0


# --- the example: errors ----------------------------------------------------------------------


class NotRegistered(dict):  # type: ignore[type-arg]
    """A dict subclass optree does not know: it flattens as a leaf."""


@pytest.mark.parametrize(
    ("example", "type_name"),
    [
        pytest.param([np.zeros((2,))], "list", id="list"),
        pytest.param((np.zeros((2,)),), "tuple", id="tuple"),
        pytest.param(np.zeros((2, 3)), "ndarray", id="ndarray"),
        pytest.param(None, "NoneType", id="none"),
        pytest.param(Transition(np.zeros(2), (np.zeros(2), [])), "Transition", id="namedtuple"),
    ],
)
def test_non_dict_example_is_a_type_error(example: Any, type_name: str) -> None:
    with pytest.raises(
        TypeError,
        match=r"example must be a dict of timescales \(name -> pytree of numpy arrays\), "
        rf"got {type_name}$",
    ):
        TrajectoryAccumulator(example)


def test_dict_subclass_optree_cannot_flatten_is_a_type_error() -> None:
    with pytest.raises(
        TypeError, match="example must be a dict of timescales that optree flattens as a dict"
    ):
        TrajectoryAccumulator(NotRegistered(a=np.zeros((2,))))


def test_example_without_timescales_builds_an_empty_dict() -> None:
    acc = TrajectoryAccumulator({})
    assert acc.timescales == ()
    assert acc.ready
    assert acc.build() == {}
    with pytest.raises(KeyError, match="unknown timescale 's': the example has no timescales"):
        acc.add("s", np.zeros(()))


@pytest.mark.parametrize(
    "empty",
    [
        pytest.param({}, id="dict"),
        pytest.param(None, id="none"),
        pytest.param((), id="tuple"),
        pytest.param({"x": [], "y": {"z": None}}, id="nested-empty"),
    ],
)
def test_empty_timescale_is_a_value_error(empty: Any) -> None:
    with pytest.raises(
        ValueError, match="timescale 'b' has no leaves: it needs at least one numpy array"
    ):
        TrajectoryAccumulator({"a": np.zeros((2,)), "b": empty})


@pytest.mark.parametrize(
    ("timescale", "dims"),
    [
        pytest.param(
            {"x": np.zeros((3, 2)), "y": np.zeros((4,))}, r"\['a'\]\['x'\]: 3, \['a'\]\['y'\]: 4"
        ),
        pytest.param(
            {"x": np.zeros((1, 2)), "y": np.zeros((4,))}, r"\['a'\]\['x'\]: 1, \['a'\]\['y'\]: 4"
        ),
        pytest.param(
            (np.zeros((2,)), np.zeros((5, 5))), r"\['a'\]\[0\]: 2, \['a'\]\[1\]: 5", id="tuple"
        ),
    ],
)
def test_unequal_leading_dims_are_a_value_error(timescale: Any, dims: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"timescale 'a': every leaf of a buffered timescale needs the same leading dim "
        rf"\(its number of slots\), got {dims}; for a single item, give every leaf a leading "
        "dim of 1",
    ):
        TrajectoryAccumulator({"a": timescale})


def test_unequal_leading_dims_next_to_a_0d_leaf_are_one_item() -> None:
    acc = TrajectoryAccumulator(
        {"a": {"x": np.zeros((3, 2)), "y": np.zeros((4,)), "n": np.zeros(())}}
    )
    assert acc.capacity("a") == 1


def test_leading_dim_0_is_a_timescale_without_slots() -> None:
    acc = TrajectoryAccumulator(
        {"a": {"x": np.zeros((0, 3)), "y": np.zeros((0,))}, "b": np.zeros((2,))}
    )
    assert acc.capacity("a") == 0
    assert acc.is_buffered("a")
    with pytest.raises(IndexError, match=r"timescale 'a' is full \(0 of 0 slots\)"):
        acc.add("a", {"x": np.zeros(3), "y": np.float64(0)})
    acc.add("b", np.float64(1))
    acc.add("b", np.float64(2))
    built = acc.build()
    assert built["a"]["x"].shape == (0, 3)
    assert built["a"]["y"].shape == (0,)
    np.testing.assert_array_equal(built["b"], [1, 2])


@pytest.mark.parametrize(
    ("leaf", "type_name"),
    [
        pytest.param(1.0, "float", id="float"),
        pytest.param(1, "int", id="int"),
        pytest.param("s", "str", id="str"),
    ],
)
def test_example_with_a_non_array_leaf_is_a_type_error(leaf: Any, type_name: str) -> None:
    with pytest.raises(
        TypeError,
        match=rf"example leaf \['a'\]\['x'\]: expected a numpy\.ndarray or numpy scalar, "
        rf"got {type_name}$",
    ):
        TrajectoryAccumulator({"a": {"x": leaf}})


def test_a_numpy_scalar_in_the_example_is_a_0d_leaf() -> None:
    acc = TrajectoryAccumulator({"a": {"x": np.float32(5)}})
    assert acc.capacity("a") == 1
    acc.add("a", {"x": np.float32(3)})
    built = acc.build()
    assert isinstance(built["a"]["x"], np.ndarray)
    assert_tree_equal(built, {"a": {"x": np.array(3, np.float32)}})


def test_an_object_dtype_leaf_holds_any_object() -> None:
    # Server and TcpClient refuse object dtypes, but the accumulator is not theirs to police.
    acc = TrajectoryAccumulator({"a": np.zeros((2,), object)})
    acc.add("a", "text")
    acc.add("a", {"k": 1})
    assert acc.build()["a"].tolist() == ["text", {"k": 1}]


# --- build() and reset() ----------------------------------------------------------------------


def test_build_returns_the_rollout_and_resets() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    fill(acc)
    assert acc.ready
    built = acc.build()
    assert_tree_equal(built, expected_rollout())
    assert [acc.size(n) for n in acc.timescales] == [0, 0]
    assert not acc.ready
    with pytest.raises(ValueError, match="not every timescale is full"):
        acc.build()  # not the same trajectory twice


def test_build_of_a_partial_trajectory_is_a_value_error() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    for t in range(T - 1):
        acc.add("steps", step(t))
    with pytest.raises(
        ValueError,
        match=r"build\(\): not every timescale is full: 'steps' has 3 of 4 slots filled, "
        r"'bootstrap' has 0 of 1 slots filled; add\(\) the missing items or reset\(\) to drop "
        "this trajectory",
    ):
        acc.build()
    # Nothing was reset: finish the trajectory and build it.
    assert acc.size("steps") == T - 1
    acc.add("steps", step(T - 1))
    with pytest.raises(ValueError, match=r"full: 'bootstrap' has 0 of 1 slots filled;"):
        acc.build()
    acc.add("bootstrap", {"obs": np.full((OBS,), T, np.float32)})
    assert_tree_equal(acc.build(), expected_rollout())


def test_build_of_nothing_is_a_value_error() -> None:
    acc = TrajectoryAccumulator({"one": np.zeros((1,))})
    with pytest.raises(ValueError, match=r"'one' has 0 of 1 slots filled"):
        acc.build()


def test_reset_drops_the_trajectory() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    for t in range(2):
        acc.add("steps", step(100 + t))
    acc.add("bootstrap", {"obs": np.zeros((OBS,), np.float32)})
    acc.reset()
    assert [acc.size(n) for n in acc.timescales] == [0, 0]
    with pytest.raises(ValueError, match="'steps' has 0 of 4"):
        acc.build()
    fill(acc, offset=10)  # starts again at slot 0
    assert_tree_equal(acc.build(), expected_rollout(offset=10))
    acc.reset()  # idempotent, also when empty
    acc.reset()


def test_build_aliases_the_buffers_until_the_next_add() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    fill(acc, offset=0)
    first = acc.build()
    kept = optree.tree_map(np.copy, first)
    for leaf in optree.tree_leaves(first):
        assert leaf.base is not None  # a view of an internal buffer, not a copy

    acc.add("steps", step(50))  # overwrites slot 0, visible through `first`
    np.testing.assert_array_equal(first["steps"]["obs"][0], step(50)["obs"])
    assert first["steps"]["action"][0] == 50
    np.testing.assert_array_equal(first["steps"]["obs"][1:], kept["steps"]["obs"][1:])
    assert_tree_equal(kept, expected_rollout(offset=0))  # copies stay

    for t in range(1, T):
        acc.add("steps", step(50 + t))
    acc.add("bootstrap", {"obs": np.full((OBS,), 50 + T, np.float32)})
    second = acc.build()
    # The same buffers every time: nothing is allocated per trajectory.
    for a, b in zip(optree.tree_leaves(first), optree.tree_leaves(second), strict=True):
        assert a.__array_interface__["data"] == b.__array_interface__["data"]
    assert_tree_equal(first, expected_rollout(offset=50))


def test_built_leaves_are_writable_and_writes_do_not_reach_the_next_trajectory() -> None:
    acc = TrajectoryAccumulator(rollout_example())
    fill(acc)
    first = acc.build()
    first["steps"]["reward"] *= 10  # e.g. scaling rewards in place before sending
    first["bootstrap"]["obs"][...] = -1
    np.testing.assert_array_equal(first["steps"]["reward"], [0, 5, 10, 15])
    fill(acc, offset=20)
    second = acc.build()
    assert second is not first  # a new tree each time, over the same buffers
    assert_tree_equal(second, expected_rollout(offset=20))


def test_stale_slots_show_through_an_old_build_after_reset() -> None:
    acc = TrajectoryAccumulator({"s": np.zeros((3,), np.int64)})
    for i in range(3):
        acc.add("s", np.int64(i + 1))
    old = acc.build()
    acc.add("s", np.int64(7))
    acc.reset()  # reset() only empties: the buffers keep their values
    np.testing.assert_array_equal(old["s"], [7, 2, 3])
    with pytest.raises(ValueError, match="'s' has 0 of 3"):
        acc.build()  # and build() never hands them out as a new trajectory


@given(
    data=st.data(),
    horizon=st.integers(2, 12),
    obs_shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=4),
    dtype=st.sampled_from([np.float32, np.float64, np.int16, np.uint8]),
    rollouts=st.integers(1, 3),
)
def test_rollouts_with_bootstrap_round_trip_exactly(
    data: st.DataObject,
    horizon: int,
    obs_shape: tuple[int, ...],
    dtype: type[np.generic],
    rollouts: int,
) -> None:
    example = {
        "steps": {
            "obs": np.zeros((horizon, *obs_shape), dtype),
            "action": np.zeros((horizon, 2), np.int32),
            "reward": np.zeros((horizon,), np.float32),
            "done": np.zeros((horizon,), np.bool_),
        },
        "bootstrap": {"obs": np.zeros((1, *obs_shape), dtype)},
    }
    acc = TrajectoryAccumulator(example)
    floats = {"allow_nan": False, "width": 32}
    for _ in range(rollouts):
        steps = [
            {
                "obs": data.draw(hnp.arrays(dtype, obs_shape)),
                "action": data.draw(hnp.arrays(np.int32, (2,))),
                "reward": np.float32(data.draw(st.floats(**floats))),  # type: ignore[arg-type]
                "done": np.bool_(data.draw(st.booleans())),
            }
            for _ in range(horizon)
        ]
        bootstrap = data.draw(hnp.arrays(dtype, obs_shape))
        for item in steps:
            acc.add("steps", item)
        acc.add("bootstrap", {"obs": bootstrap})
        built = acc.build()
        expected = {
            "steps": {key: np.stack([s[key] for s in steps]) for key in steps[0]},
            "bootstrap": {"obs": bootstrap[None]},
        }
        assert_tree_equal(built, expected)


# --- id-echo 0.2.1: what it accepted, and what it silently corrupted -----------------------------
#
# The expected values are what `id-echo` 0.2.1 stored for the same calls (run side by side while
# writing these tests); docs/guides/trajectory.md tabulates the differences.

F32 = np.float32


def _ts(leaf: Any) -> dict[str, Any]:
    return {"s": {"x": leaf}}


@pytest.mark.parametrize(
    ("example", "items", "expected"),
    [
        # Shapes: an optional leading dim of 1 (several, even), as numpy assignment drops them.
        pytest.param(
            _ts(np.zeros((2, 2), F32)),
            [np.array([[1, 2]], F32), np.array([[[3, 4]]], F32)],
            np.array([[1, 2], [3, 4]], F32),
            id="buffered-(1,2)-and-(1,1,2)-items",
        ),
        pytest.param(
            _ts(np.zeros((3,), F32)),
            [F32(1), np.array(2, F32), np.array([3], F32)],
            np.array([1, 2, 3], F32),
            id="buffered-scalar-slots-take-()-and-(1,)",
        ),
        *(
            pytest.param(_ts(np.zeros((1,), F32)), [item], np.array([7], F32), id=f"(1,)-leaf-{n}")
            for item, n in [
                (np.array([7], F32), "(1,)"),
                (F32(7), "()"),
                (np.array([[7]], F32), "(1,1)"),
            ]
        ),
        *(
            pytest.param(
                _ts(np.zeros((1, 4), F32)),
                [np.arange(4, dtype=F32).reshape(shape)],
                np.arange(4, dtype=F32).reshape(1, 4),
                id=f"(1,4)-leaf-{shape}",
            )
            for shape in [(4,), (1, 4), (1, 1, 4)]
        ),
        pytest.param(_ts(np.zeros((), F32)), [np.array([2], F32)], np.array(2, F32), id="0-d-(1,)"),
        # Dtypes: numpy casts within a kind, and integers that fit.
        pytest.param(
            _ts(np.zeros((2,), F32)),
            [np.float64(1.5), np.array([2.25])],
            np.array([1.5, 2.25], F32),
            id="float64-to-float32",
        ),
        pytest.param(
            _ts(np.zeros((3,), F32)),
            [np.int64(3), np.int64(16777217), np.int32(-1)],
            np.array([3, 16777216, -1], F32),  # rounded to float32, as numpy does
            id="int-to-float32",
        ),
        pytest.param(
            _ts(np.zeros((2,), F32)),
            [np.bool_(True), np.array(False)],
            np.array([1, 0], F32),
            id="bool-to-float32",
        ),
        pytest.param(
            _ts(np.zeros((2,), np.float16)),
            [np.float64(1.5), np.float32(-2)],
            np.array([1.5, -2], np.float16),
            id="to-float16",
        ),
        pytest.param(
            _ts(np.zeros((4,), np.int64)),
            [np.bool_(True), np.uint8(200), np.int32(-5), np.uint64(7)],
            np.array([1, 200, -5, 7], np.int64),
            id="to-int64",
        ),
        pytest.param(
            _ts(np.zeros((3,), np.uint8)),
            [np.int64(5), 255, np.array([0], np.int16)],
            np.array([5, 255, 0], np.uint8),
            id="ints-that-fit-uint8",
        ),
        pytest.param(
            _ts(np.zeros((2,), np.bool_)),
            [np.int64(0), 1],
            np.array([False, True]),
            id="0-and-1-to-bool",
        ),
        pytest.param(
            _ts(np.zeros((), np.complex64)), [F32(1.5)], np.array(1.5, np.complex64), id="complex"
        ),
        pytest.param(
            _ts(np.zeros((), F32)), [np.array(1.5, ">f4")], np.array(1.5, F32), id="byte-order"
        ),
        # Python scalars and lists.
        pytest.param(
            _ts(np.zeros((3,), F32)), [1.5, 2, True], np.array([1.5, 2, 1], F32), id="python"
        ),
        pytest.param(
            _ts(np.zeros((2, 2), np.int32)),
            [[1, 2], (3, 4)],
            np.array([[1, 2], [3, 4]], np.int32),
            id="list-and-tuple-leaves",
        ),
        pytest.param(
            _ts(np.zeros((1, 4), F32)),
            [[1.0, 2.0, 3.0, 4.0]],
            np.array([[1, 2, 3, 4]], F32),
            id="list-for-(1,4)",
        ),
    ],
)
def test_what_0_2_1_accepted_is_accepted_with_its_result(
    example: dict[str, Any], items: list[Any], expected: np.ndarray
) -> None:
    acc = TrajectoryAccumulator(example)
    for item in items:
        acc.add("s", {"x": item})
    assert_tree_equal(acc.build(), {"s": {"x": expected}})


def test_0_2_1_shapes_in_a_timescale_with_a_0d_leaf() -> None:
    acc = TrajectoryAccumulator(
        {"s": {"n": np.zeros((), np.int64), "v": np.zeros((3,), F32), "o": np.zeros((1, 2), F32)}}
    )
    # (1,) for the 0-d leaf, (1, 3) for the (3,) leaf, (2,) for the (1, 2) leaf.
    acc.add("s", {"n": np.array([1]), "v": np.array([[1, 2, 3]], F32), "o": np.array([5, 6], F32)})
    expected = {
        "n": np.array(1, np.int64),
        "v": np.array([1, 2, 3], F32),
        "o": np.array([[5, 6]], F32),
    }
    assert_tree_equal(acc.build(), {"s": expected})


def test_0_2_1_mapping_items_need_only_the_keys() -> None:
    acc = TrajectoryAccumulator({"s": {"x": np.zeros((2,), F32), "y": np.zeros((2,), F32)}})
    acc.add("s", collections.OrderedDict(y=F32(1), x=F32(2)))
    acc.add("s", collections.defaultdict(float, x=F32(3), y=F32(4)))
    built = acc.build()
    np.testing.assert_array_equal(built["s"]["x"], [2, 3])
    np.testing.assert_array_equal(built["s"]["y"], [1, 4])


def test_0_2_1_float_overflow_warns_and_stores_inf() -> None:
    acc = TrajectoryAccumulator(_ts(np.zeros((), F32)))
    with pytest.warns(RuntimeWarning, match="overflow"):
        acc.add("s", {"x": np.float64(1e40)})
    assert acc.build()["s"]["x"] == np.inf


@pytest.mark.parametrize(
    ("leaf", "item", "error"),
    [
        # What 0.2.1 stored instead is in each comment.
        pytest.param(np.zeros((2, 2), F32), F32(5), ValueError, id="()-into-(2,)"),  # [5, 5]
        pytest.param(
            np.zeros((2, 2), F32), np.array([5], F32), ValueError, id="(1,)-into-(2,)"
        ),  # [5, 5]
        pytest.param(np.zeros((1, 4), F32), F32(3), ValueError, id="()-into-(1,4)"),  # [[3]*4]
        pytest.param(np.zeros((2,), np.int64), F32(1.7), TypeError, id="float-to-int"),  # 1
        pytest.param(np.zeros((2,), np.int64), -1.7, TypeError, id="python-float"),  # -1
        pytest.param(np.zeros((2,), np.bool_), F32(0.5), TypeError, id="float-to-bool"),  # True
        pytest.param(np.zeros((2,), np.bool_), np.int64(2), OverflowError, id="2-to-bool"),  # True
        pytest.param(np.zeros((2,), np.uint8), np.int64(300), OverflowError, id="300"),  # 44
        pytest.param(
            np.zeros((2,), np.uint8), np.int64(-1), OverflowError, id="-1-to-uint8"
        ),  # 255
        pytest.param(
            np.zeros((2,), np.uint64), np.int64(-1), OverflowError, id="-1-to-uint64"
        ),  # 2**64 - 1
        pytest.param(
            np.zeros((2, 2), np.int8), np.array([1000, 5]), OverflowError, id="1000-to-int8"
        ),  # [-24, 5]
        pytest.param(
            np.zeros((2,), F32), np.complex128(1 + 2j), TypeError, id="complex"
        ),  # 1, warned
        pytest.param(np.zeros((2,), F32), None, TypeError, id="none"),  # nan
        pytest.param(np.zeros((2,), F32), np.array(1.5, object), TypeError, id="object"),  # 1.5
        pytest.param(np.zeros((2,), F32), np.str_("1.5"), TypeError, id="text"),  # 1.5
        pytest.param(
            np.zeros((2,), "datetime64[s]"), np.int64(5), TypeError, id="int-to-datetime"
        ),  # 1970-01-01T00:00:05
    ],
)
def test_what_0_2_1_silently_changed_is_refused(leaf: np.ndarray, item: Any, error: type) -> None:
    acc = TrajectoryAccumulator(_ts(leaf))
    with pytest.raises(error, match=r"add\('s'\): leaf \['s'\]\['x'\]: "):
        acc.add("s", {"x": item})
    assert acc.size("s") == 0


# The scenarios of the original project's tests, on public behaviour only.
N = 4
UPSTREAM = {
    "transition": {"obs": np.empty((N, 12), F32), "rew": np.empty((N,), F32)},
    "summary": {"ret": np.empty((1,), F32)},
}


def fill_upstream(acc: TrajectoryAccumulator) -> None:
    for i in range(N):
        acc.add("transition", {"obs": np.full(12, float(i), F32), "rew": np.array(i * 10.0, F32)})
    acc.add("summary", {"ret": np.array([99.0], F32)})  # a (1,) item for the (1,) leaf


def test_upstream_fill_and_build() -> None:
    acc = TrajectoryAccumulator(UPSTREAM)
    fill_upstream(acc)
    built = acc.build()
    assert isinstance(built, dict)
    assert set(built) == {"transition", "summary"}
    for i in range(N):
        np.testing.assert_array_equal(built["transition"]["obs"][i], float(i))
        np.testing.assert_array_equal(built["transition"]["rew"][i], i * 10.0)
    np.testing.assert_array_equal(built["summary"]["ret"], [99.0])


def test_upstream_float64_items_are_cast() -> None:
    acc = TrajectoryAccumulator(UPSTREAM)
    for _ in range(N):
        acc.add("transition", {"obs": np.ones(12) * 1.5, "rew": np.zeros(())})
    acc.add("summary", {"ret": np.array([1.0])})
    built = acc.build()
    assert built["transition"]["obs"].dtype == F32
    np.testing.assert_allclose(built["transition"]["obs"], 1.5)


@pytest.mark.parametrize("clear", ["build", "reset"])
def test_upstream_build_and_reset_start_again_at_slot_0(clear: str) -> None:
    acc = TrajectoryAccumulator(UPSTREAM)
    if clear == "build":
        fill_upstream(acc)
        acc.build()
    else:
        acc.add("transition", {"obs": np.zeros(12, F32), "rew": np.zeros((), F32)})
        acc.reset()
    fill_upstream(acc)  # N slots free again
    with pytest.raises(IndexError):
        acc.add("transition", {"obs": np.zeros(12, F32), "rew": np.zeros((), F32)})


def test_upstream_round_trip_over_tcp() -> None:
    example = {
        "transition": {"obs": np.empty((2, 4), F32), "rew": np.empty((2,), F32)},
        "summary": {"ret": np.empty((1,), F32)},
    }
    trajectories = [
        (np.arange(8, dtype=F32).reshape(2, 4), np.array([0.5, 1.5], F32), np.array([42], F32)),
        (np.arange(8, 16, dtype=F32).reshape(2, 4), np.array([3, 4], F32), np.array([7], F32)),
    ]
    server = echo.Server(example, batch_size=1, transport=echo.TcpTransport(0, host="127.0.0.1"))
    try:
        server.start()
        assert server.port is not None
        acc = TrajectoryAccumulator(example)
        with echo.TcpClient("127.0.0.1", server.port, example, max_inflight_msgs=4) as client:
            for obs_rows, rews, ret in trajectories:
                for obs, rew in zip(obs_rows, rews, strict=True):
                    acc.add("transition", {"obs": obs, "rew": np.array(rew)})
                acc.add("summary", {"ret": ret})
                client.send(acc.build())
            client.wait(timeout=10)
        for obs_rows, rews, ret in trajectories:
            sample = server.sample(timeout=10)
            assert sample is not None
            np.testing.assert_array_equal(sample.batch["transition"]["obs"], [obs_rows])
            np.testing.assert_array_equal(sample.batch["transition"]["rew"], [rews])
            np.testing.assert_array_equal(sample.batch["summary"]["ret"], [ret])
    finally:
        server.close()


# --- one trajectory, one sample ------------------------------------------------------------------


def test_built_trajectories_are_samples_for_a_server(
    make_server: Callable[..., echo.Server],
) -> None:
    example = rollout_example()
    server = make_server(example, batch_size=2)
    acc = TrajectoryAccumulator(example)
    for offset in (0, 100):
        fill(acc, offset=offset)
        server.submit(acc.build())  # copies: the next add() may reuse the buffers
    sample = server.sample(timeout=10)
    assert sample is not None
    expected = optree.tree_map(
        lambda *leaves: np.stack(leaves), expected_rollout(0), expected_rollout(100)
    )
    assert_tree_equal(sample.batch, expected)
    assert sample.batch["steps"]["obs"].shape == (2, T, OBS)
    assert sample.batch["bootstrap"]["obs"].shape == (2, 1, OBS)


def test_trajectory_worker_example_runs() -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "trajectory_worker.py"
    args = ["--workers", "2", "--trajectories", "6", "--horizon", "5", "--batch-size", "4"]
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "received 12 trajectories" in result.stdout
