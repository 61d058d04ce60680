"""The TransferQueue part of the ``ragged`` suite (``benches/suites/ragged.py``), run by
``benches/suites/ragged_child.py transferqueue`` in TransferQueue's own virtualenv: the same
rollouts put one at a time (``transfer_queue.kv_put``, a dict of the rollout's tensors under a
key of its own) and read back in batches of ``peer_batch`` keys drawn uniformly
(``kv_batch_get``), every batch read in full.

TransferQueue is a distributed store: ``transfer_queue.init()`` starts Ray (here a local
cluster of ``tq_ray_cpus`` CPUs, the machine's), a controller actor and storage-unit actors,
and puts and gets go to them over ZeroMQ. So unlike echo and TorchRL its numbers include
the crossing to other processes. Whatever fails on the way (Ray's start, the actors, a put)
is reported with its error text, and the step it failed at, instead of numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import numpy as np

DEFAULT_STORAGE_UNITS = 2  # backend.SimpleStorage.num_data_storage_units in its config.yaml


def _step(notes: list[str], what: str, t0: float) -> None:
    notes.append(f"{what} in {time.perf_counter() - t0:.1f} s")


def measure_transferqueue(p: dict[str, Any], pool: Any, rows: Any, log: Any) -> dict[str, Any]:
    from importlib.metadata import version

    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf

    logging.disable(logging.WARNING)  # transfer_queue logs a warning per call otherwise

    versions = {
        "transferqueue": version("transferqueue"),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    torch.set_num_threads(1)
    notes: list[str] = []
    step = "ray.init"
    t0 = time.perf_counter()
    try:
        cpus = int(p.get("tq_ray_cpus") or os.cpu_count() or 1)
        # A Ray of its own, not a cluster another process on this machine started.
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        _step(notes, f"ray.init(num_cpus={cpus}) (a local Ray cluster)", t0)
        # The controller and every storage unit are Ray actors of num_cpus=1: the default
        # config (2 storage units) needs 3 CPUs, and on a smaller cluster tq.init() waits
        # forever for the actor Ray cannot place (no error). One unit fits 2 CPUs.
        units = int(p["tq_storage_units"])
        need = 1 + DEFAULT_STORAGE_UNITS
        if cpus < need:
            notes.append(
                f"its default config (controller + {DEFAULT_STORAGE_UNITS} storage units, "
                f"Ray actors of num_cpus=1 each: {need} CPUs) never starts on a {cpus}-CPU Ray "
                "cluster: tq.init() waits in ray.get for the storage unit Ray cannot place, "
                f"with no error; measured with num_data_storage_units={units}"
            )
        step = "transfer_queue.init()"
        t0 = time.perf_counter()
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": units}}}))
        _step(notes, f"transfer_queue.init() (a controller and {units} storage unit(s))", t0)
        step = "kv_put"
        tensors = [
            {
                "prompt": torch.from_numpy(pool.prompts[i]),
                "tokens": torch.from_numpy(pool.tokens[i]),
                "logp": torch.from_numpy(pool.logps[i]),
                "reward": torch.from_numpy(pool.rewards[i]),
            }
            for i in range(pool.n)
        ]
        rng = np.random.default_rng(0)
        batch = int(p["peer_batch"])
        added = [0]

        def add(j: int) -> None:
            tq.kv_put(key=f"r{added[0]}", partition_id="train", fields=tensors[j])
            added[0] += 1

        def draw() -> tuple[list[Any], Any]:
            picks = rng.integers(0, added[0], batch)
            keys = [f"r{k}" for k in picks]
            td = tq.kv_batch_get(keys=keys, partition_id="train")
            arrays = []
            for name in ("prompt", "tokens", "logp"):
                value = td[name]  # a jagged nested tensor: values() packed, offsets()
                arrays.append((value.values() if value.is_nested else value).numpy())
            reward = td["reward"]
            reward = reward.values() if getattr(reward, "is_nested", False) else reward
            return [*arrays, reward.numpy()], reward.numpy()

        step = "kv_put / kv_batch_get"
        out = rows(add, draw, {**p, "peer_fill": p["tq_fill"]}, pool, log, "transferqueue")
        out["fill"] = int(p["tq_fill"])
    except Exception as e:  # noqa: BLE001  what failed, and how, is the result
        import traceback

        traceback.print_exc()
        return {
            "error": f"{step} failed: {type(e).__name__}: {str(e)[:400]}",
            "versions": versions,
            "notes": notes,
        }
    finally:
        with contextlib.suppress(Exception):  # best effort at the end
            tq.close()
        ray.shutdown()
    out["versions"] = versions
    out["notes"] = notes
    out["api"] = {
        "table": "transfer_queue.init() on ray.init(num_cpus) (a controller and storage units: "
        "Ray actors, ZeroMQ)",
        "add": "kv_put(key, partition_id, fields={leaf: tensor})",
        "sample": f"kv_batch_get({batch} uniformly drawn keys, partition_id) (a TensorDict)",
    }
    return out
