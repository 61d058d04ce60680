"""Sequence tables that store chosen leaves compressed per chunk of one stream's steps
(`Server(sequence=..., compress=..., max_bytes=...)`), on real Atari frames (the committed ALE
fixture): every step of every window bit-exact after submit, sample, checkpoint and restore
for each codec, in-process, over TCP (v1, v2 with and without wire compression) and from
shared-memory workers; `max_bytes` eviction (oldest steps first); the stored/raw counters."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import poll
from testkit import atari

import echo
from echo import Server, TcpClient, TcpTransport

LOCALHOST = "127.0.0.1"
LENGTH, PERIOD = 8, 4

EXAMPLE = {
    "obs": np.zeros((84, 84, 4), np.uint8),
    "id": np.zeros((), np.int64),
    "reward": np.zeros((), np.float32),
}


FRAMES = atari.frames()  # 24 real frames, 84x84 uint8


def step_id(stream: int, episode: int, index: int) -> int:
    return stream * 10**6 + episode * 10**3 + index


def _obs(uid: int) -> np.ndarray:
    """The observation of step `uid`: four consecutive real frames (as a frame stack moves on
    by one each step), `uid` in its first 8 bytes so that every step differs."""
    return atari.stacked(FRAMES, uid % 997 + uid // 10**6 * 5, uid)


def _step(uid: int) -> dict[str, Any]:
    return {"obs": _obs(uid), "id": np.int64(uid), "reward": np.float32(uid) / 7}


def _windows(sample: echo.Sample) -> list[list[int]]:
    """The ids of every window's real steps, each step's leaves checked bit for bit, the
    padding checked to be zeros."""
    batch, mask = sample.batch, sample.mask
    assert mask is not None
    out = []
    for w in range(mask.shape[0]):
        real = int(mask[w].sum())
        ids = [int(x) for x in batch["id"][w, :real]]
        for j, uid in enumerate(ids):
            np.testing.assert_array_equal(batch["obs"][w, j], _obs(uid), err_msg=f"step {uid}")
            assert batch["reward"][w, j] == np.float32(uid) / 7
        assert ids == list(range(ids[0], ids[0] + real)), f"consecutive steps: {ids}"
        assert not batch["obs"][w, real:].any(), "padding is zeros"
        assert not batch["id"][w, real:].any(), "padding is zeros"
        out.append(ids)
    return out


def _sequence(make_server: Any, codec: Any, batch_size: int = 16, **kwargs: Any) -> Server:
    kwargs.setdefault("max_size", 5000)
    return make_server(
        EXAMPLE,
        batch_size,
        sampler=kwargs.pop("sampler", echo.Uniform()),
        seed=5,
        sequence=echo.Sequence(LENGTH, period=PERIOD, at_end="pad"),
        compress={"obs": codec},
        **kwargs,
    )


def _submit_episodes(server: Server, streams: int, episodes: int, length: int = 30) -> int:
    """Interleaves `streams` streams' episodes (the last one of each left open)."""
    n = 0
    for e in range(episodes):
        for i in range(length):
            for k in range(streams):
                last = i + 1 == length and e + 1 < episodes
                server.submit(_step(step_id(k, e, i)), stream=k, end_episode=last)
                n += 1
    return n


@pytest.mark.parametrize("codec", [echo.Zstd(1), echo.Zstd(-3), echo.Lz4()], ids=str)
def test_each_codec_gives_every_step_back_bit_exact(make_server: Any, codec: Any) -> None:
    server = _sequence(make_server, codec)
    n = _submit_episodes(server, streams=3, episodes=4)
    starts = set()
    for _ in range(12):
        sample = server.sample(timeout=5)
        assert sample is not None
        starts.update(ids[0] for ids in _windows(sample))
    assert len(starts) > 40, "windows from packed and from filling chunks"
    # Full chunks are packed by background threads: the ratio reaches its level once they
    # have caught up.
    least = 4 if isinstance(codec, echo.Lz4) else 8
    stats = poll(server.stats, lambda s: s.compression_ratio > least, "packed chunks")
    assert stats.raw_bytes == n * (84 * 84 * 4 + 8 + 4)
    assert server.compress == {"obs": dataclasses.replace(codec, force=True)}


def test_a_large_batch_decompresses_on_several_threads_and_matches(make_server: Any) -> None:
    # 128 windows of 8 steps read up to 256 chunks: 29 MiB raw, split across threads.
    server = _sequence(make_server, echo.Zstd(1), batch_size=128)
    _submit_episodes(server, streams=4, episodes=2, length=60)
    for _ in range(2):
        sample = server.sample(timeout=5)
        assert sample is not None
        _windows(sample)


@pytest.mark.parametrize("codec", [echo.Zstd(1), echo.Lz4()], ids=str)
def test_checkpoint_and_restore_keep_every_window_bit_exact(
    make_server: Any, tmp_path: Path, codec: Any
) -> None:
    def drain(server: Server) -> list[list[int]]:
        out: list[list[int]] = []
        while server.stats().store_size:
            sample = server.sample(timeout=5)
            assert sample is not None
            out += _windows(sample)
        return sorted(out)

    kwargs: dict[str, Any] = {"sampler": echo.Lifo(), "max_times_sampled": 1}
    server = _sequence(make_server, codec, batch_size=1, max_bytes=20_000_000, **kwargs)
    _submit_episodes(server, streams=2, episodes=3, length=21)
    server.checkpoint(tmp_path / "ckpt")
    # The observations are written as stored: a compressed row per chunk, and their lengths.
    root = os.path.realpath(tmp_path / "ckpt")
    manifest = json.loads(Path(root, "manifest.json").read_text())
    named = ["zstd", codec.level] if isinstance(codec, echo.Zstd) else ["lz4", 0]
    assert manifest["tuning"]["compress"][1] == named
    assert manifest["format_version"] == 4
    obs_leaf = manifest["layout"]["leaves"][1]
    assert obs_leaf["name"] == "['obs']"
    assert obs_leaf["file"] == f"leaf_001.{'zst' if named[0] == 'zstd' else 'lz4'}"
    assert obs_leaf["codec"] == named
    lengths = np.load(Path(root, obs_leaf["lengths"]))
    assert lengths.shape == (manifest["counts"]["chunks"],)
    assert os.path.getsize(Path(root, obs_leaf["file"])) == int(lengths.sum())
    steps = manifest["counts"]["items"]
    assert lengths.sum() * 4 < steps * 84 * 84 * 4, "compressed on disk too"
    expected = drain(server)
    assert len(expected) > 20
    for again in (None, {"obs": echo.Zstd(3)}, {}):
        restored = Server.restore(tmp_path / "ckpt", EXAMPLE, compress=again)
        try:
            chosen = {"obs": codec} if again is None else again
            assert restored.compress == {
                path: dataclasses.replace(c, force=True) for path, c in chosen.items()
            }
            assert restored.max_bytes == 20_000_000
            assert drain(restored) == expected
            # Open episodes go on after the restore: the newest window (steps 20 to 27)
            # spans a restored step and new ones.
            for i in range(21, 21 + LENGTH):
                restored.submit(_step(step_id(0, 2, i)), stream=0)
            sample = restored.sample(timeout=5)
            assert sample is not None
            assert _windows(sample)[0][0] == step_id(0, 2, 20)
        finally:
            restored.close()


def test_max_bytes_keeps_the_newest_steps_in_the_memory_it_names(make_server: Any) -> None:
    step_bytes = 84 * 84 * 4 + 12
    server = _sequence(
        make_server, echo.Zstd(1), max_size=100_000, max_bytes=100 * step_bytes, batch_size=32
    )
    n = 2000
    for i in range(n):
        server.submit(_step(step_id(0, 0, i)), stream=0)
        assert server.stats().stored_bytes <= 100 * step_bytes
    stats = server.stats()
    assert stats.steps_stored > 5 * 100, f"compressed chunks hold more than 100 raw steps: {stats}"
    oldest = n - stats.steps_stored
    for _ in range(10):
        sample = server.sample(timeout=5)
        assert sample is not None
        assert all(ids[0] >= oldest for ids in _windows(sample)), "the oldest went first"


def test_max_bytes_below_one_window_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_bytes must hold one window of raw steps"):
        Server(
            EXAMPLE,
            4,
            sampler=echo.Uniform(),
            max_size=64,
            sequence=echo.Sequence(LENGTH),
            compress="auto",
            max_bytes=84 * 84 * 4 * 4,
        )


@pytest.mark.skipif(sys.platform != "linux", reason="shared memory is Linux-only")
def test_tcp_v1_v2_and_shared_memory_workers_feed_a_compressing_table(make_server: Any) -> None:
    server = _sequence(
        make_server,
        echo.Zstd(1),
        batch_size=1,
        sampler=echo.Lifo(),
        max_times_sampled=1,
        transport=TcpTransport(port=0, host=LOCALHOST),
    )
    server.start()
    workers: list[dict[str, Any]] = [
        {"protocol": 1},
        {"protocol": 2, "shared_memory": False},
        {"protocol": 2, "shared_memory": False, "wire_compression": False},
        {"protocol": 2, "shared_memory": True},
    ]
    steps = 3 * LENGTH  # one episode per worker, whole windows at 0, 4, ..., 16
    for w, options in enumerate(workers):
        with TcpClient(LOCALHOST, server.port, EXAMPLE, **options) as client:
            compressed = options.get("protocol") == 2 and options.get("wire_compression", True)
            compressed = compressed and not options.get("shared_memory")
            assert set(client.wire_compression_leaves) == ({"obs"} if compressed else set())
            for i in range(steps):
                client.send(_step(step_id(w, 0, i)), end_episode=w != 0 and i + 1 == steps)
            client.wait(timeout=30)
    got: list[list[int]] = []
    expected_windows = sum(len(range(0, steps, PERIOD)) for _ in workers)
    while len(got) < expected_windows:
        sample = server.sample(timeout=10)
        assert sample is not None
        got += _windows(sample)
    for w in range(len(workers)):
        starts = sorted(ids[0] - step_id(w, 0, 0) for ids in got if ids[0] // 10**6 == w)
        assert starts == list(range(0, steps, PERIOD)), (w, starts)
    assert server.stats().samples_received_compressed_total == steps
