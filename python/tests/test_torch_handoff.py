"""The learner's hand-off into PyTorch, on CPU: `sample(device="cpu")` (tensors that own a
copy), `sample(writable=True)` + `torch.from_numpy` (tensors over the ring's slots, no copy),
and DLPack (`torch.from_dlpack`) of writable views. Skipped where PyTorch is not installed:
CI's default run leaves it out (a 539 MB wheel plus GBs of CUDA libraries); `just test-torch`
(scripts/test_torch.sh) installs it beside the project's virtualenv and runs these."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from echo import Server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="PyTorch is not installed (CI leaves it out: a 539 MB wheel plus GBs of CUDA libs)",
)

EXAMPLE = {"id": np.zeros((), np.int64), "obs": {"pixels": np.zeros((2, 3), np.float32)}}
BATCH = 4
WAIT_S = 10.0


def sample_of(i: int) -> dict[str, Any]:
    return {"id": np.asarray(i, np.int64), "obs": {"pixels": np.full((2, 3), i, np.float32)}}


def ids_of(batch: dict[str, Any]) -> list[int]:
    """The batch's ids (as numpy), after checking every slot is whole (pixels encode the id)."""
    ids = np.asarray(batch["id"])
    pixels = np.asarray(batch["obs"]["pixels"])
    np.testing.assert_array_equal(pixels, np.broadcast_to(ids[:, None, None], pixels.shape))
    return [int(i) for i in ids]


def filled(batches: int) -> Server:
    server = Server(EXAMPLE, batch_size=BATCH, num_buffers=max(batches, 2))
    for i in range(BATCH * batches):
        server.submit(sample_of(i))
    return server


def test_sample_device_cpu_gives_tensors_that_own_their_data() -> None:
    import torch

    server = filled(2)  # a ring of two batches, both full
    try:
        first = server.sample(timeout=WAIT_S, device="cpu")
        assert first is not None
        pixels = first.batch["obs"]["pixels"]
        assert isinstance(pixels, torch.Tensor)
        assert (pixels.dtype, tuple(pixels.shape), pixels.device.type) == (
            torch.float32,
            (BATCH, 2, 3),
            "cpu",
        )
        assert first.batch["id"].dtype == torch.int64
        # The next sample gives the first batch's slots back to the writers, which overwrite
        # them: the first batch's tensors are copies, so they still hold ids 0-3.
        assert server.sample(timeout=WAIT_S) is not None
        for i in range(BATCH):
            server.submit(sample_of(1000 + i))
        again = server.sample(timeout=WAIT_S)
        assert again is not None
        assert ids_of(again.batch) == [1000, 1001, 1002, 1003]
        as_numpy = {"id": first.batch["id"].numpy(), "obs": {"pixels": pixels.numpy()}}
        assert ids_of(as_numpy) == [0, 1, 2, 3]
        pixels += 1  # theirs to write
    finally:
        server.close()


def test_writable_views_go_into_torch_without_a_copy() -> None:
    import torch

    server = filled(2)
    try:
        sample = server.sample(timeout=WAIT_S, writable=True)
        assert sample is not None
        view = sample.batch["obs"]["pixels"]
        tensor = torch.from_numpy(view)
        # The same memory: the tensor is a view into the ring's slots.
        assert tensor.data_ptr() == view.ctypes.data
        ids = torch.from_numpy(sample.batch["id"]).numpy()
        assert ids_of({"id": ids, "obs": {"pixels": tensor.numpy()}}) == [0, 1, 2, 3]
        tensor.mul_(2)  # the learner's until the next sample(): writing is safe
        assert float(view[1, 0, 0]) == 2.0
        assert torch.as_tensor(view).data_ptr() == view.ctypes.data
    finally:
        server.close()


def test_dlpack_of_writable_views_shares_memory_with_torch() -> None:
    import torch

    server = filled(2)
    try:
        sample = server.sample(timeout=WAIT_S, writable=True)
        assert sample is not None
        view = sample.batch["obs"]["pixels"]
        tensor = torch.from_dlpack(view)
        assert tensor.data_ptr() == view.ctypes.data
        assert tensor.shape == (BATCH, 2, 3)
        np.testing.assert_array_equal(tensor.numpy(), view)
    finally:
        server.close()


def test_torch_from_numpy_of_a_read_only_view_warns() -> None:
    import torch

    server = filled(1)
    try:
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        view = sample.batch["obs"]["pixels"]
        assert not view.flags.writeable
        # The default views are read-only; torch takes one with a warning that says so. The
        # documented ways into torch are writable=True (zero-copy), copy=True or device=.
        with pytest.warns(UserWarning, match="not writable"):
            torch.from_numpy(view)
    finally:
        server.close()


def test_every_batch_reaches_torch_once_and_in_order() -> None:
    import torch

    server = filled(4)
    seen: list[int] = []
    try:
        for _ in range(4):
            sample = server.sample(timeout=WAIT_S, writable=True)
            assert sample is not None
            ids = torch.from_numpy(sample.batch["id"])
            pixels = torch.from_numpy(sample.batch["obs"]["pixels"])
            seen += ids_of({"id": ids.numpy(), "obs": {"pixels": pixels.numpy()}})
    finally:
        server.close()
    assert seen == list(range(BATCH * 4))
