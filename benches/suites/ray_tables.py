"""The tables of the ``ray`` suite (:mod:`benches.suites.ray_service`): samples/s by shard
count, ``connect`` against a plain ``TcpClient``, discovery, the resume after a learner
restart, and the scaling model that applies the measured costs to larger fleets.
"""

from __future__ import annotations

import statistics
from typing import Any

from benches import common as c

# --------------------------------------------------------------------------- tables


def model(r: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The aggregate throughput of ``model_learners`` learners and ``model_workers`` workers
    from the measured costs (docs/design/index.md, "Scaling model for echo on Ray")."""
    one = next(x for x in r["shards"] if x["shards"] == 1)
    learners, workers = int(params["model_learners"]), int(params["model_workers"])
    per_learner = -(-workers // learners)  # the rule balances to within one
    # Learner CPU per sample, us: the larger of a few busy connections' and many light ones'.
    c_learner = max(one["learner_cpu_us"], r["connect"]["spread_learner_cpu_us"])
    c_worker = one["worker_cpu_us"]
    idle = r["connect"]["idle_cpu_us_per_conn_s"]  # learner CPU per connection, us per s
    idle_share = max(0.0, per_learner * idle / 1e6)  # of one learner core
    cpu_bound = (1.0 - idle_share) * 1e6 / c_learner
    nic_bound = float(params["model_nic_gbit"]) * 1e9 / 8 / r["sample_bytes"]
    per_shard = min(cpu_bound, nic_bound)
    return {
        "learners": learners,
        "workers": workers,
        "workers_per_learner": per_learner,
        "learner_cpu_us": c_learner,
        "worker_cpu_us": c_worker,
        "idle_share": idle_share,
        "per_shard_cpu_bound": cpu_bound,
        "per_shard_nic_bound": nic_bound,
        "per_shard": per_shard,
        "aggregate": learners * per_shard,
        "aggregate_batched": learners
        * min((1.0 - idle_share) * 1e6 / one["learner_cpu_us"], nic_bound),
        "per_worker_needed": learners * per_shard / workers,
        "worker_max": 1e6 / c_worker,
        "rss_mib_per_learner": per_learner * r["connect"]["rss_kib_per_conn"] / 1024,
        "discovery_s": workers / r["connect"]["registry"]["calls_per_s"],
    }


def _ratio_cells(ratios: list[float] | None) -> list[str]:
    """The median and range of per-repeat ratios, as two cells."""
    if not ratios:
        return ["-", "-"]
    return [c.num(statistics.median(ratios), ".3f"), f"{min(ratios):.3f}..{max(ratios):.3f}"]


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    shard_cols = [
        "echo",
        "shards",
        "workers",
        "aggregate samples/s",
        "per shard samples/s",
        "learner CPU us/sample",
        "worker CPU us/sample",
        "correct",
    ]
    cmp_cols = [
        "echo",
        "client",
        "samples/s (median)",
        "/ plain TcpClient",
        "range",
        "/ TcpClient(reconnect=True)",
        "range",
        "repeats",
    ]
    conn_cols = [
        "echo",
        "clients",
        "actors x threads",
        "discovery + connect (s)",
        "per client p50 / p99 (ms)",
        "registry lookup p50 (ms)",
        "registry calls/s",
        "learner CPU per idle conn (us/s)",
        "learner RSS per conn (KiB)",
        "learner CPU us/sample, each conn sending",
        "correct",
    ]
    rs_cols = [
        "echo",
        "workers",
        "kill to registered (s)",
        "registered to first ack (s)",
        "status() poll to first ack (s)",
        "restored, generation",
        "correct",
    ]
    model_cols = ["echo", "quantity", "value", "from"]
    shard_rows = c.failed_rows(results, len(shard_cols))
    cmp_rows = c.failed_rows(results, len(cmp_cols))
    conn_rows = c.failed_rows(results, len(conn_cols))
    rs_rows = c.failed_rows(results, len(rs_cols))
    model_rows = c.failed_rows(results, len(model_cols))
    yes = {True: "yes", False: "NO"}
    for side, r in results.items():
        if "error" in r:
            continue
        for x in r["shards"]:
            shard_rows.append(
                [
                    side,
                    str(x["shards"]),
                    str(x["workers"]),
                    c.num(x["per_s"]),
                    " / ".join(c.num(s["per_s"]) for s in x["per_shard"]),
                    c.num(x["learner_cpu_us"], ".1f"),
                    c.num(x["worker_cpu_us"], ".1f"),
                    yes[bool(x["correct"])],
                ]
            )
        cmp = r["compare"]
        names = {
            "TcpClient": "`TcpClient`",
            "TcpClient reconnect": "`TcpClient(reconnect=True)`",
            "ray.connect": "`echo.ray.connect`",
        }

        for variant, name in names.items():
            rates = [x["per_s"] for x in cmp["rounds"] if x["variant"] == variant]
            vs_reconnect = cmp["ratios"].get("ray.connect/reconnect")
            cmp_rows.append(
                [
                    side,
                    name,
                    c.num(statistics.median(rates) if rates else None),
                    *_ratio_cells(cmp["ratios"].get(variant)),
                    *_ratio_cells(vs_reconnect if variant == "ray.connect" else None),
                    str(len(rates)),
                ]
            )
        x = r["connect"]
        conn_rows.append(
            [
                side,
                str(x["clients"]),
                f"{x['procs']} x {x['threads']}",
                c.num(x["connected_s"], ".2f"),
                f"{c.num(x['connect_ms_p50'], '.1f')} / {c.num(x['connect_ms_p99'], '.1f')}",
                c.num(x["registry"]["lookup_ms_p50"], ".2f"),
                c.num(x["registry"]["calls_per_s"]),
                c.num(x["idle_cpu_us_per_conn_s"], ".1f"),
                c.num(x["rss_kib_per_conn"], ".0f"),
                c.num(x["spread_learner_cpu_us"], ".1f"),
                yes[bool(x["correct"])],
            ]
        )
        x = r["restart"]
        rs_rows.append(
            [
                side,
                str(x["workers"]),
                c.num(x["kill_to_registered_s"], ".2f"),
                c.num(x["resume_s"], ".2f"),
                c.num(x["resume_after_poll_s"], ".2f"),
                f"{yes[bool(x['restored'])]}, {x['generation']}",
                yes[bool(x["correct"])],
            ]
        )
        m = model(r, params)
        model_rows += [
            [
                side,
                "workers per learner (balanced to within one)",
                f"{m['workers_per_learner']:,}",
                "the shard rule",
            ],
            [
                side,
                "learner CPU per sample (us)",
                c.num(m["learner_cpu_us"], ".1f"),
                "the larger of: shards table (1 shard), connect table (each conn sending)",
            ],
            [
                side,
                "learner core share spent on idle connections",
                c.num(m["idle_share"], ".3f"),
                "connect table x workers per learner",
            ],
            [
                side,
                "per learner, CPU bound (samples/s, one core)",
                c.num(m["per_shard_cpu_bound"]),
                "(1 - idle share) / learner CPU per sample",
            ],
            [
                side,
                f"per learner, {params['model_nic_gbit']:g} Gbit/s NIC bound (samples/s)",
                c.num(m["per_shard_nic_bound"]),
                f"{r['sample_bytes']:,} B samples",
            ],
            [
                side,
                f"aggregate, {m['learners']} learners (samples/s)",
                c.num(m["aggregate"]),
                "learners x min(CPU bound, NIC bound)",
            ],
            [
                side,
                f"aggregate, {m['learners']} learners, workers sending batches (samples/s)",
                c.num(m["aggregate_batched"]),
                "the same with the 1-shard cost per sample (few busy connections)",
            ],
            [
                side,
                "per worker to reach it (samples/s)",
                c.num(m["per_worker_needed"]),
                f"one worker's echo ceiling: {c.num(m['worker_max'])}",
            ],
            [
                side,
                "learner RSS for its connections (MiB)",
                c.num(m["rss_mib_per_learner"], ".1f"),
                "connect table",
            ],
            [
                side,
                f"registry time to assign {m['workers']:,} workers (s)",
                c.num(m["discovery_s"], ".2f"),
                "workers / registry calls/s",
            ],
        ]
    nodes = params["nodes"]
    where = (
        f"a local Ray cluster ({nodes} node{'s' if nodes != 1 else ''}) on 127.0.0.1, "
        f"{params['batch_size']}-row `send_batch`, TCP"
        if not params["shared_memory"]
        else f"a local Ray cluster ({nodes} nodes) on 127.0.0.1, shared memory"
    )
    return [
        {
            "title": f"Shards: learner actors and {params['workers']} worker actors on {where}, "
            f"{params['seconds']:g} s",
            "columns": shard_cols,
            "rows": shard_rows,
            "notes": [
                "Every actor of every shard runs on the same few cores here: aggregate scaling "
                "cannot show on such a machine (cores, not shards, bound it); the per-sample "
                "CPU columns are the inputs of the scaling model below.",
                "*correct*: each learner consumed exactly the count and id sum its workers "
                "had acknowledged.",
            ],
        },
        {
            "title": "Per-sample `send` through `echo.ray.connect` against a plain `TcpClient`, "
            f"same process and server, {params['compare_seconds']:g} s rounds rotating",
            "columns": cmp_cols,
            "rows": cmp_rows,
            "notes": [
                "A `ShardClient` is a `TcpClient` with `reconnect=True` and a resolver that "
                "the registry answers before each connection attempt: the last ratio is the "
                "cost of `echo.ray` alone. A client with `reconnect=True` copies each sample "
                "into the frame it keeps for resending and writes several frames per system "
                "call, which for small samples can beat the plain client's one vectored "
                "write per sample. Target: within 3% of the plain client. *range*: the "
                "per-repeat ratios.",
            ],
        },
        {
            "title": f"Discovery plus connect: {params['connect_clients']} `ShardClient`s",
            "columns": conn_cols,
            "rows": conn_rows,
            "notes": [
                "*discovery + connect*: from `echo.ray.status` first listing the shard to the "
                "last client connected (the actors were started before). Target: under 2 s.",
                "*learner ... per idle conn*: the learner process's CPU and RSS with the "
                "clients connected and idle, less without them, per connection. *each conn "
                f"sending*: every client sends one sample in turn, {params['spread_rounds']} "
                "rounds; the learner's CPU per sample with that many light connections.",
            ],
        },
        {
            "title": "Resume after `ray.kill(learner, no_restart=False)` "
            f"(periodic checkpoints every {params['checkpoint_every']:g} s)",
            "columns": rs_cols,
            "rows": rs_rows,
            "notes": [
                "*registered to first ack*: from the restarted learner's registration "
                "(generation 2, its clock) to the last of the workers' first sample "
                "acknowledged by it. Target: under 5 s.",
            ],
        },
        {
            "title": f"Scaling model: {params['model_learners']} learners, "
            f"{params['model_workers']:,} workers, from the costs above",
            "columns": model_cols,
            "rows": model_rows,
            "notes": [
                "Assumes one learner per node with one core for echo's ingest, workers on "
                "other nodes sending over TCP, shards independent (no shared resource but "
                "the registry, which is called only to connect); see docs/design/index.md, "
                "*Scaling model for echo on Ray*.",
            ],
        },
    ]
