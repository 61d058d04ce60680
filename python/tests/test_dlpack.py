"""Zero-copy hand-off of batch leaves to numpy, JAX and PyTorch (CPU): the consumer's array
points at the ring slot itself (data-pointer identity), no warning is raised (pytest turns
warnings into errors), and the consumer's array keeps the ring alive as a numpy view does.

JAX runs wherever the `test` extra is installed (CI); PyTorch tests skip where torch is not
installed (CI does not install it: see .ci/run)."""

from __future__ import annotations

import ctypes
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


DLPACK_FLAG_BITMASK_READ_ONLY = 1


class _VersionedHeader(ctypes.Structure):
    """The start of DLPack 1.0's `DLManagedTensorVersioned`: version, manager_ctx, deleter,
    flags (the `DLTensor` follows)."""

    _fields_ = (
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
    )


def versioned_export_flags(array: np.ndarray) -> int:
    """The flags numpy sets when `array` is exported through the versioned DLPack protocol,
    the one `torch.from_dlpack` asks for (`__dlpack__(max_version=(1, 0))`). The capsule is
    left unconsumed; numpy's capsule destructor frees it."""
    capsule = array.__dlpack__(max_version=(1, 0))
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = (ctypes.py_object,)
    assert get_name(capsule) == b"dltensor_versioned"
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
    address = get_pointer(capsule, b"dltensor_versioned")
    assert address
    return int(_VersionedHeader.from_address(address).flags)


needs_versioned_dlpack = pytest.mark.skipif(
    np.lib.NumpyVersion(np.__version__) < "2.1.0",
    reason="numpy < 2.1 has no versioned DLPack export (__dlpack__(max_version=...))",
)


@needs_versioned_dlpack
def test_a_read_only_view_is_exported_with_dlpacks_read_only_flag() -> None:
    """The views are plain numpy arrays, so numpy's `__dlpack__` decides what a DLPack
    consumer gets: through the versioned protocol, the slot itself marked read-only. A
    consumer that honours the flag keeps it read-only (`np.from_dlpack`); one that ignores
    it (`torch.from_dlpack`, see below) gets a writable alias of the ring."""
    server = filled()
    sample = server.sample()
    assert sample is not None
    assert versioned_export_flags(sample.batch["obs"]) & DLPACK_FLAG_BITMASK_READ_ONLY
    server.close()


@needs_versioned_dlpack
def test_a_writable_view_is_exported_without_the_read_only_flag() -> None:
    server = filled()
    sample = server.sample(writable=True)
    assert sample is not None
    assert not versioned_export_flags(sample.batch["obs"]) & DLPACK_FLAG_BITMASK_READ_ONLY
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
def test_torch_from_dlpack_of_a_read_only_view_is_a_writable_alias_or_refused() -> None:
    """What the zero-copy guide documents. PyTorch has no read-only tensors: a torch that
    asks for the versioned protocol gets the read-only flag and ignores it, so the tensor
    aliases the ring slot and takes writes, with no warning; a torch that asks for the
    legacy protocol gets numpy's BufferError. Should a torch ever refuse or warn instead,
    this test fails and the guide needs updating."""
    import torch

    server = filled()
    sample = server.sample()
    assert sample is not None
    obs = sample.batch["obs"]
    refused: str | None = None
    tensor: Any = None
    try:
        tensor = torch.from_dlpack(obs)
    except BufferError as e:
        refused = str(e)
    if refused is not None:
        assert "readonly" in refused
    else:
        assert tensor.data_ptr() == ptr(obs)
        tensor[0, 0] = -1.0  # into the ring slot, past the view's read-only flag
        assert obs[0, 0] == -1.0
    server.close()


@needs_torch
def test_torch_tensor_outlives_the_server() -> None:
    import torch

    outlives_server(torch.from_dlpack, lambda t: t.numpy())
    outlives_server(torch.as_tensor, lambda t: t.numpy())
