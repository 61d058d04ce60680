"""Checks ``Server(..., pin_host_memory=True)`` on a machine with an NVIDIA GPU, and times
host-to-device copies of a batch from the page-locked ring and from ordinary numpy memory.

Run it on a machine with a GPU, from the repository root, with echo built or installed::

    python benches/tools/gpu_check.py --json out.json

It needs numpy, echo and the CUDA runtime library (``libcudart``), and nothing else (no
PyTorch; from this checkout, ``benches/common.py``): CUDA is called through ``ctypes``.
The runtime is looked up like echo looks it up (``$ECHO_CUDART``, the
``nvidia-cuda-runtime-cu12`` wheel's ``nvidia/cuda_runtime/lib``, then the loader's
``libcudart.so*``), plus the CUDA 13 wheel's ``nvidia/cu13/lib``.

What it does, all bounded (one batch, ``--reps`` copies of it per measurement):

1. Loads ``libcudart`` and asks for a device. Where there is no CUDA runtime or no GPU it
   stops at once with a "no CUDA runtime/GPU" message and exit status 2.
2. Creates ``Server(example, batch_size=64, pin_host_memory=True)`` with an example of 40
   leaves of 1280 float32 (13.1 MB per batch), submits one batch of random samples and
   samples it; the views must equal what was submitted.
3. Calls ``cudaPointerGetAttributes`` on every leaf's data pointer: each must be registered
   host memory (``cudaMemoryTypeHost``), and a plain ``np.copy`` of the leaf must not be.
4. Times host-to-device copies of the batch (one ``cudaMemcpy`` per leaf into one
   ``cudaMalloc`` buffer, then ``cudaDeviceSynchronize``), from the pinned ring and from the
   unpinned numpy copy, and the host time of issuing the same copies with
   ``cudaMemcpyAsync`` (short only for pinned memory: that is what makes
   ``non_blocking=True`` asynchronous).
5. Copies the batch back from the device and compares it byte for byte.
6. Prints a table and, with ``--json PATH``, writes every number (also on failure).

Exit status: 0 when every check passed, 1 when a check failed, 2 when this machine has no
CUDA runtime or GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import echo
from benches import common as h

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_NO_CUDA = 2

CUDA_MEMORY_TYPE_UNREGISTERED = 0
CUDA_MEMORY_TYPE_HOST = 1
MEMORY_TYPE_NAMES = {0: "unregistered", 1: "host (page-locked)", 2: "device", 3: "managed"}
CUDA_MEMCPY_HOST_TO_DEVICE = 1
CUDA_MEMCPY_DEVICE_TO_HOST = 2

WARMUP_REPS = 3
MAX_BATCH_BYTES = 1 << 30
TIMEOUT_S = 10.0


class NoCudaError(Exception):
    """This machine has no usable CUDA runtime or no GPU."""


class CheckFailedError(Exception):
    """A check of echo's pinned ring failed."""


class CudaPointerAttributes(ctypes.Structure):
    """``struct cudaPointerAttributes`` as of CUDA 10 (``type`` replaced ``memoryType``)."""

    _fields_ = (
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
    )


def cudart_candidates() -> list[str]:
    """Where to look for libcudart: echo's order (``echo._server_args.cuda_runtime_candidates``),
    plus the CUDA 13 wheel's folder, which echo does not search."""
    candidates: list[str] = []
    explicit = os.environ.get("ECHO_CUDART")
    if explicit:
        candidates.append(explicit)
    try:
        nvidia = importlib.import_module("nvidia")  # namespace package of the nvidia-* wheels
    except ImportError:
        pass
    else:
        for root in getattr(nvidia, "__path__", []):
            for sub in ("cuda_runtime", "cu13"):
                pattern = os.path.join(str(root), sub, "lib", "libcudart.so*")
                candidates += sorted(glob.glob(pattern))
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    return candidates


class Cudart:
    """The few CUDA runtime functions this check needs, with their C signatures."""

    def __init__(self, path: str, lib: ctypes.CDLL) -> None:
        self.path = path
        self._lib = lib
        c_int_p = ctypes.POINTER(ctypes.c_int)
        self._error_name = self._fn("cudaGetErrorName", [ctypes.c_int], ctypes.c_char_p)
        self._device_count = self._fn("cudaGetDeviceCount", [c_int_p])
        self._runtime_version = self._fn("cudaRuntimeGetVersion", [c_int_p])
        self._driver_version = self._fn("cudaDriverGetVersion", [c_int_p])
        self._get_device = self._fn("cudaGetDevice", [c_int_p])
        self._pointer_attributes = self._fn(
            "cudaPointerGetAttributes",
            [ctypes.POINTER(CudaPointerAttributes), ctypes.c_void_p],
        )
        self._get_last_error = self._fn("cudaGetLastError", [])
        self._malloc = self._fn("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t])
        self._free = self._fn("cudaFree", [ctypes.c_void_p])
        copy_args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._memcpy = self._fn("cudaMemcpy", copy_args)
        self._memcpy_async = self._fn("cudaMemcpyAsync", [*copy_args, ctypes.c_void_p])
        self._synchronize = self._fn("cudaDeviceSynchronize", [])

    def _fn(
        self, name: str, argtypes: Sequence[Any], restype: Any = ctypes.c_int
    ) -> Callable[..., Any]:
        try:
            fn = getattr(self._lib, name)
        except AttributeError as err:
            raise NoCudaError(
                f"no CUDA runtime/GPU: {self.path} is not a CUDA runtime (it has no {name})"
            ) from err
        fn.argtypes = list(argtypes)
        fn.restype = restype
        return fn

    def error_name(self, status: int) -> str:
        name = self._error_name(status)
        return name.decode() if name else f"error {status}"

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise CheckFailedError(
                f"{what} failed: CUDA error {status} ({self.error_name(status)})"
            )

    def device(self) -> dict[str, Any]:
        """The current device and versions; `NoCudaError` if there is no device."""
        count = ctypes.c_int(0)
        status = self._device_count(ctypes.byref(count))
        if status != 0 or count.value < 1:
            raise NoCudaError(
                f"no CUDA runtime/GPU: cudaGetDeviceCount returned {self.error_name(status)} "
                f"with {count.value} devices (runtime {self.path})"
            )
        runtime, driver, index = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        self.check(self._runtime_version(ctypes.byref(runtime)), "cudaRuntimeGetVersion")
        self.check(self._driver_version(ctypes.byref(driver)), "cudaDriverGetVersion")
        self.check(self._get_device(ctypes.byref(index)), "cudaGetDevice")
        return {
            "index": index.value,
            "count": count.value,
            "name": self._device_name(index.value),
            "runtime_version": _version(runtime.value),
            "driver_version": _version(driver.value),
            "cudart": self.path,
        }

    def _device_name(self, index: int) -> str:
        """`cudaDeviceProp.name` (its first field, 256 chars); "unknown" if unavailable."""
        props = ctypes.create_string_buffer(16384)  # larger than cudaDeviceProp in any version
        for symbol in ("cudaGetDeviceProperties_v2", "cudaGetDeviceProperties"):
            fn = getattr(self._lib, symbol, None)
            if fn is None:
                continue
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
            fn.restype = ctypes.c_int
            if fn(props, index) == 0:
                return props.raw[:256].split(b"\0", 1)[0].decode(errors="replace")
        return "unknown"

    def memory_type(self, address: int) -> int:
        attributes = CudaPointerAttributes()
        status = self._pointer_attributes(ctypes.byref(attributes), address)
        if status != 0:
            # CUDA 10 reports plain host memory as cudaErrorInvalidValue; clear it.
            self._get_last_error()
            return CUDA_MEMORY_TYPE_UNREGISTERED
        return int(attributes.type)

    def malloc(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p(0)
        self.check(self._malloc(ctypes.byref(pointer), nbytes), f"cudaMalloc({nbytes})")
        return int(pointer.value or 0)

    def free(self, address: int) -> None:
        self.check(self._free(address), "cudaFree")

    def copy_to_device(self, device: int, host: int, nbytes: int) -> None:
        self.check(self._memcpy(device, host, nbytes, CUDA_MEMCPY_HOST_TO_DEVICE), "cudaMemcpy")

    def copy_to_device_async(self, device: int, host: int, nbytes: int) -> None:
        status = self._memcpy_async(device, host, nbytes, CUDA_MEMCPY_HOST_TO_DEVICE, None)
        self.check(status, "cudaMemcpyAsync")

    def copy_to_host(self, host: int, device: int, nbytes: int) -> None:
        self.check(self._memcpy(host, device, nbytes, CUDA_MEMCPY_DEVICE_TO_HOST), "cudaMemcpy")

    def synchronize(self) -> None:
        self.check(self._synchronize(), "cudaDeviceSynchronize")


def _version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def load_cudart() -> Cudart:
    tried: list[str] = []
    for candidate in cudart_candidates():
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as err:
            tried.append(f"{candidate}: {err}")
            continue
        return Cudart(candidate, lib)
    raise NoCudaError(
        "no CUDA runtime/GPU: could not load the CUDA runtime (libcudart); set ECHO_CUDART to "
        "its path or install the nvidia-cuda-runtime-cu12 wheel. Tried:\n  " + "\n  ".join(tried)
    )


def _offsets(arrays: Sequence[npt.NDArray[Any]]) -> list[int]:
    """Byte offsets of `arrays` laid out back to back."""
    return [0, *itertools.accumulate(array.nbytes for array in arrays[:-1])]


def time_copies(
    cuda: Cudart, device: int, sources: list[npt.NDArray[Any]], reps: int
) -> dict[str, Any]:
    """Copies every source leaf to consecutive device memory, `reps` times each way."""
    nbytes = sum(source.nbytes for source in sources)
    plan = [
        (device + offset, source.ctypes.data, source.nbytes)
        for offset, source in zip(_offsets(sources), sources, strict=True)
    ]

    def copy_all(copy: Callable[[int, int, int], None]) -> None:
        for dst, src, size in plan:
            copy(dst, src, size)

    for _ in range(WARMUP_REPS):
        copy_all(cuda.copy_to_device)
        cuda.synchronize()
    sync_s: list[float] = []
    for _ in range(reps):
        start = time.perf_counter()
        copy_all(cuda.copy_to_device)
        cuda.synchronize()
        sync_s.append(time.perf_counter() - start)
    issue_s: list[float] = []
    async_s: list[float] = []
    for _ in range(reps):
        start = time.perf_counter()
        copy_all(cuda.copy_to_device_async)
        issued = time.perf_counter()
        cuda.synchronize()
        issue_s.append(issued - start)
        async_s.append(time.perf_counter() - start)
    return {
        "bytes": nbytes,
        "reps": reps,
        "sync_gbps_median": nbytes / statistics.median(sync_s) / 1e9,
        "sync_gbps_best": nbytes / min(sync_s) / 1e9,
        "async_issue_ms_median": statistics.median(issue_s) * 1e3,
        "async_gbps_median": nbytes / statistics.median(async_s) / 1e9,
    }


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fills `report`; raises `NoCudaError` or `CheckFailedError` at the first problem."""
    cuda = load_cudart()
    report["device"] = cuda.device()
    names = [f"leaf{i:03d}" for i in range(args.leaves)]
    example = {name: np.zeros((args.leaf_size,), np.float32) for name in names}
    try:
        server = echo.Server(example, batch_size=args.batch_size, pin_host_memory=True)
    except RuntimeError as err:
        raise CheckFailedError(
            f"Server(pin_host_memory=True) failed although {cuda.path} loaded: {err} "
            f"(try ECHO_CUDART={cuda.path})"
        ) from err
    device = 0
    try:
        report["checks"]["server_pinned"] = server.pinned
        if not server.pinned:
            raise CheckFailedError("Server(pin_host_memory=True).pinned is False")
        rng = np.random.default_rng(0)
        submitted: list[dict[str, npt.NDArray[np.float32]]] = [
            {name: rng.standard_normal(args.leaf_size, dtype=np.float32) for name in names}
            for _ in range(args.batch_size)
        ]
        for sample in submitted:
            server.submit(sample, timeout=TIMEOUT_S)
        got = server.sample(timeout=TIMEOUT_S)
        if got is None:
            raise CheckFailedError("sample() returned None")
        views: list[npt.NDArray[Any]] = [got.batch[name] for name in names]
        for name, view in zip(names, views, strict=True):
            if not np.array_equal(view, np.stack([sample[name] for sample in submitted])):
                raise CheckFailedError(f"the sampled batch differs from the submitted one ({name})")

        ring_types = [cuda.memory_type(view.ctypes.data) for view in views]
        unpinned = [np.copy(view) for view in views]
        copy_types = [cuda.memory_type(array.ctypes.data) for array in unpinned]
        pinned_leaves = sum(t == CUDA_MEMORY_TYPE_HOST for t in ring_types)
        report["checks"]["ring_leaves_host_registered"] = f"{pinned_leaves}/{len(views)}"
        report["checks"]["ring_memory_types"] = sorted(
            {MEMORY_TYPE_NAMES.get(t, str(t)) for t in ring_types}
        )
        report["checks"]["numpy_copy_memory_types"] = sorted(
            {MEMORY_TYPE_NAMES.get(t, str(t)) for t in copy_types}
        )
        if pinned_leaves != len(views):
            raise CheckFailedError(
                f"only {pinned_leaves} of {len(views)} ring leaves are cudaMemoryTypeHost "
                f"(types: {report['checks']['ring_memory_types']})"
            )
        if any(t != CUDA_MEMORY_TYPE_UNREGISTERED for t in copy_types):
            raise CheckFailedError("a plain numpy copy reports as registered: no baseline")

        nbytes = sum(view.nbytes for view in views)
        device = cuda.malloc(nbytes)
        report["results"]["pinned_ring"] = time_copies(cuda, device, views, args.reps)
        report["results"]["numpy_copy"] = time_copies(cuda, device, unpinned, args.reps)
        pinned, pageable = report["results"]["pinned_ring"], report["results"]["numpy_copy"]
        report["speedup_sync"] = pinned["sync_gbps_median"] / pageable["sync_gbps_median"]

        for view, offset in zip(views, _offsets(views), strict=True):
            cuda.copy_to_device(device + offset, view.ctypes.data, view.nbytes)
        back = np.empty(nbytes, np.uint8)
        cuda.copy_to_host(back.ctypes.data, device, nbytes)
        expected = b"".join(view.tobytes() for view in views)
        report["checks"]["round_trip_identical"] = back.tobytes() == expected
        if not report["checks"]["round_trip_identical"]:
            raise CheckFailedError("ring -> device -> host did not return the same bytes")
    finally:
        if device:
            cuda.free(device)
        server.close()


def print_report(report: dict[str, Any]) -> None:
    dev, cfg, checks = report["device"], report["config"], report["checks"]
    print(
        f"echo {report['echo_version']} gpu_check: {dev['name']}, CUDA runtime "
        f"{dev['runtime_version']}, driver {dev['driver_version']} ({dev['cudart']})"
    )
    print(
        f"batch: {cfg['leaves']} leaves x {cfg['batch_size']} samples x {cfg['leaf_size']} "
        f"float32 = {cfg['batch_bytes'] / 1e6:.1f} MB; {cfg['reps']} copies per measurement"
    )
    print(
        f"ring leaves registered (cudaMemoryTypeHost): {checks['ring_leaves_host_registered']}; "
        f"numpy copy: {', '.join(checks['numpy_copy_memory_types'])}; "
        f"round trip identical: {checks['round_trip_identical']}"
    )
    print()
    header = (
        f"{'source':<24}{'sync GB/s':>12}{'best GB/s':>12}{'async issue ms':>16}{'async GB/s':>12}"
    )
    print(header)
    print("-" * len(header))
    for label, key in (("pinned ring", "pinned_ring"), ("numpy copy (pageable)", "numpy_copy")):
        r = report["results"][key]
        print(
            f"{label:<24}{r['sync_gbps_median']:>12.2f}{r['sync_gbps_best']:>12.2f}"
            f"{r['async_issue_ms_median']:>16.3f}{r['async_gbps_median']:>12.2f}"
        )
    print(f"\npinned / pageable (sync, median): {report['speedup_sync']:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    for flag, limit, default, what in (
        ("--leaves", 1024, 40, "leaves"),
        ("--leaf-size", 1 << 24, 1280, "float32 per leaf"),
        ("--batch-size", 4096, 64, "batch"),
        ("--reps", 1000, 50, "copies timed"),
    ):
        parser.add_argument(
            flag, type=h.bounded_int(flag, limit), default=default, help=f"{what} ({default})"
        )
    args = parser.parse_args(argv)
    batch_bytes = args.leaves * args.leaf_size * args.batch_size * 4
    if batch_bytes > MAX_BATCH_BYTES:
        parser.error(f"a batch of {batch_bytes} bytes is over the {MAX_BATCH_BYTES} limit")
    report: dict[str, Any] = {
        "echo_version": echo.__version__,  # pyright: ignore[reportUnknownMemberType]
        "detailed_metrics": echo.DETAILED_METRICS,
        "python": platform.python_version(),
        "numpy": np.__version__,  # pyright: ignore[reportUnknownMemberType]
        "host": platform.node(),
        "config": {
            "leaves": args.leaves,
            "leaf_size": args.leaf_size,
            "batch_size": args.batch_size,
            "reps": args.reps,
            "batch_bytes": batch_bytes,
        },
        "device": None,
        "checks": {},
        "results": {},
    }
    status = EXIT_OK
    try:
        run(args, report)
        report["status"] = "passed"
        print_report(report)
    except NoCudaError as err:
        report["status"], report["error"] = "no-cuda", str(err)
        print(f"gpu_check: {err}", file=sys.stderr)
        status = EXIT_NO_CUDA
    except CheckFailedError as err:
        report["status"], report["error"] = "failed", str(err)
        print(f"gpu_check: FAILED: {err}", file=sys.stderr)
        status = EXIT_CHECK_FAILED
    if args.json is not None:
        h.write_json(args.json, report, say=False)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
