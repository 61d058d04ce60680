"""`Server.restore` and the settings: it keeps the tuning a checkpoint recorded
(`num_drainers`, `producer_queue_size`, the server's `name`), takes every setting that is not
part of the data, and refuses, naming both values, a data setting that differs from the
checkpoint's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.checkpoints import example, item

from echo import (
    Lifo,
    MinSize,
    Prioritized,
    Queue,
    SampleToInsertRatio,
    Sequence,
    Server,
    TcpTransport,
    Uniform,
)


def replay(**kwargs: Any) -> Server:
    return Server(example(), 4, sampler=Prioritized(0.6), max_size=32, seed=3, **kwargs)


def fifo(**kwargs: Any) -> Server:
    return Server(example(), 4, num_buffers=3, **kwargs)


def sequence_table(**kwargs: Any) -> Server:
    return Server(
        {"x": np.zeros((), np.int64)},
        2,
        sampler=Uniform(),
        max_size=64,
        sequence=Sequence(length=3),
        seed=1,
        **kwargs,
    )


KINDS = {"replay": replay, "fifo": fifo, "sequence": sequence_table}


def saved(tmp_path: Path, kind: str, **kwargs: Any) -> Path:
    server = KINDS[kind](**kwargs)
    with server:
        for i in range(6):
            if kind == "sequence":
                server.submit({"x": np.array(i, np.int64)})
            else:
                server.submit(item(i))
        server.checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("kind", KINDS)
def test_restore_keeps_the_tuning_the_checkpoint_recorded(tmp_path: Path, kind: str) -> None:
    path = saved(tmp_path, kind, producer_queue_size=16, num_drainers=2)
    tuning = json.loads((path / "manifest.json").read_text())["tuning"]
    assert tuning == {"num_drainers": 2, "producer_queue_size": 16, "name": "default"}
    with Server.restore(path) as restored:
        assert (restored.producer_queue_size, restored.num_drainers) == (16, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_restore_takes_tuning_over_the_recorded(tmp_path: Path, kind: str) -> None:
    path = saved(tmp_path, kind, producer_queue_size=16, num_drainers=2)
    with Server.restore(path, producer_queue_size=32, num_drainers=5) as restored:
        assert (restored.producer_queue_size, restored.num_drainers) == (32, 5)
        restored.checkpoint(tmp_path / "again")
    tuning = json.loads((tmp_path / "again" / "manifest.json").read_text())["tuning"]
    assert tuning == {"num_drainers": 5, "producer_queue_size": 32, "name": "default"}, (
        "what it runs with"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_restore_keeps_the_name_the_checkpoint_recorded(tmp_path: Path, kind: str) -> None:
    # The name labels the server's metrics (`server="learner-3"`): a restarted learner's
    # series must go on under the same label.
    path = saved(tmp_path, kind, name="learner-3")
    assert json.loads((path / "manifest.json").read_text())["tuning"]["name"] == "learner-3"
    with Server.restore(path) as restored:
        assert restored.name == "learner-3"
        restored.checkpoint(tmp_path / "again")
    with Server.restore(tmp_path / "again") as again:
        assert again.name == "learner-3"


def test_restore_takes_a_name_over_the_recorded(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay", name="learner-3")
    with Server.restore(path, name="learner-4") as restored:
        assert restored.name == "learner-4"
    with pytest.raises(ValueError, match="name must not be empty"):
        Server.restore(path, name="")
    with pytest.raises(TypeError, match="name must be a str, got int"):
        Server.restore(path, name=3)  # type: ignore[arg-type]


def test_a_checkpoint_without_a_name_restores_as_default(tmp_path: Path) -> None:
    path = saved(tmp_path, "fifo", name="learner-3")
    manifest = path.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["tuning"]["name"]  # as written before the name was recorded
    manifest.write_text(json.dumps(data))
    with Server.restore(path) as restored:
        assert restored.name == "default"


def test_an_empty_recorded_name_is_reported(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay")
    manifest = path.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    data["tuning"]["name"] = ""
    manifest.write_text(json.dumps(data))
    with pytest.raises(ValueError, match='tuning: name must be a non-empty string, got ""'):
        Server.restore(path)


def test_the_automatic_queue_size_stays_automatic(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay")
    assert json.loads((path / "manifest.json").read_text())["tuning"]["producer_queue_size"] is None
    with replay() as fresh, Server.restore(path) as restored:
        assert restored.producer_queue_size == fresh.producer_queue_size


def test_a_checkpoint_without_tuning_restores_with_the_defaults(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay", producer_queue_size=16, num_drainers=2)
    manifest = path.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["tuning"]  # as written before the tuning was recorded
    manifest.write_text(json.dumps(data))
    with replay() as fresh, Server.restore(path) as restored:
        assert restored.producer_queue_size == fresh.producer_queue_size
        assert restored.num_drainers == 8
        assert restored.stats().store_size == 6


def test_malformed_tuning_is_reported(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay")
    manifest = path.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    data["tuning"]["num_drainers"] = 0
    manifest.write_text(json.dumps(data))
    expected = r"malformed .*tuning: num_drainers must be an int >= 1, got 0"
    with pytest.raises(ValueError, match=expected):
        Server.restore(path)


def test_restore_takes_the_fifo_ring_size_and_keeps_every_sample(tmp_path: Path) -> None:
    path = saved(tmp_path, "fifo")
    with Server.restore(path) as restored:
        assert restored.num_buffers == 3
    with Server.restore(path, num_buffers=7) as restored:
        assert restored.num_buffers == 7
        ids = []
        for _ in range(6 // 4):
            got = restored.sample(timeout=10)
            assert got is not None
            ids += [int(i) for i in got.batch["extra"]["id"]]
        assert ids == [0, 1, 2, 3]


def test_restore_takes_a_transport_and_periodic_checkpoints(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay")
    restored = Server.restore(
        path,
        transport=TcpTransport(port=0, host="127.0.0.1"),
        checkpoint_dir=tmp_path / "periodic",
        checkpoint_every=3600,
        checkpoint_keep=1,
        checkpoint_extra=dict,
    )
    with restored:
        port = restored.port
        assert isinstance(port, int)
        assert port > 0


# (setting, value given, the checkpoint's value as the message spells it)
CONFLICTS = {
    "replay": [
        ("batch_size", 8, "4"),
        ("max_size", 64, "32"),
        ("sampler", Uniform(), "Prioritized(exponent=0.6)"),
        ("remover", Lifo(), "Fifo()"),
        ("rate_limiter", SampleToInsertRatio(1.0, 2, 10.0), "MinSize(min_size=1)"),
        ("max_times_sampled", 2, "0"),
    ],
    "fifo": [("batch_size", 2, "4"), ("sampler", Uniform(), "Fifo()")],
    "sequence": [("sequence", Sequence(length=4), "Sequence(length=3, "), ("batch_size", 4, "2")],
}


@pytest.mark.parametrize(
    ("kind", "name", "mine", "theirs"),
    [(kind, *conflict) for kind, conflicts in CONFLICTS.items() for conflict in conflicts],
    ids=lambda v: v if isinstance(v, str) else repr(v),
)
def test_a_data_setting_that_differs_from_the_checkpoints_is_refused(
    tmp_path: Path, kind: str, name: str, mine: Any, theirs: str
) -> None:
    path = saved(tmp_path, kind)
    expected = (
        rf"restore\(\): {name}={re.escape(repr(mine))} conflicts with the checkpoint's "
        rf"{name}={re.escape(theirs)}.* omit {name}, or pass "
    )
    with pytest.raises(ValueError, match=expected):
        Server.restore(path, **{name: mine})


@pytest.mark.parametrize(
    ("kind", "name", "mine"),
    [
        ("fifo", "max_size", 64),
        ("fifo", "rate_limiter", Queue(8)),
        ("fifo", "sequence", Sequence(length=3)),
        ("replay", "sequence", Sequence(length=3)),
        ("replay", "num_buffers", 4),
    ],
)
def test_a_setting_the_checkpoints_kind_lacks_is_refused(
    tmp_path: Path, kind: str, name: str, mine: Any
) -> None:
    path = saved(tmp_path, kind)
    with pytest.raises(ValueError, match=rf"restore\(\): {name}=.* does not apply: the checkpoint"):
        Server.restore(path, **{name: mine})


@pytest.mark.parametrize("kind", KINDS)
def test_data_settings_equal_to_the_checkpoints_are_accepted(tmp_path: Path, kind: str) -> None:
    path = saved(tmp_path, kind)
    same: dict[str, Any] = {
        "replay": {
            "batch_size": 4,
            "max_size": 32,
            "sampler": Prioritized(0.6),
            "rate_limiter": MinSize(1),
            "max_times_sampled": 0,
        },
        "fifo": {"batch_size": 4},
        "sequence": {"batch_size": 2, "sequence": Sequence(length=3), "max_size": 64},
    }[kind]
    with Server.restore(path, **same) as restored:
        assert restored.batch_size == same["batch_size"]


def test_tuning_out_of_range_is_refused_as_by_the_constructor(tmp_path: Path) -> None:
    path = saved(tmp_path, "replay")
    with pytest.raises(ValueError, match=r"producer_queue_size must be in \[1, 65536\], got 0"):
        Server.restore(path, producer_queue_size=0)
    with pytest.raises(TypeError, match="num_drainers must be an int, got str"):
        Server.restore(path, num_drainers="4")  # pyright: ignore[reportArgumentType]
