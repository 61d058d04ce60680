"""The learner's own state in a checkpoint: `Server.checkpoint(path, extra=...)`,
`Server.restored_extra`, `echo.checkpoint.read_extra`, the periodic `checkpoint_extra` hook,
and a process killed mid-checkpoint leaving data and extra of one and the same checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.checkpoints import example, item

from echo import CheckpointError, Server, Uniform
from echo.checkpoint import PeriodicCheckpointer, periodic_checkpoints, read_extra


def model_state(step: int) -> dict[str, Any]:
    """What a learner keeps: parameters, optimizer moments, a step counter and run metadata."""
    rng = np.random.default_rng(step)
    params = {
        "dense_0": {
            "w": rng.standard_normal((4, 8)).astype(np.float32),
            "b": np.zeros(8, np.float32),
        },
        "head": {"w": rng.standard_normal((8, 2)).astype(np.float32)},
    }
    return {
        "params": params,
        "opt_state": (
            {"mu": {"w": np.full((4, 8), 0.5, np.float32)}},
            {"count": np.int32(step)},
        ),
        "step": step,
        "lr": 3e-4,
        "env": "CartPole-v1",
        "tags": ["dqn", None, True],
        "bytes": np.arange(5, dtype=np.uint8),
    }


def assert_same_tree(got: Any, expected: Any, where: str = "extra") -> None:
    """Equal structure (types included: tuples stay tuples, numpy scalars numpy scalars)
    and equal leaves with equal dtypes."""
    assert type(got) is type(expected), f"{where}: {type(got)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            assert_same_tree(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same_tree(g, e, f"{where}[{i}]")
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert got.dtype == expected.dtype, where
        np.testing.assert_array_equal(got, expected, err_msg=where)
    else:
        assert got == expected, where


SERVERS = {
    "replay": lambda: Server(example(), 2, sampler=Uniform(), max_size=16, seed=1),
    "fifo": lambda: Server(example(), 2, num_buffers=4),
}


@pytest.mark.parametrize("kind", SERVERS)
def test_a_model_pytree_round_trips(tmp_path: Path, kind: str) -> None:
    state = model_state(7)
    with SERVERS[kind]() as server:
        for i in range(5):
            server.submit(item(i))
        server.checkpoint(tmp_path / "ckpt", extra=state)
    with Server.restore(tmp_path / "ckpt") as restored:
        assert_same_tree(restored.restored_extra, state)
        got = restored.sample(timeout=10)
        assert got is not None, "the data came back too"
    assert_same_tree(read_extra(tmp_path / "ckpt"), state)


def test_the_extra_files_are_listed_with_size_and_sha256(tmp_path: Path) -> None:
    with SERVERS["replay"]() as server:
        server.checkpoint(tmp_path / "ckpt", extra=model_state(1))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["extra"] == "extra.json"
    extra_files = sorted(name for name in manifest["files"] if name.startswith("extra"))
    # params: 3 arrays, opt_state: 2, bytes: 1
    assert extra_files == ["extra.json", *(f"extra_{i:03d}.npy" for i in range(6))]
    for name in extra_files:
        entry = manifest["files"][name]
        assert entry["bytes"] == os.path.getsize(tmp_path / "ckpt" / name)
        assert len(entry["sha256"]) == 64


def test_without_extra_there_is_none(tmp_path: Path) -> None:
    with SERVERS["replay"]() as server:
        assert server.restored_extra is None, "a constructed server was not restored"
        server.checkpoint(tmp_path / "ckpt")
    assert "extra" not in json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert read_extra(tmp_path / "ckpt") is None
    with Server.restore(tmp_path / "ckpt") as restored:
        assert restored.restored_extra is None


@pytest.mark.parametrize("file", ["extra.json", "extra_001.npy"])
def test_a_damaged_extra_file_is_reported_with_the_file(tmp_path: Path, file: str) -> None:
    with SERVERS["replay"]() as server:
        server.checkpoint(tmp_path / "ckpt", extra=model_state(1))
    target = tmp_path / "ckpt" / file
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    expected = rf"{file}: SHA-256 [0-9a-f]+ differs from the manifest's"
    with pytest.raises(CheckpointError, match=expected):
        read_extra(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=expected):
        Server.restore(tmp_path / "ckpt")


class Opaque:
    pass


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"params": {"w": [np.zeros(2), Opaque()]}},
            r"extra\['params'\]\['w'\]\[1\] is a test_checkpoint_extra.Opaque, expected a "
            r"numpy array, a numpy scalar, None, bool, int, float, str, or a dict",
        ),
        ({"opt": {1: np.zeros(2)}}, r"extra\['opt'\] has the key 1 \(int\): .* must be str"),
        (
            {"a": np.array([object()], dtype=object)},
            r"extra\['a'\] is an array of dtype object, which holds Python objects",
        ),
        ({1.5, 2.5}, r"extra is a builtins.set, expected"),
    ],
    ids=["object", "int-key", "object-array", "set"],
)
def test_a_bad_extra_raises_type_error_naming_its_path_and_writes_nothing(
    tmp_path: Path, extra: Any, message: str
) -> None:
    with SERVERS["replay"]() as server:
        server.submit(item(0))
        server.checkpoint(tmp_path / "ckpt", extra={"step": 1})
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(TypeError, match=rf"^checkpoint\(\): {message}"):
            server.checkpoint(tmp_path / "ckpt", extra=extra)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert read_extra(tmp_path / "ckpt") == {"step": 1}, "the previous checkpoint stays"


def test_an_extra_that_contains_itself_is_refused(tmp_path: Path) -> None:
    loop: list[Any] = [1]
    loop.append({"again": loop})
    with (
        SERVERS["replay"]() as server,
        pytest.raises(ValueError, match=r"extra\[1\]\['again'\] contains itself"),
    ):
        server.checkpoint(tmp_path / "ckpt", extra=loop)
    assert not (tmp_path / "ckpt").exists()


def test_periodic_checkpoints_store_what_the_hook_returns(tmp_path: Path) -> None:
    calls: list[tuple[int, str]] = []
    written = threading.Event()

    def learner_state() -> dict[str, Any]:
        step = len(calls) + 1
        calls.append((step, threading.current_thread().name))
        if step >= 2:
            written.set()
        return {"step": step, "w": np.full((3,), step, np.float32)}

    directory = tmp_path / "periodic"
    server = Server(
        example(),
        2,
        sampler=Uniform(),
        max_size=16,
        checkpoint_dir=directory,
        checkpoint_every=0.01,
        checkpoint_keep=5,
        checkpoint_extra=learner_state,
    )
    with server:
        server.submit(item(0))
        assert written.wait(30), "the hook was called twice"
    assert {name for _, name in calls} == {PeriodicCheckpointer.THREAD_NAME}
    newest = periodic_checkpoints(directory)[-1]
    restored = Server.restore(newest)
    with restored:
        extra = restored.restored_extra
        assert extra["step"] >= 2
        np.testing.assert_array_equal(extra["w"], np.full((3,), extra["step"], np.float32))
    for path in periodic_checkpoints(directory):
        step = read_extra(path)["step"]
        assert step in {s for s, _ in calls}


def test_checkpoint_extra_needs_a_callable_and_periodic_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"checkpoint_extra must be a callable .* got dict"):
        Server(
            example(),
            2,
            checkpoint_dir=tmp_path,
            checkpoint_every=1.0,
            checkpoint_extra={"step": 1},  # pyright: ignore[reportArgumentType]
        )
    with pytest.raises(ValueError, match="checkpoint_extra needs checkpoint_dir"):
        Server(example(), 2, checkpoint_extra=dict)


_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import echo, echo.checkpoint
    from echo import Server, Uniform
    path, stage = sys.argv[1], sys.argv[2]

    def extra(count):
        # The count of samples in the same checkpoint, and arrays derived from it.
        return {"count": count, "params": {"w": np.full((256, 256), count, np.float32)}}

    server = Server({"x": np.zeros((64,), np.uint8)}, 4, sampler=Uniform(), max_size=100_000)
    count = 0
    if stage != "loop":
        for count in range(1, 11):
            server.submit({"x": np.full(64, count % 251, np.uint8)})
        server.checkpoint(path, extra=extra(count))
        for count in range(11, 51):
            server.submit({"x": np.full(64, count % 251, np.uint8)})
        def hook(at):
            if at == stage:
                os.kill(os.getpid(), signal.SIGKILL)
        echo.checkpoint._test_hook = hook
        server.checkpoint(path, extra=extra(count))
        print("not killed", flush=True)
        sys.exit(0)
    while True:  # until the parent kills it, by its pid
        count += 1
        server.submit({"x": np.full(64, count % 251, np.uint8)})
        server.checkpoint(path, extra=extra(count))
        print(count, flush=True)
    """
)


def assert_data_and_extra_agree(path: Path) -> int:
    """Restores `path` and checks its extra describes its data: the count of samples in it."""
    restored = Server.restore(path)
    with restored:
        extra = restored.restored_extra
        count = extra["count"]
        assert restored.stats().store_size == count
        np.testing.assert_array_equal(extra["params"]["w"], np.full((256, 256), count, np.float32))
        stored = np.load(path / "leaf_000.npy")
        np.testing.assert_array_equal(
            stored[:, 0], (np.arange(1, count + 1) % 251).astype(np.uint8)
        )
    assert read_extra(path)["count"] == count
    return count


@pytest.mark.parametrize("stage", ["leaves-written", "extra-written", "before-swap"])
def test_a_process_killed_mid_checkpoint_leaves_the_previous_data_and_extra(
    tmp_path: Path, stage: str
) -> None:
    path = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, str(path), stage],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert assert_data_and_extra_agree(path) == 10, "the first checkpoint, whole"


def test_a_writer_killed_by_pid_in_its_checkpoint_loop_leaves_a_consistent_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), "loop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        done = 0
        while done < 5:
            line = proc.stdout.readline()
            assert line, f"the writer ended early: {proc.stderr.read() if proc.stderr else ''}"
            done = int(line)
        # It is writing checkpoint 6 (or a later one) now: most of its loop is checkpoints.
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert assert_data_and_extra_agree(path) >= 5
