"""Replay tables that store chosen leaves compressed (`Server(compress=, max_bytes=)`), on
real Atari frames (the committed ALE fixture): every leaf bit-exact after submit, sample,
checkpoint and restore for each codec, in-process, over TCP (v1 and v2 clients) and from
shared-memory workers; `max_bytes` eviction order under concurrent inserts and samples; the
stored/raw byte counters; and every bad setting's precise error."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit import atari

import echo
from echo import Server, TcpClient, TcpTransport

LOCALHOST = "127.0.0.1"
CODECS = [echo.Zstd(1), echo.Zstd(-3), echo.Zstd(9), echo.Lz4()]
CODEC_IDS = ["zstd1", "zstd-3", "zstd9", "lz4"]

EXAMPLE = {
    "obs": {"pixels": np.zeros((84, 84, 4), np.uint8)},
    "id": np.zeros((), np.uint64),
    "reward": np.zeros((), np.float32),
}


FRAMES = atari.frames()  # 24 real frames, 84x84 uint8


def _pixels(i: int) -> np.ndarray:
    """Observation `i`: four stacked real frames, with `i` written into its first 8 bytes so
    that every observation differs."""
    return atari.stacked(FRAMES, i, i)


def _step(i: int) -> dict[str, Any]:
    return {"obs": {"pixels": _pixels(i)}, "id": np.uint64(i), "reward": np.float32(i) / 3}


def _rows(lo: int, hi: int) -> dict[str, Any]:
    """Steps `lo` to `hi - 1` as one batch of rows."""
    return {
        "obs": {"pixels": np.stack([_pixels(i) for i in range(lo, hi)])},
        "id": np.arange(lo, hi, dtype=np.uint64),
        "reward": np.arange(lo, hi, dtype=np.float32) / 3,
    }


def _assert_each_once(server: Server, n: int) -> None:
    """Samples until `n` items came out (a table with `max_times_sampled=1`, or a FIFO
    ring): every id below `n` exactly once, every leaf checked."""
    ids: list[int] = []
    while len(ids) < n:
        sample = server.sample(timeout=10)
        assert sample is not None
        ids += _check_batch(sample.batch)
    assert sorted(ids) == list(range(n)), "each sample exactly once"


def _check_batch(batch: dict[str, Any]) -> list[int]:
    ids = [int(i) for i in batch["id"]]
    for row, i in enumerate(ids):
        np.testing.assert_array_equal(batch["obs"]["pixels"][row], _pixels(i), err_msg=f"id {i}")
        assert batch["reward"][row] == np.float32(i) / 3
    return ids


def _replay(make_server: Any, codec: Any = None, **kwargs: Any) -> Server:
    kwargs.setdefault("compress", {"obs/pixels": codec})
    kwargs.setdefault("max_size", 200)
    return make_server(EXAMPLE, 16, sampler=echo.Uniform(), seed=3, **kwargs)


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
def test_each_codec_gives_every_leaf_back_bit_exact(make_server: Any, codec: Any) -> None:
    server = _replay(make_server, codec)
    for i in range(300):
        server.submit(_step(i))
    seen: set[int] = set()
    for _ in range(10):
        sample = server.sample(timeout=5)
        assert sample is not None
        ids = _check_batch(sample.batch)
        assert all(100 <= i < 300 for i in ids), "only the 200 newest are in the table"
        seen.update(ids)
    assert len(seen) > 16
    stats = server.stats()
    assert stats.raw_bytes == 200 * (84 * 84 * 4 + 8 + 4)
    # LZ4 trades about 0.6x of zstd's ratio for faster decompression.
    assert stats.compression_ratio > (4 if isinstance(codec, echo.Lz4) else 8), stats
    assert stats.stored_bytes * stats.compression_ratio == pytest.approx(stats.raw_bytes)
    assert server.compress == {"obs/pixels": dataclasses.replace(codec, force=True)}


def test_a_large_batch_decompresses_on_several_threads_and_matches(make_server: Any) -> None:
    # 256 observations are 7 MiB raw: the table splits them across threads.
    server = make_server(
        EXAMPLE, 256, sampler=echo.Uniform(), max_size=600, compress={"obs": echo.Zstd(1)}
    )
    server.submit_batch(_rows(0, 600))
    for _ in range(3):
        sample = server.sample(timeout=5)
        assert sample is not None
        _check_batch(sample.batch)


@pytest.mark.parametrize("codec", [echo.Zstd(1), echo.Lz4()], ids=["zstd1", "lz4"])
def test_checkpoint_and_restore_keep_every_item_bit_exact(
    make_server: Any, tmp_path: Path, codec: Any
) -> None:
    server = _replay(make_server, codec, max_times_sampled=1, max_bytes=50_000_000)
    for i in range(150):
        server.submit(_step(i))
    server.checkpoint(tmp_path / "ckpt")
    # The observations are written as stored: compressed rows and their lengths.
    root = os.path.realpath(tmp_path / "ckpt")
    manifest = json.loads(Path(root, "manifest.json").read_text())
    assert manifest["format_version"] == 4
    suffix = "zst" if isinstance(codec, echo.Zstd) else "lz4"
    obs_leaf = manifest["layout"]["leaves"][1]
    assert obs_leaf["name"] == "['obs']['pixels']"
    assert obs_leaf["file"] == f"leaf_001.{suffix}"
    assert obs_leaf["codec"] == ["zstd", codec.level] if suffix == "zst" else ["lz4", 0]
    lengths = np.load(Path(root, obs_leaf["lengths"]))
    assert lengths.shape == (150,)
    assert os.path.getsize(Path(root, obs_leaf["file"])) == int(lengths.sum())
    assert lengths.sum() * 4 < 150 * 84 * 84 * 4, "compressed on disk too"
    for again in (None, {"obs": echo.Lz4()}, {}):
        restored = Server.restore(tmp_path / "ckpt", EXAMPLE, compress=again)
        try:
            expected = server.compress if again is None else {"obs/pixels": echo.Lz4(force=True)}
            assert restored.compress == (expected if again != {} else {})
            assert restored.max_bytes == 50_000_000
            ids: list[int] = []
            while len(ids) < 144:
                sample = restored.sample(timeout=5)
                assert sample is not None
                ids += _check_batch(sample.batch)
            assert sorted(ids) == sorted(set(ids)), "max_times_sampled=1: each item once"
            assert set(ids) <= set(range(150))
        finally:
            restored.close()


@pytest.mark.skipif(sys.platform != "linux", reason="shared memory is Linux-only")
def test_tcp_v1_v2_and_shared_memory_workers_feed_a_compressing_table(make_server: Any) -> None:
    server = _replay(
        make_server,
        echo.Zstd(1),
        max_size=2000,
        max_times_sampled=1,
        transport=TcpTransport(port=0, host=LOCALHOST),
    )
    server.start()
    workers = [
        {"protocol": 1},
        {"protocol": 2, "shared_memory": False},
        {"protocol": 2, "shared_memory": True},
    ]
    per_worker = 128  # 3 * 128 items: 24 whole batches of 16
    for w, options in enumerate(workers):
        with TcpClient(LOCALHOST, server.port, EXAMPLE, **options) as client:
            for i in range(w * per_worker, (w + 1) * per_worker):
                client.send(_step(i))
            client.wait(timeout=30)
    _assert_each_once(server, len(workers) * per_worker)
    assert server.stats().shm_connections_total == 1


def _live_keys(server: Server, inserted: int) -> list[int]:
    """The keys (insertion numbers) of the items in the table."""
    core = server._core  # pyright: ignore[reportPrivateUsage]
    return [k for k in range(inserted) if core.priority(k) is not None]


def test_max_bytes_evicts_the_oldest_until_a_new_item_fits(make_server: Any) -> None:
    probe = _replay(make_server, echo.Zstd(1))
    for i in range(len(FRAMES)):  # one cycle of the frame pool: the mean item size
        probe.submit(_step(i))
    per_item = probe.stats().stored_bytes // len(FRAMES)
    max_bytes = 30 * per_item
    server = _replay(make_server, echo.Zstd(1), max_size=10_000, max_bytes=max_bytes)
    assert server.max_bytes == max_bytes
    for i in range(400):
        server.submit(_step(i))
        assert server.stats().stored_bytes <= max_bytes
    live = _live_keys(server, 400)
    assert live == list(range(live[0], 400)), "the newest items, none missing"
    assert 15 <= len(live) <= 60, f"{len(live)} items of about {per_item} bytes"
    stats = server.stats()
    assert stats.evicted_total == 400 - len(live) == live[0]


def test_max_bytes_holds_under_concurrent_inserts_and_samples(make_server: Any) -> None:
    max_bytes = 400_000
    server = _replay(make_server, echo.Zstd(1), max_size=10_000, max_bytes=max_bytes)
    writers, per_writer = 4, 150
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(w: int) -> None:
        try:
            for i in range(w * per_writer, (w + 1) * per_writer):
                server.submit(_step(i), timeout=10)
        except BaseException as err:  # noqa: BLE001 -- reported by the main thread
            errors.append(err)

    def read() -> None:
        try:
            for _ in range(10_000):
                if stop.is_set():
                    return
                sample = server.sample(timeout=10)
                assert sample is not None
                _check_batch(sample.batch)
        except BaseException as err:  # noqa: BLE001 -- reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    server.submit(_step(writers * per_writer))  # one item, so the reader can start at once
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    reader.join(60)
    assert not errors, errors
    inserted = writers * per_writer + 1
    stats = server.stats()
    assert stats.stored_bytes <= max_bytes
    assert stats.evicted_total + stats.store_size == inserted
    live = _live_keys(server, inserted)
    assert live == list(range(live[0], inserted)), "FIFO eviction by key, none missing"


def test_auto_and_a_bare_codec_pick_the_large_byte_leaves() -> None:
    example = {
        "pixels": np.zeros((84, 84), np.uint8),  # 7 KiB uint8: picked
        "small": np.zeros((64,), np.uint8),  # under 4 KiB: not
        "depth": np.zeros((84, 84), np.float32),  # float: not
        "nested": [np.zeros((64, 64), np.int8)],  # 4 KiB int8: picked
    }
    for compress, codec in (("auto", echo.Zstd(1, force=True)), (echo.Lz4(), echo.Lz4(True))):
        server = Server(example, 2, sampler=echo.Uniform(), max_size=8, compress=compress)
        try:
            assert server.compress == {"pixels": codec, "nested/0": codec}
        finally:
            server.close()


@pytest.mark.parametrize(
    ("compress", "error", "match"),
    [
        ({"nope": echo.Zstd()}, ValueError, r"no leaf at path 'nope'.*\['obs'\]\['pixels'\]"),
        ({"reward": echo.Zstd()}, ValueError, r"reward.*float32.*force=True"),
        ({"obs": 3}, TypeError, r"compress\['obs'\] must be echo.Zstd"),
        ("fast", ValueError, r'"auto", a codec or a mapping'),
        (3, TypeError, r"compress must be a mapping"),
    ],
)
def test_bad_compress_settings_raise_precise_errors(
    compress: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Server(EXAMPLE, 4, sampler=echo.Uniform(), max_size=8, compress=compress)


def test_force_allows_a_float_leaf_and_paths_may_be_tuples(make_server: Any) -> None:
    server = _replay(
        make_server,
        compress={("obs", "pixels"): echo.Lz4(), "reward": echo.Zstd(3, force=True)},
    )
    assert server.compress == {"obs/pixels": echo.Lz4(True), "reward": echo.Zstd(3, True)}
    for i in range(40):
        server.submit(_step(i))
    sample = server.sample(timeout=5)
    assert sample is not None
    _check_batch(sample.batch)


@pytest.mark.parametrize(
    ("level", "error"), [(0, ValueError), (23, ValueError), (-8, ValueError), (1.5, TypeError)]
)
def test_bad_levels_raise(level: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Zstd\(level\)"):
        echo.Zstd(level)
    with pytest.raises(TypeError, match=r"Lz4\(force\)"):
        echo.Lz4(force=1)  # pyright: ignore[reportArgumentType]


def test_fifo_and_sequence_servers_refuse_what_does_not_apply() -> None:
    with pytest.raises(ValueError, match=r"max_bytes needs a replay sampler"):
        Server(EXAMPLE, 4, max_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"max_bytes must be >= 1"):
        Server(EXAMPLE, 4, sampler=echo.Uniform(), max_size=8, max_bytes=0)


def test_stats_of_uncompressed_servers_report_raw_bytes_twice(make_server: Any) -> None:
    server = make_server(EXAMPLE, 4, sampler=echo.Uniform(), max_size=8)
    for i in range(3):
        server.submit(_step(i))
    stats = server.stats()
    assert stats.stored_bytes == stats.raw_bytes == 3 * (84 * 84 * 4 + 12)
    assert stats.compression_ratio == 1.0


# --- on the wire ---------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", [None, echo.Uniform()], ids=["fifo", "replay"])
def test_tcp_workers_compress_what_the_server_names_unless_told_not_to(
    make_server: Any, sampler: Any
) -> None:
    # Room for every sample (5 workers x 32) before the learner reads: the ring of 16 batches.
    replay: dict[str, Any] = {"num_buffers": 16}
    if sampler is not None:
        replay = {"sampler": sampler, "max_size": 1000, "max_times_sampled": 1}
    server = make_server(
        EXAMPLE,
        16,
        transport=TcpTransport(port=0, host=LOCALHOST),
        compress={"obs": echo.Lz4()},
        **replay,
    )
    server.start()
    if sampler is None:  # FIFO: compressed on the wire only, stored raw
        assert server.compress == {"obs/pixels": echo.Lz4(True)}
    options: list[dict[str, Any]] = [
        {"shared_memory": False},
        {"shared_memory": False, "reconnect": True},
        {"shared_memory": False, "wire_compression": False},
        {"protocol": 1},
    ]
    if sys.platform == "linux":
        options.append({"shared_memory": True})
    expected = [
        {"obs/pixels": echo.Lz4(True)},
        {"obs/pixels": echo.Lz4(True)},
        {},
        {},
        {},
    ]
    per = 32
    for w, (opts, leaves) in enumerate(zip(options, expected, strict=False)):
        with TcpClient(LOCALHOST, server.port, EXAMPLE, **opts) as client:
            assert client.wire_compression_leaves == leaves, opts
            half = w * per + per // 2
            for i in range(w * per, half):
                client.send(_step(i))
            client.send_batch(_rows(half, (w + 1) * per))
            client.wait(timeout=30)
    _assert_each_once(server, len(options) * per)
    # The two workers that compressed sent every sample compressed, in far fewer bytes.
    stats = server.stats()
    assert stats.samples_received_compressed_total == 2 * per
    raw = 2 * per * 84 * 84 * 4
    assert 0 < stats.compressed_bytes_received_total < raw / 4


def test_wire_compression_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="wire_compression"):
        TcpClient(LOCALHOST, 1, EXAMPLE, wire_compression="yes")  # pyright: ignore[reportArgumentType]


def test_an_uncompressed_table_still_writes_the_format_every_echo_reads(
    make_server: Any, tmp_path: Path
) -> None:
    server = make_server(EXAMPLE, 4, sampler=echo.Uniform(), max_size=8)
    for i in range(5):
        server.submit(_step(i))
    server.checkpoint(tmp_path / "ckpt")
    manifest = json.loads(Path(os.path.realpath(tmp_path / "ckpt"), "manifest.json").read_text())
    assert manifest["format_version"] == 3
    assert all("codec" not in leaf for leaf in manifest["layout"]["leaves"])
    restored = Server.restore(tmp_path / "ckpt", EXAMPLE, compress={"obs": echo.Zstd(1)})
    try:
        sample = restored.sample(timeout=5)
        assert sample is not None
        _check_batch(sample.batch)
        assert restored.stats().compression_ratio > 4
    finally:
        restored.close()
