"""Checkpoints keep the published parameters: `Server.checkpoint` stores the latest version
`publish()` published (explicit and periodic checkpoints alike), `Server.restore` publishes it
again with the same version, so workers of a restarted learner fetch what they fetched before,
bit for bit; a checkpoint taken before any publish restores with none."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, poll
from test_params import EXAMPLE, LOCALHOST, digest, params_of

from echo import Server, TcpClient, TcpTransport, Uniform
from echo import checkpoint as ckpt
from echo.checkpoint import periodic_checkpoints


def learner(port: int = 0, **options: Any) -> Server:
    return Server(
        EXAMPLE,
        4,
        sampler=Uniform(),
        max_size=64,
        transport=TcpTransport(port=port, host=LOCALHOST),
        **options,
    )


def restored(path: Path, port: int = 0) -> Server:
    return Server.restore(path, transport=TcpTransport(port=port, host=LOCALHOST))


def test_a_restored_learner_serves_the_checkpointed_version_bit_for_bit(tmp_path: Path) -> None:
    extra = {"step": 700, "opt": np.arange(5, dtype=np.float32)}
    with learner() as old:
        old.publish(params_of(1))
        old.publish(params_of(7), version=7)
        old.checkpoint(tmp_path / "ckpt", extra=extra)
    # The extra's tree is the learner's extra alone: an echo that predates the parameters
    # restores it unchanged and ignores their files.
    tree = json.loads((tmp_path / "ckpt" / "extra.json").read_text())
    assert tree == json.loads(ckpt.encode_extra(extra)[0])
    version, leaves = ckpt.read_params(tmp_path / "ckpt") or (0, {})
    assert version == 7
    assert list(leaves) == ["['layer']['b']", "['layer']['w']", "['steps']"]
    with restored(tmp_path / "ckpt") as new:
        assert new.params_version == 7
        assert new.restored_extra["step"] == 700
        np.testing.assert_array_equal(new.restored_extra["opt"], extra["opt"])
        worker = TcpClient(LOCALHOST, new.port, EXAMPLE, params_example=params_of(0))
        version, got = worker.params(timeout=WAIT_S)
        assert (version, digest(got)) == (7, digest(params_of(7)))
        assert got["layer"]["b"].dtype == np.float64
        # The next publish goes on from the checkpoint's version, with its leaves.
        bad = params_of(8)
        bad["steps"] = bad["steps"].astype(np.int64)
        with pytest.raises(TypeError, match=r"leaf \['steps'\]: expected dtype int32 \(the che"):
            new.publish(bad)
        with pytest.raises(ValueError, match="restored from the checkpoint have 3"):
            new.publish({"layer": params_of(8)["layer"]})
        assert new.publish(params_of(8)) == 8
        version, got = worker.params(min_version=8, timeout=WAIT_S)
        assert (version, digest(got)) == (8, digest(params_of(8)))
        # Checkpointed again, the restored server stores its own latest.
        new.checkpoint(tmp_path / "again")
        assert worker.close(timeout=WAIT_S)
    version, leaves = ckpt.read_params(tmp_path / "again") or (0, {})
    assert version == 8
    assert ckpt.read_extra(tmp_path / "again") is None
    np.testing.assert_array_equal(leaves["['layer']['w']"], params_of(8)["layer"]["w"])


def test_a_checkpoint_taken_before_any_publish_restores_with_no_parameters(
    tmp_path: Path,
) -> None:
    with learner() as old:
        old.submit({"id": np.array(3, np.int64)})
        old.checkpoint(tmp_path / "ckpt")
    assert ckpt.read_params(tmp_path / "ckpt") is None
    with restored(tmp_path / "ckpt") as new:
        assert new.params_version == 0
        assert new.stats().store_size == 1
        worker = TcpClient(LOCALHOST, new.port, EXAMPLE, params_example=params_of(0))
        with pytest.raises(TimeoutError):
            worker.params(timeout=0.2)
        assert new.publish(params_of(2, rows=8)) == 1  # any layout: none was fixed
        worker.close()


def test_periodic_checkpoints_keep_the_latest_published_version(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    with learner(checkpoint_dir=directory, checkpoint_every=0.05) as old:
        old.publish(params_of(3), version=3)

        def newest_version() -> int:
            found = periodic_checkpoints(directory)
            params = ckpt.read_params(found[-1]) if found else None
            return 0 if params is None else params[0]

        poll(newest_version, lambda v: v == 3, "a periodic checkpoint with version 3")
        old.publish(params_of(5), version=5)
        poll(newest_version, lambda v: v == 5, "a periodic checkpoint with version 5")
    with restored(Path(periodic_checkpoints(directory)[-1])) as new:
        assert new.params_version == 5


def test_a_reconnecting_worker_hears_the_restarted_learners_version(tmp_path: Path) -> None:
    """The learner checkpoints, closes saying it comes back, and a new one is restored on the
    same port: the worker reconnects and sees the checkpoint's version without a publish."""
    old = learner()
    old.start()
    port = old.port
    assert port is not None
    worker = TcpClient(LOCALHOST, port, EXAMPLE, params_example=params_of(0), reconnect=True)
    old.publish(params_of(4), version=4)
    assert worker.params(min_version=4, timeout=WAIT_S)[0] == 4
    old.checkpoint(tmp_path / "ckpt")
    old.close(restarting=True)
    time.sleep(0.1)  # the worker notices the learner has gone
    with restored(tmp_path / "ckpt", port) as new:
        assert new.params_version == 4
        worker.send({"id": np.array(9, np.int64)}, timeout=WAIT_S)
        worker.wait(timeout=WAIT_S)  # reconnected
        assert poll(lambda: worker.params_version, lambda v: v == 4, "the version notice") == 4
        version, got = worker.params(min_version=4, timeout=WAIT_S)
        assert (version, digest(got)) == (4, digest(params_of(4)))
        new.publish(params_of(5))
        assert worker.params(min_version=5, timeout=WAIT_S)[0] == 5
        assert worker.close(timeout=WAIT_S)


def test_a_worker_without_an_example_learns_the_restored_parameters_structure(
    tmp_path: Path,
) -> None:
    with learner() as old:
        old.publish(params_of(4), version=4)
        old.checkpoint(tmp_path / "ckpt")
    with restored(tmp_path / "ckpt") as new:
        bare = TcpClient(LOCALHOST, new.port, EXAMPLE)
        version, got = bare.params(timeout=WAIT_S)
        assert version == 4
        assert digest(got) == digest(params_of(4))
        bare.close()
