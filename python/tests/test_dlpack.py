"""Zero-copy hand-off of batch leaves to numpy, JAX and PyTorch (CPU): the consumer's array
points at the ring slot itself (data-pointer identity), no warning is raised (pytest turns
warnings into errors), and the consumer's array keeps the ring alive as a numpy view does.

JAX runs wherever the `test` extra is installed (CI); PyTorch tests skip where torch is not
installed (CI does not install it: see .ci/run)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from testkit.frameworks import needs_jax, needs_torch

from echo import Server

EXAMPLE = {"obs": np.zeros((4,), np.float32), "id": np.zeros((), np.int64)}
BATCH = 8


def filled(batches: int = 2) -> Server:
    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH * batches):
        server.submit({"obs": np.full(4, i, np.float32), "id": np.asarray(i, np.int64)})
    return server


def ptr(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def expected_obs(first: int) -> np.ndarray:
    return np.repeat(np.arange(first, first + BATCH, dtype=np.float32)[:, None], 4, axis=1)


def outlives_server(make: Callable[[np.ndarray], Any], to_numpy: Callable[[Any], np.ndarray]):
    """Makes a consumer array over a writable view, closes and drops the server, and checks
    the array still reads the batch (the ring is kept alive through it alone)."""
    server = filled()
    sample = server.sample(writable=True)
    assert sample is not None
    obs = sample.batch["obs"]
    address = ptr(obs)
    consumer = make(obs)
    server.close()
    del server, sample, obs
    gc.collect()
    view = to_numpy(consumer)
    assert ptr(view) == address
    np.testing.assert_array_equal(view, expected_obs(0))


# ---------------------------------------------------------------------------------------------
# numpy
# ---------------------------------------------------------------------------------------------


def test_np_from_dlpack_of_a_read_only_view_aliases_the_ring_and_stays_read_only() -> None:
    server = filled()
    sample = server.sample()
    assert sample is not None
    obs = sample.batch["obs"]
    alias = np.from_dlpack(obs)
    assert ptr(alias) == ptr(obs)
    assert not alias.flags.writeable  # the versioned DLPack protocol carries read-only
    np.testing.assert_array_equal(alias, expected_obs(0))
    server.close()


def test_np_from_dlpack_of_a_writable_view_aliases_the_ring() -> None:
    server = filled()
    sample = server.sample(writable=True)
    assert sample is not None
    obs = sample.batch["obs"]
    assert obs.flags.writeable
    alias = np.from_dlpack(obs)
    assert ptr(alias) == ptr(obs)
    server.close()


def test_np_from_dlpack_array_outlives_the_server() -> None:
    outlives_server(np.from_dlpack, lambda a: a)


def test_read_only_views_still_refuse_the_legacy_dlpack_export() -> None:
    """What numpy does for consumers without the versioned protocol (JAX's from_dlpack):
    the reason `writable=True` exists."""
    server = filled()
    sample = server.sample()
    assert sample is not None
    with pytest.raises(BufferError, match="readonly"):
        sample.batch["obs"].__dlpack__()
    server.close()


def test_writable_views_share_the_ring_and_default_views_stay_read_only() -> None:
    server = filled()
    first = server.sample(writable=True)
    assert first is not None
    assert all(leaf.flags.writeable for leaf in first.batch.values())
    assert type(first.batch["obs"].base).__name__ == "RingLease"
    first.batch["obs"][0, 0] = -1.0  # the learner's slot until the next sample()
    second = server.sample()
    assert second is not None
    assert not any(leaf.flags.writeable for leaf in second.batch.values())
    server.close()


def test_writable_views_of_a_replay_batch_keep_the_per_item_arrays_read_only() -> None:
    from echo import Uniform

    server = Server(EXAMPLE, batch_size=4, sampler=Uniform(), max_size=16, seed=1)
    for i in range(8):
        server.submit({"obs": np.full(4, i, np.float32), "id": np.asarray(i, np.int64)})
    sample = server.sample(writable=True)
    assert sample is not None
    assert sample.batch["obs"].flags.writeable
    assert sample.keys is not None
    assert not sample.keys.flags.writeable
    server.close()


def test_dataset_iter_writable_yields_writable_views() -> None:
    server = filled()
    for sample in server.dataset_iter(writable=True):
        assert sample.batch["obs"].flags.writeable
        break
    server.close()


# ---------------------------------------------------------------------------------------------
# JAX (CPU)
# ---------------------------------------------------------------------------------------------


@needs_jax
def test_jax_dlpack_from_dlpack_of_a_writable_view_aliases_the_ring() -> None:
    import jax

    server = filled()
    sample = server.sample(writable=True)
    assert sample is not None
    obs = sample.batch["obs"]
    array = jax.dlpack.from_dlpack(obs)
    assert array.unsafe_buffer_pointer() == ptr(obs)
    np.testing.assert_array_equal(np.asarray(array), expected_obs(0))
    server.close()


@needs_jax
def test_jax_device_put_of_a_read_only_view_aliases_the_ring() -> None:
    import jax

    server = filled()
    sample = server.sample()
    assert sample is not None
    obs = sample.batch["obs"]
    array = jax.device_put(obs)
    assert array.unsafe_buffer_pointer() == ptr(obs)
    server.close()


@needs_jax
def test_jax_array_outlives_the_server() -> None:
    import jax

    outlives_server(jax.dlpack.from_dlpack, np.from_dlpack)


@needs_jax
def test_jax_device_put_array_outlives_the_server() -> None:
    import jax

    outlives_server(jax.device_put, np.from_dlpack)


@needs_jax
def test_jnp_asarray_of_a_view_reads_the_batch() -> None:
    """`jnp.asarray` stages numpy input (a copy in JAX 0.10; older releases may alias), so
    the docs point to `jax.device_put` / `jax.dlpack.from_dlpack` for zero-copy. Either way
    it must read the batch, and, should it alias, keep the ring alive."""
    import jax.numpy as jnp

    server = filled()
    sample = server.sample(writable=True)
    assert sample is not None
    array = jnp.asarray(sample.batch["obs"])
    server.close()
    del server, sample
    gc.collect()
    np.testing.assert_array_equal(np.asarray(array), expected_obs(0))


# ---------------------------------------------------------------------------------------------
# PyTorch (CPU)
# ---------------------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("convert", ["from_dlpack", "as_tensor", "from_numpy"])
def test_torch_tensor_of_a_writable_view_aliases_the_ring(convert: str) -> None:
    import torch

    server = filled()
    sample = server.sample(writable=True)
    assert sample is not None
    obs = sample.batch["obs"]
    tensor = getattr(torch, convert)(obs)
    assert tensor.data_ptr() == ptr(obs)
    assert tensor.dtype == torch.float32
    assert tensor.shape == (BATCH, 4)
    server.close()


@needs_torch
def test_torch_tensor_outlives_the_server() -> None:
    import torch

    outlives_server(torch.from_dlpack, lambda t: t.numpy())
    outlives_server(torch.as_tensor, lambda t: t.numpy())
