"""The fast paths of single-sample inserts keep every guarantee of the checked ones.

`Server.submit` is the native method itself on an instance, so the native side checks its
arguments exactly as the documented Python API does. Leaves that are plain C-contiguous
ndarrays of the example's dtype are read where they lie; anything else (a strided view, an
ndarray subclass, another byte order) takes the full check, as before. A dict changed by
another thread while its insert waits for room is stored as it was given: the insert holds
its leaves until the copy is done."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import echo
from echo import Server

EXAMPLE = {"obs": np.zeros(6, np.float32), "action": np.zeros((), np.int64)}


def sample_of(i: int) -> dict[str, np.ndarray]:
    return {"obs": np.arange(6, dtype=np.float32) + i, "action": np.asarray(i, np.int64)}


def test_submit_checks_its_arguments_as_the_python_api_documents() -> None:
    s = Server(EXAMPLE, 2, sequence=echo.Sequence(2), sampler=echo.Uniform(), max_size=64)
    assert type(s).submit is Server.submit
    # numpy integers are ints (they have __index__), as they were for the Python check.
    s.submit(sample_of(0), stream=np.int64(3))
    s.submit(sample_of(1), stream=np.uint8(3), end_episode=True)
    assert s.stats().steps_inserted_total == 2
    with pytest.raises(TypeError, match=r"^stream must be an int, got bool$"):
        s.submit(sample_of(2), stream=True)
    with pytest.raises(TypeError, match=r"^stream must be an int, got float$"):
        s.submit(sample_of(2), stream=1.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"^stream must be >= 0, got -3$"):
        s.submit(sample_of(2), stream=-3)
    with pytest.raises(TypeError, match=r"^truncated must be a bool, got str$"):
        s.submit(sample_of(2), truncated="yes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"^end_episode must be a bool, got numpy.bool$"):
        s.submit(sample_of(2), end_episode=np.bool_(True))  # pyright: ignore[reportArgumentType]
    # timeout and the rest are keyword-only, as the signature says.
    with pytest.raises(TypeError):
        s.submit(sample_of(2), 1.0)  # pyright: ignore[reportCallIssue]
    assert s.stats().steps_inserted_total == 2
    # Called through the class, it is the same call.
    Server.submit(s, sample_of(2), stream=1, end_episode=True)
    assert s.stats().steps_inserted_total == 3
    s.close()


def test_a_subclass_that_overrides_submit_keeps_its_own() -> None:
    calls: list[int] = []

    class Counting(Server):
        def submit(self, sample: object, **kwargs: object) -> None:  # type: ignore[override]
            calls.append(1)
            super().submit(sample, **kwargs)  # pyright: ignore[reportArgumentType]

    with Counting(EXAMPLE, 1) as s:
        s.submit(sample_of(4))
        assert calls == [1]
        batch, _ = s.sample(timeout=5)
        assert int(batch["action"][0]) == 4


def test_leaves_the_fast_path_does_not_take_are_checked_and_copied_as_before() -> None:
    class Tagged(np.ndarray):
        pass

    with Server(EXAMPLE, 4) as s:
        writer = s.writer()  # leaves: action, obs
        strided = (np.arange(12, dtype=np.float32) + 10)[::2]
        s.submit({"obs": strided, "action": np.asarray(1, np.int64)})
        s.submit({"obs": np.arange(6, dtype=np.float32).view(Tagged) + 20, "action": np.int64(2)})
        writer(np.asarray(3, np.int64), strided + 20)
        writer(np.asarray(4, np.int64).view(Tagged), np.arange(6, dtype=np.float32) + 40)
        batch, _ = s.sample(timeout=5)
        np.testing.assert_array_equal(batch["action"], [1, 2, 3, 4])
        np.testing.assert_array_equal(batch["obs"][0], np.arange(10, 22, 2, dtype=np.float32))
        np.testing.assert_array_equal(batch["obs"][1], np.arange(6) + 20)
        np.testing.assert_array_equal(batch["obs"][2], np.arange(30, 42, 2, dtype=np.float32))
        np.testing.assert_array_equal(batch["obs"][3], np.arange(6) + 40)
        # The same bytes in another byte order are another dtype, on either path.
        swapped = np.arange(6, dtype=">f4")
        with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected dtype float32, got >f4"):
            s.submit({"obs": swapped, "action": np.asarray(5, np.int64)})
        with pytest.raises(TypeError, match=r"leaf \['obs'\]: expected dtype float32, got >f4"):
            writer(np.asarray(5, np.int64), swapped)
        wrong_shape = r"leaf \['obs'\]: expected shape \(6,\), got \(1, 6\)"
        with pytest.raises(ValueError, match=wrong_shape):
            s.submit({"obs": np.zeros((1, 6), np.float32), "action": np.asarray(5, np.int64)})
        with pytest.raises(ValueError, match=r"leaf \['action'\]: expected shape \(\), got \(1,\)"):
            writer(np.zeros(1, np.int64), np.zeros(6, np.float32))
        assert s.stats().samples_submitted_total == 4


def test_a_dict_changed_while_its_insert_waits_is_stored_as_it_was_given() -> None:
    # Leaves of 1 MiB: copied with the GIL released, from memory that is unmapped when freed,
    # so a copy from leaves the insert did not hold would read unmapped pages.
    big = {"obs": np.zeros(1 << 18, np.float32), "action": np.zeros((), np.int64)}

    def make(i: int) -> dict[str, np.ndarray]:
        return {"obs": np.full(1 << 18, i, np.float32), "action": np.asarray(i, np.int64)}

    with Server(big, 1, num_buffers=2) as s:
        s.submit(make(0))
        s.submit(make(1))
        sample = make(2)
        errors: list[BaseException] = []

        def blocked() -> None:
            try:
                s.submit(sample, timeout=30)
            except BaseException as err:  # noqa: BLE001 - reported by the test
                errors.append(err)

        thread = threading.Thread(target=blocked)
        thread.start()
        deadline = time.monotonic() + 10
        while s._core._waiting()[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.is_alive()
        # Replaced and dropped: the dict no longer holds the arrays the insert was given.
        sample["obs"] = np.full(1 << 18, -1, np.float32)
        sample["action"] = np.asarray(-1, np.int64)
        gc.collect()
        got = []
        for _ in range(3):
            batch, _ = s.sample(timeout=10)
            obs = batch["obs"][0]
            got.append((int(batch["action"][0]), float(obs.min()), float(obs.max())))
        thread.join(10)
        assert not errors
        assert got == [(0, 0.0, 0.0), (1, 1.0, 1.0), (2, 2.0, 2.0)]
