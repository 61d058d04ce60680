"""`pin_host_memory=True`: the error path everywhere, and the registration protocol against a
fake CUDA runtime (three C functions compiled here with gcc) that logs every call.

The real thing (a GPU, DMA timings) is checked by benches/tools/gpu_check.py on a machine with one.
"""

from __future__ import annotations

import ctypes.util
import gc
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import echo

FAKE_CUDART = r"""
#include <stdio.h>
#include <stdlib.h>
static void note(const char* what, void* p, size_t n) {
    FILE* f = fopen(getenv("FAKE_CUDA_LOG"), "a");
    fprintf(f, "%s %p %zu\n", what, p, n);
    fclose(f);
}
int cudaGetDeviceCount(int* n) {
    const char* d = getenv("FAKE_CUDA_DEVICES");
    *n = d ? atoi(d) : 1;
    return 0;
}
int cudaHostRegister(void* p, size_t n, unsigned flags) {
    if (getenv("FAKE_CUDA_FAIL")) return 2; /* cudaErrorMemoryAllocation */
    note("register", p, n);
    return 0;
}
int cudaHostUnregister(void* p) { note("unregister", p, 0); return 0; }
"""

EXAMPLE = {"obs": np.zeros((4, 3), np.float32), "empty": np.zeros((0,), np.int8)}


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("needs a C compiler to build the fake CUDA runtime")
    folder = tmp_path_factory.mktemp("fake_cuda")
    (folder / "fake.c").write_text(FAKE_CUDART)
    lib = folder / "libfakecudart.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib), str(folder / "fake.c")], check=True)
    return lib


@pytest.fixture
def cuda_log(fake_cudart: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "calls.log"
    log.touch()
    monkeypatch.setenv("ECHO_CUDART", str(fake_cudart))
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    return log


def _calls(log: Path) -> list[tuple[str, int, int]]:
    out = []
    for line in log.read_text().splitlines():
        what, ptr, size = line.split()
        out.append((what, int(ptr, 16), int(size)))
    return out


@pytest.mark.skipif(
    ctypes.util.find_library("cudart") is not None, reason="a CUDA runtime is installed here"
)
def test_without_cuda_it_is_a_runtime_error_naming_libcudart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ECHO_CUDART", "/nonexistent/libcudart.so")
    with pytest.raises(RuntimeError, match="libcudart"):
        echo.Server(EXAMPLE, batch_size=2, pin_host_memory=True)


def test_without_a_device_it_is_a_runtime_error(
    cuda_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "0")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        echo.Server(EXAMPLE, batch_size=2, pin_host_memory=True)
    assert _calls(cuda_log) == []


def test_a_failed_registration_is_a_runtime_error(
    cuda_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", "1")
    expected = "cudaHostRegister of 384 bytes failed with CUDA error 2"
    with pytest.raises(RuntimeError, match=expected):
        echo.Server(EXAMPLE, batch_size=2, num_buffers=4, pin_host_memory=True)


def test_every_buffer_is_registered_and_unregistered_after_the_last_view(cuda_log: Path) -> None:
    server = echo.Server(EXAMPLE, batch_size=2, num_buffers=4, pin_host_memory=True)
    assert server.pinned
    calls = _calls(cuda_log)
    # One range per non-empty leaf: 4 batches x 2 samples x 12 floats x 4 bytes.
    assert [(what, size) for what, _, size in calls] == [("register", 2 * 4 * 12 * 4)]
    registered = calls[0][1]
    for i in range(2):
        server.submit({"obs": np.full((4, 3), i, np.float32), "empty": np.zeros(0, np.int8)})
    sample = server.sample(timeout=5)
    assert sample is not None
    view = sample.batch["obs"]
    assert view.__array_interface__["data"][0] == registered  # batch 0 starts the buffer
    server.close()
    del server, sample
    gc.collect()
    assert [c[0] for c in _calls(cuda_log)] == ["register"], "unregistered under a live view"
    np.testing.assert_array_equal(view[1], np.ones((4, 3), np.float32))
    del view
    gc.collect()
    assert _calls(cuda_log)[1:] == [("unregister", registered, 0)]


def test_an_unpinned_server_says_so() -> None:
    server = echo.Server(EXAMPLE, batch_size=2)
    assert not server.pinned
    server.close()


def test_a_replay_server_pins_its_batch_area_not_its_table(cuda_log: Path) -> None:
    server = echo.Server(
        EXAMPLE, batch_size=2, sampler=echo.Uniform(), max_size=64, pin_host_memory=True
    )
    assert server.pinned
    calls = _calls(cuda_log)
    # Two halves of 2 items: obs (48 bytes each), keys (8), probabilities (8), times (4); the
    # 64-item table itself (64 x 48 bytes of obs) is not registered.
    assert [(what, size) for what, _, size in calls] == [
        ("register", 4 * 48),
        ("register", 4 * 8),
        ("register", 4 * 8),
        ("register", 4 * 4),
    ]
    for i in range(3):
        server.submit({"obs": np.full((4, 3), i, np.float32), "empty": np.zeros(0, np.int8)})
    sample = server.sample(timeout=5)
    assert sample is not None
    start = calls[0][1]
    address = sample.batch["obs"].__array_interface__["data"][0]
    assert start <= address < start + 4 * 48  # the batch is a view into the pinned area
    server.close()
    del server
    gc.collect()
    assert len(_calls(cuda_log)) == 4, "unregistered under a live view"
    del sample
    gc.collect()
    assert sorted(c[0] for c in _calls(cuda_log)[4:]) == ["unregister"] * 4
