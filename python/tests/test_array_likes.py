"""Array-likes as sample leaves: anything that shares its memory through `__dlpack__` (torch
and JAX CPU arrays), the array interface or the buffer protocol is read like a numpy leaf, in
`submit`, `submit_batch`, `TcpClient.send` and `send_batch`, with the same checks and messages;
a non-contiguous one is copied; lists and Python numbers stay a `TypeError`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from testkit.frameworks import needs_jax, needs_torch

from echo import Server, TcpClient, TcpTransport

EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
BATCH = 4
WAIT_S = 10.0


class DLPackOnly:
    """An array-like that offers nothing but DLPack (and counts the exports)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.exports = 0

    def __dlpack__(self, **kwargs: Any) -> object:
        self.exports += 1
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()


class InterfaceOnly:
    """An array-like that offers nothing but `__array_interface__`."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.__array_interface__ = array.__array_interface__


def obs_of(i: int) -> np.ndarray:
    return np.full(3, i, np.float32)


WRAPPERS = {
    "dlpack": DLPackOnly,
    "array-interface": InterfaceOnly,
    "memoryview": memoryview,
}


@pytest.fixture
def server() -> Iterator[Server]:
    server = Server(EXAMPLE, batch_size=BATCH)
    yield server
    server.close()


def ids_of(server: Server) -> list[int]:
    sample = server.sample(timeout=WAIT_S)
    assert sample is not None
    ids = sample.batch["id"]
    np.testing.assert_array_equal(sample.batch["obs"], np.repeat(ids[:, None], 3, axis=1))
    return [int(i) for i in ids]


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_submit_reads_an_array_like_leaf(server: Server, wrap: Any) -> None:
    for i in range(BATCH):
        server.submit({"id": wrap(np.asarray([i], np.int64).reshape(())), "obs": wrap(obs_of(i))})
    assert ids_of(server) == [0, 1, 2, 3]


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_submit_batch_reads_array_like_leaves(server: Server, wrap: Any) -> None:
    ids = np.arange(BATCH, dtype=np.int64)
    obs = np.repeat(ids[:, None], 3, axis=1).astype(np.float32)
    assert server.submit_batch({"id": wrap(ids), "obs": wrap(obs)}) == BATCH
    assert ids_of(server) == [0, 1, 2, 3]


def test_a_dlpack_leaf_is_exported_once_per_submit(server: Server) -> None:
    leaf = DLPackOnly(obs_of(0))
    server.submit({"id": np.asarray(0, np.int64), "obs": leaf})
    assert leaf.exports == 1


def test_a_non_contiguous_array_like_is_copied(server: Server) -> None:
    ids = np.arange(BATCH, dtype=np.int64)
    wide = np.repeat(ids[:, None], 6, axis=1).astype(np.float32)
    strided = DLPackOnly(wide[:, ::2])  # (4, 3), not C-contiguous
    assert server.submit_batch({"id": ids, "obs": strided}) == BATCH
    assert ids_of(server) == [0, 1, 2, 3]


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_an_array_like_gets_the_numpy_dtype_message(server: Server, wrap: Any) -> None:
    with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected dtype float32, got float64"):
        server.submit({"id": np.asarray(0, np.int64), "obs": wrap(np.zeros(3, np.float64))})
    with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected dtype float32, got float64"):
        server.submit_batch({"id": np.zeros(2, np.int64), "obs": wrap(np.zeros((2, 3)))})


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_an_array_like_gets_the_numpy_shape_message(server: Server, wrap: Any) -> None:
    with pytest.raises(ValueError, match=r"leaf \['obs'\]: expected shape \(3,\), got \(4,\)"):
        server.submit({"id": np.asarray(0, np.int64), "obs": wrap(np.zeros(4, np.float32))})
    with pytest.raises(
        ValueError, match=r"leaf \['obs'\]: expected shape \(N, 3\) with one row per sample"
    ):
        server.submit_batch(
            {"id": np.zeros(2, np.int64), "obs": wrap(np.zeros((2, 4), np.float32))}
        )


@pytest.mark.parametrize("leaf", [[1.0, 2.0, 3.0], 1.5, "abc", None, (1.0, 2.0, 3.0)], ids=repr)
def test_lists_and_python_scalars_stay_type_errors(server: Server, leaf: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        server.submit({"id": np.asarray(0, np.int64), "obs": leaf})
    assert server.stats().store_size == 0


@pytest.mark.parametrize("leaf", [1.5, "abc", b"abc"[0]], ids=repr)
def test_a_list_or_scalar_leaf_is_a_type_error_naming_ndarray(server: Server, leaf: object) -> None:
    with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected a numpy\.ndarray"):
        server.submit({"id": np.asarray(0, np.int64), "obs": leaf})


def test_an_array_like_numpy_cannot_read_is_a_type_error_with_the_cause(server: Server) -> None:
    class Broken:
        def __dlpack__(self, **kwargs: Any) -> object:
            raise BufferError("cannot export a GPU buffer")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    with pytest.raises(TypeError, match=r"leaf \['obs'\]: numpy could not read the Broken") as info:
        server.submit({"id": np.asarray(0, np.int64), "obs": Broken()})
    assert info.value.__cause__ is not None


def test_tcp_client_sends_array_like_leaves() -> None:
    server = Server(EXAMPLE, batch_size=BATCH, transport=TcpTransport(port=0, host="127.0.0.1"))
    server.start()
    assert server.port is not None
    client = TcpClient("127.0.0.1", server.port, EXAMPLE)
    try:
        client.send({"id": DLPackOnly(np.asarray(0, np.int64)), "obs": memoryview(obs_of(0))})
        ids = np.arange(1, BATCH, dtype=np.int64)
        obs = np.repeat(ids[:, None], 3, axis=1).astype(np.float32)
        assert client.send_batch({"id": InterfaceOnly(ids), "obs": DLPackOnly(obs)}) == 3
        client.wait(WAIT_S)
        assert ids_of(server) == [0, 1, 2, 3]
    finally:
        client.close()
        server.close()


@needs_jax
def test_jax_arrays_are_accepted_as_leaves(server: Server) -> None:
    import jax.numpy as jnp

    # (JAX arrays are 32-bit unless jax_enable_x64 is set: the int64 id stays numpy)
    for i in range(BATCH):
        server.submit({"id": np.asarray(i, np.int64), "obs": jnp.full(3, i, jnp.float32)})
    ids = np.arange(BATCH, dtype=np.int64)
    obs = jnp.asarray(np.repeat(ids[:, None], 3, axis=1), jnp.float32)
    server.submit_batch({"id": ids, "obs": obs})
    assert ids_of(server) == [0, 1, 2, 3]
    assert ids_of(server) == [0, 1, 2, 3]


@needs_torch
def test_torch_tensors_are_accepted_as_leaves(server: Server) -> None:
    import torch

    ids = torch.arange(BATCH, dtype=torch.int64)
    obs = ids[:, None].repeat(1, 3).to(torch.float32)
    for i in range(BATCH):
        server.submit({"id": ids[i], "obs": obs[i]})
    server.submit_batch({"id": ids, "obs": obs.t().contiguous().t()})  # non-contiguous: copied
    assert ids_of(server) == [0, 1, 2, 3]
    assert ids_of(server) == [0, 1, 2, 3]
    with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected dtype float32, got float64"):
        server.submit({"id": ids[0], "obs": obs[0].double()})
