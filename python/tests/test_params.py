"""Parameters down: `Server.publish` and `TcpClient.params()` over TCP and same-host shared
memory. Every fetched copy is bit for bit the version it says (a hash per version), versions
never go back while the learner publishes and workers fetch at once, and bad input gets the
precise error with nothing published."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, poll

from echo import ConnectionClosedError, Lz4, Server, TcpClient, TcpTransport, Zstd

LOCALHOST = "127.0.0.1"
EXAMPLE = {"id": np.zeros((), np.int64)}


def params_of(version: int, rows: int = 64) -> dict[str, Any]:
    """A nested pytree of three dtypes whose every element depends on `version`."""
    rng = np.random.default_rng(version)
    return {
        "layer": {
            "w": rng.standard_normal((rows, 256), dtype=np.float32),
            "b": np.full(256, version, np.float64),
        },
        "steps": np.array([version, -version], np.int32),
    }


def digest(tree: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for leaf in (tree["layer"]["w"], tree["layer"]["b"], tree["steps"]):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def server() -> Server:
    return Server(EXAMPLE, 4, num_buffers=4, transport=TcpTransport(port=0, host=LOCALHOST))


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_a_worker_gets_the_published_parameters_bit_for_bit_in_their_structure(path: str) -> None:
    with server() as learner:
        assert learner.params_version == 0
        client = TcpClient(
            LOCALHOST,
            learner.port,
            EXAMPLE,
            params_example=params_of(0),
            shared_memory=path == "shm",
        )
        assert client.transport_path == path
        assert client.params_version == 0
        assert learner.publish(params_of(1)) == 1
        version, got = client.params(timeout=WAIT_S)
        assert version == 1
        assert digest(got) == digest(params_of(1))
        assert got["layer"]["w"].dtype == np.float32
        assert got["layer"]["w"].shape == (64, 256)
        assert learner.publish(params_of(7), version=7) == 7
        poll(lambda: client.params_version, lambda v: v == 7, "the version notice")
        version, newer = client.params(min_version=7, timeout=WAIT_S)
        assert (version, digest(newer)) == (7, digest(params_of(7)))
        # The first copy is the caller's own: unchanged by the next fetch.
        assert digest(got) == digest(params_of(1))
        client.send({"id": np.array(5, np.int64)}, timeout=WAIT_S)  # samples go on as before
        client.wait(timeout=WAIT_S)
        assert client.close(timeout=WAIT_S)


def test_a_version_not_yet_published_is_waited_for_until_the_timeout() -> None:
    with server() as learner:
        client = TcpClient(LOCALHOST, learner.port, EXAMPLE, params_example=params_of(0))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"params\(\): no version of the parameters"):
            client.params(timeout=0.3)
        assert time.monotonic() - started >= 0.3
        learner.publish(params_of(1))
        publisher = threading.Timer(0.2, lambda: learner.publish(params_of(2)))
        publisher.start()
        version, got = client.params(min_version=2, timeout=WAIT_S)
        publisher.join()
        assert (version, digest(got)) == (2, digest(params_of(2)))
        client.close()


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_workers_fetching_while_the_learner_publishes_never_see_a_torn_or_older_version(
    path: str,
) -> None:
    """8 workers fetch 2 MB of parameters in a loop while the learner publishes a new version
    every 20 ms (50 versions): every copy's hash is its version's, and each worker's versions
    never go back."""
    rows = 2048  # 2 MB of float32 weights: two chunks
    expected = {v: digest(params_of(v, rows)) for v in range(1, 51)}
    with server() as learner:
        learner.publish(params_of(1, rows))
        clients = [
            TcpClient(
                LOCALHOST,
                learner.port,
                EXAMPLE,
                params_example=params_of(0, rows),
                shared_memory=path == "shm",
            )
            for _ in range(8)
        ]
        seen: list[list[int]] = [[] for _ in clients]
        errors: list[BaseException] = []
        done = threading.Event()

        def fetch(k: int) -> None:
            try:
                for _ in range(10_000):
                    version, tree = clients[k].params(timeout=WAIT_S)
                    assert digest(tree) == expected[version], f"version {version} torn"
                    seen[k].append(version)
                    if done.is_set() and version == 50:
                        return
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=fetch, args=(k,)) for k in range(len(clients))]
        for t in threads:
            t.start()
        for v in range(2, 51):
            learner.publish(params_of(v, rows))
            time.sleep(0.02)
        done.set()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[0]
        for versions in seen:
            assert versions, "a worker fetched nothing"
            assert versions == sorted(versions), versions
            assert versions[-1] == 50
        for client in clients:
            client.close()


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_a_version_published_compressed_arrives_bit_for_bit_in_fewer_bytes_over_tcp(
    path: str,
) -> None:
    """`publish(compress=)`: TCP workers fetch compressed chunks (over 2 MiB of quantised
    weights, so whole chunks and a short one) and get every bit back; shared memory copies the
    raw version. A codec that is not one is refused before anything is published."""
    rng = np.random.default_rng(3)
    weights = (rng.integers(-3, 4, (700_000,)) * 0.25).astype(np.float32)  # few distinct values
    tree = {"w": weights, "step": np.array([1], np.int64)}
    with server() as learner:
        client = TcpClient(
            LOCALHOST, learner.port, EXAMPLE, params_example=tree, shared_memory=path == "shm"
        )
        assert client.transport_path == path
        for version, codec in [(1, Lz4()), (2, Zstd(3))]:
            tree["step"][0] = version
            before = learner.stats().params_bytes_served_total
            assert learner.publish(tree, compress=codec) == version
            got_version, got = client.params(min_version=version, timeout=WAIT_S)
            assert got_version == version
            assert np.array_equal(got["w"], weights)
            assert int(got["step"][0]) == version
            served = learner.stats().params_bytes_served_total - before
            if path == "tcp":
                assert 0 < served < weights.nbytes // 2, served
            else:
                assert served == 0, "shared memory copies the version, nothing is served"
        with pytest.raises(TypeError, match=r"echo\.Zstd\(\.\.\.\) or echo\.Lz4\(\)"):
            learner.publish(tree, compress="zstd")  # type: ignore[arg-type]
        assert learner.params_version == 2, "a refused publish publishes nothing"
        assert client.close(timeout=WAIT_S)


def test_a_publish_that_does_not_fit_the_first_is_refused_and_publishes_nothing() -> None:
    with server() as learner:
        learner.publish(params_of(1))
        bad_dtype = params_of(2)
        bad_dtype["layer"]["b"] = bad_dtype["layer"]["b"].astype(np.float32)
        with pytest.raises(
            TypeError,
            match=r"leaf \['layer'\]\['b'\]: expected dtype float64 \(the first publish's\), "
            r"got float32",
        ):
            learner.publish(bad_dtype)
        bad_shape = params_of(2, rows=32)
        with pytest.raises(
            ValueError,
            match=r"leaf \['layer'\]\['w'\]: expected shape \(64, 256\) .*, got \(32, 256\)",
        ):
            learner.publish(bad_shape)
        with pytest.raises(ValueError, match="structure"):
            learner.publish({"layer": params_of(2)["layer"]})
        with pytest.raises(TypeError, match=r"expected a numpy\.ndarray, got list"):
            learner.publish({**params_of(2), "steps": [2, -2]})
        with pytest.raises(ValueError, match=r"above the latest \(1\), got 1"):
            learner.publish(params_of(2), version=1)
        assert learner.params_version == 1


def test_a_worker_without_an_example_learns_the_structure_from_the_learner() -> None:
    with server() as learner:
        bare = TcpClient(LOCALHOST, learner.port, EXAMPLE)
        with pytest.raises(TimeoutError):
            bare.params(timeout=0.2)  # nothing published: nothing to learn yet
        nested = {
            "policy": [params_of(1)["layer"]["w"], np.arange(3, dtype=np.int16)],
            "scale": np.full((), 2.5, np.float64),
        }
        learner.publish(nested)
        version, got = bare.params(timeout=WAIT_S)
        assert version == 1
        assert sorted(got) == ["policy", "scale"]
        assert isinstance(got["policy"], list)
        assert got["policy"][0].dtype == np.float32
        assert np.array_equal(got["policy"][0], nested["policy"][0])
        assert np.array_equal(got["policy"][1], nested["policy"][1])
        assert got["scale"].shape == ()
        assert got["scale"] == 2.5
        bare.close()


def test_a_namedtuple_comes_back_as_a_list_in_its_field_order() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", ["z", "a"])  # field order is not sorted order
    with server() as learner:
        learner.publish(Pair(np.zeros(2, np.float32), np.ones(3, np.float32)))
        bare = TcpClient(LOCALHOST, learner.port, EXAMPLE)
        _, got = bare.params(timeout=WAIT_S)
        assert isinstance(got, list)
        assert [a.tolist() for a in got] == [[0.0, 0.0], [1.0, 1.0, 1.0]]
        bare.close()


def test_params_needs_a_layout_of_the_published_size() -> None:
    with server() as learner:
        learner.publish(params_of(1))
        other = TcpClient(LOCALHOST, learner.port, EXAMPLE, params_example=params_of(0, rows=8))
        with pytest.raises(ValueError, match=r"publishes parameters of \d+ bytes, this client"):
            other.params(timeout=WAIT_S)
        # The client's own mistake: its connection goes on.
        other.send({"id": np.array(1, np.int64)}, timeout=WAIT_S)
        other.wait(timeout=WAIT_S)
        other.close()


def test_a_protocol_1_client_cannot_fetch() -> None:
    with server() as learner:
        learner.publish(params_of(1))
        v1 = TcpClient(LOCALHOST, learner.port, EXAMPLE, protocol=1, params_example=params_of(0))
        with pytest.raises((ValueError, ConnectionClosedError), match="serves no parameters"):
            v1.params(timeout=WAIT_S)
        v1.close()
