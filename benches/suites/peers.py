"""Peers: echo against other replay buffers with Python APIs, row by row, on one transition.

The peers are cpprb 11.0.0 (C++/Cython), rlox 1.2.0 (Rust/PyO3) and id-echo 0.2.1 (the
published echo, a FIFO ring only). Each is ``pip install``ed into a virtualenv of its own,
under ``~/.cache/echo-bench/peers/<name>`` (``--set venv_root=DIR``), made by this suite the
first time and reused after; none of them is ever a dependency of echo. A peer whose
virtualenv cannot be made (offline, say) is reported as not installed and the others still
run. ``--quick`` never makes one (CI has no network): it runs the peers whose virtualenv
already exists, unless ``ECHO_PEERS_INSTALL=1`` says to make them (``ECHO_PEERS_INSTALL=0``
forbids it in a full run).

The transition is obs ``float32[84]``, action ``int64``, reward ``float32``, done ``bool``;
Atari rows use obs ``uint8[84, 84, 4]``. Rows (``benches/suites/peers_child.py`` has the
details): single-row and 64-row inserts into a new table of ``size`` rows (first fill) and
into a full one (steady), uniform and prioritized (with the update of the batch's
priorities) samples of 256 from a full table, the same for Atari frames in a table of
``atari_size`` (plus the memcpy ceiling of the gather), sequence step inserts (windows of 16,
period 1) and samples of 32 windows.

Method: every (library, row) runs in a child process of its own, with that library's
interpreter (ours for echo), and reports the best of ``repeats`` windows; ``rounds`` rounds
run every row of every library in turn (row by row, the library order reversed every other
round), and the table shows the best over rounds with the spread between the rounds' bests.
Each child is bounded in time (``child_timeout``, its watchdog) and each loop in count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benches import common as c
from benches.suites import peers_child as pc

# name -> pip requirement, each in its own virtualenv
PEERS = {"cpprb": "cpprb==11.0.0", "rlox": "rlox==1.2.0", "id-echo": "id-echo==0.2.1"}
LIBS = ("echo", "cpprb", "rlox", "id-echo", "memcpy")
MARKER = ".echo-bench-peer"  # written once the pip install succeeded: the requirement
INSTALL_TIMEOUT_S = 1200.0  # per peer (rlox pulls in torch)
INSTALL_BUDGET_S = 1500.0  # what limit_s allows for making the virtualenvs


def parameters(quick: bool) -> dict[str, Any]:
    common = {
        "libs": list(LIBS),
        "venv_root": str(Path.home() / ".cache" / "echo-bench" / "peers"),
        "batch": 256,
        "seq_length": 16,
        "seq_period": 1,
        "seq_batch": 32,
        "seq_streams": 8,
        "repeats": 3,
        "max_calls": 1_000_000,
    }
    if quick:
        return {
            **common,
            "size": 10_000,
            "atari_size": 1_000,
            "seq_size": 10_000,
            "seq_episode": 64,
            "pool": 1024,
            "atari_pool": 64,
            "seconds": 0.2,
            "fill_seconds": 2.0,
            "rounds": 1,
            "child_timeout": 60.0,
            "install": False,
        }
    return {
        **common,
        "size": 1_000_000,
        "atari_size": 100_000,
        "seq_size": 1_000_000,
        "seq_episode": 256,
        "pool": 4096,
        "atari_pool": 1024,
        "seconds": 2.0,
        "fill_seconds": 10.0,
        "rounds": 2,
        "child_timeout": 300.0,
        "install": True,
    }


def _install_allowed(params: dict[str, Any]) -> bool:
    env = os.environ.get("ECHO_PEERS_INSTALL")
    if env in ("0", "1"):
        return env == "1"
    return bool(params["install"])


def _run_budget_s(params: dict[str, Any]) -> float:
    """The measurements' time: generous for rows that hit every limit, far less in practice
    (a full run takes about 15 minutes on 2 cores)."""
    per_round = 600.0 if float(params["fill_seconds"]) > 5 else 120.0
    return int(params["rounds"]) * per_round + 60.0


def limit_s(params: dict[str, Any]) -> float:
    return _run_budget_s(params) + (INSTALL_BUDGET_S if _install_allowed(params) else 0.0)


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def ensure_venv(
    name: str, requirement: str, root: Path, install: bool, log: Any
) -> tuple[str | None, str]:
    """The python of peer ``name``'s virtualenv under ``root`` and how it got there
    (``reused``, ``installed``), or None and why not (``not installed: ...``)."""
    home = root / name
    python = home / "bin" / "python"
    marker = home / MARKER
    try:
        ready = marker.read_text(encoding="utf-8").strip() == requirement and python.exists()
    except OSError:
        ready = False
    if ready:
        return str(python), "reused"
    if not install:
        return None, f"not installed (no virtualenv at {home}; a full run makes it)"
    log(f"making {home} and pip installing {requirement}")
    try:
        if not python.exists():
            home.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [sys.executable, "-m", "venv", str(home)],
                check=True,
                capture_output=True,
                timeout=300,
            )
        subprocess.run(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", requirement],
            check=True,
            capture_output=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.CalledProcessError as e:
        return None, f"not installed: {_tail(e.stderr) or e}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"not installed: {type(e).__name__}: {e}"
    marker.write_text(requirement + "\n", encoding="utf-8")
    return str(python), "installed"


def _thp() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(encoding="utf-8")
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def _child_params(params: dict[str, Any]) -> dict[str, Any]:
    drop = ("libs", "venv_root", "rounds", "install")
    return {k: v for k, v in params.items() if k not in drop}


def measure(params: dict[str, Any]) -> dict[str, Any]:
    t_start = time.monotonic()
    deadline = t_start + limit_s(params) - 10.0
    log = c.logger("peers")
    libs = [lib for lib in params["libs"] if lib in LIBS]
    install = _install_allowed(params)
    root = Path(os.path.expanduser(str(params["venv_root"])))
    pythons: dict[str, str | None] = {}
    setup: dict[str, dict[str, Any]] = {}
    for lib in libs:
        if lib in PEERS:
            python, how = ensure_venv(lib, PEERS[lib], root, install, log)
            setup[lib] = {"requirement": PEERS[lib], "python": python, "status": how}
            log(f"{lib}: {how}")
        else:
            python = sys.executable
            setup[lib] = {"python": python, "status": "this interpreter"}
        pythons[lib] = python
    child = _child_params(params)
    timeout = float(params["child_timeout"]) + 30.0
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {lib: {} for lib in libs}
    skipped: list[str] = []
    for rnd in range(int(params["rounds"])):
        order = libs if rnd % 2 == 0 else libs[::-1]
        for row in pc.ROWS:
            for lib in order:
                python = pythons[lib]
                if python is None or pc.why_unsupported(pc.CLASSES[lib], row) is not None:
                    continue
                if time.monotonic() + timeout > deadline:
                    skipped.append(f"{lib} {row} round {rnd + 1}")
                    continue
                log(f"round {rnd + 1}: {lib} {row}")
                cmd = [python, "-m", "benches.suites.peers_child", lib, row, json.dumps(child)]
                doc = c.run_json_child(cmd, timeout)
                runs[lib].setdefault(row, []).append(doc)
    out: dict[str, Any] = {"setup": setup, "rows": {}, "versions": {}, "skipped": skipped}
    out["transparent_hugepage"] = _thp()
    correct = True
    for lib in libs:
        rows: dict[str, Any] = {}
        for row in pc.ROWS:
            why = pc.why_unsupported(pc.CLASSES[lib], row)
            if pythons[lib] is None:
                rows[row] = {"status": "not installed"}
                continue
            if why is not None:
                rows[row] = {"status": "unsupported", "why": why}
                continue
            docs = runs[lib].get(row, [])
            bests = [d["best"] for d in docs if isinstance(d.get("best"), (int, float))]
            errors = [str(d["error"]) for d in docs if "error" in d]
            ok = all(d.get("correct", False) for d in docs) and bool(docs)
            correct = correct and ok
            for d in docs:
                if "versions" in d:
                    out["versions"][lib] = d["versions"]
            rows[row] = {
                "status": "measured" if bests else "error",
                "best": max(bests) if bests else None,
                "round_bests": bests,
                "api": pc.api_of(pc.CLASSES[lib], row),
                "correct": ok,
                "errors": errors,
                "runs": [
                    {k: v for k, v in d.items() if k not in ("lib", "row", "versions", "api")}
                    for d in docs
                ],
            }
        out["rows"][lib] = rows
    out["correct"] = correct
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


# --------------------------------------------------------------------------- tables

PEER_COLUMNS = ("cpprb", "rlox", "id-echo")


def _label(lib: str, versions: dict[str, Any]) -> str:
    if lib == "echo":
        return "echo"
    v = (versions.get(lib) or {}).get(lib) or PEERS[lib].split("==")[1]
    return f"{lib} {v}"


def _cell(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    status = r.get("status")
    if status == "measured":
        return c.num(r["best"])
    if status == "not installed":
        return "not installed"
    if status == "error":
        return "error"
    return "-"


def _spread(rows: dict[str, Any], row: str, libs: list[str]) -> str:
    """The largest spread between a library's round bests on this row: max/min - 1."""
    worst = None
    for lib in libs:
        bests = rows.get(lib, {}).get(row, {}).get("round_bests") or []
        if len(bests) > 1 and min(bests) > 0:
            s = max(bests) / min(bests) - 1
            worst = s if worst is None else max(worst, s)
    return "-" if worst is None else f"{100 * worst:.0f}%"


def _venv_word(status: str) -> str:
    return "yes" if status in ("reused", "installed") else status.split(" (")[0]


def _huge_pages(rows_by_lib: dict[str, Any], libs: list[str], row: str) -> str:
    """Per library: resident MiB on huge pages / all resident MiB once the table of ``row``'s
    child was full (after its fill, before the clock)."""
    parts = []
    for lib in libs:
        runs = rows_by_lib[lib].get(row, {}).get("runs", [])
        mem = next((d["memory_kib"] for d in runs if d.get("memory_kib")), None)
        if mem and "AnonHugePages" in mem and "Rss" in mem:
            parts.append(f"{lib} {mem['AnonHugePages'] // 1024:,} of {mem['Rss'] // 1024:,} MiB")
    return ", ".join(parts) or "-"


def _median(xs: list[float]) -> float | None:
    return c.median(xs) if xs else None


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    r = results.get("ours", {})
    if "error" in r:
        return [
            {
                "title": "Peers",
                "columns": ["echo", "error"],
                "rows": [["ours", str(r["error"])[:200]]],
            }
        ]
    rows_by_lib: dict[str, Any] = r.get("rows", {})
    versions = r.get("versions", {})
    libs = [lib for lib in ("echo", *PEER_COLUMNS) if lib in rows_by_lib]
    peers = [lib for lib in libs if lib != "echo"]
    columns = ["#", "operation", "unit", *(_label(lib, versions) for lib in libs)]
    columns += ["echo / best peer", "memcpy ceiling", "spread of rounds"]
    out_rows = []
    for i, (row, (label, unit, _, _)) in enumerate(pc.ROWS.items(), start=1):
        cells = [_cell(rows_by_lib[lib].get(row)) for lib in libs]
        echo_best = rows_by_lib.get("echo", {}).get(row, {}).get("best")
        peer_bests = [
            rows_by_lib[lib][row]["best"]
            for lib in peers
            if rows_by_lib[lib].get(row, {}).get("status") == "measured"
        ]
        ratio = c.fmt_ratio(echo_best, max(peer_bests), 0) if peer_bests else "-"
        ceiling = "-"
        if row == "atari_sample":
            ceiling = _cell(rows_by_lib.get("memcpy", {}).get(row))
        out_rows.append(
            [str(i), label, unit, *cells, ratio.strip(), ceiling, _spread(rows_by_lib, row, libs)]
        )
    size, atari, seq = params["size"], params["atari_size"], params["seq_size"]
    construct = []
    for lib in libs:
        runs = rows_by_lib[lib].get("insert1_fill", {}).get("runs", [])
        cs = [x for d in runs for x in d.get("construct_s", [])]
        m = _median(cs)
        if m is not None:
            construct.append(f"{lib} {m * 1000:.1f} ms")
    notes = [
        f"Transition: obs f32[{pc.OBS}], action i64, reward f32, done bool; tables of "
        f"{size:,} rows, Atari (obs u8[84, 84, 4]) of {atari:,}, sequence tables of {seq:,} "
        f"steps. Best of {params['repeats']} windows of {params['seconds']:g} s (inserts into "
        f"a new table: up to the table's size or {params['fill_seconds']:g} s) in each of "
        f"{params['rounds']} round(s); *spread of rounds*: the largest max/min - 1 of one "
        "library's round bests on the row (the machine's noise).",
        "*first fill*: the table is built before the clock starts (median construction: "
        + (", ".join(construct) or "-")
        + "), so the first touch of its pages is in the fill. *steady*: the table was filled "
        "first through the library's batch path, so every insert overwrites the oldest row.",
        "Every batch is read: one element of every array a library returns, after "
        "np.asarray. echo returns read-only views of a batch gathered into its batch area; "
        "cpprb and rlox return new arrays (copies); rlox also stores and returns a next_obs "
        "column (its single-row push writes zeros there, push_batch a copy of obs), holds "
        "actions as f32 and done as u8 terminated/truncated, and takes a seed per sample.",
        "*memcpy ceiling*: np.copyto of one batch's bytes (256 frames gathered beforehand, 16 "
        "such sources in turn) per batch: an upper bound for the Atari gather.",
        f"Transparent huge pages: {r.get('transparent_hugepage') or 'unknown'}. Resident on "
        "huge pages once the table was full, of the process's resident memory: "
        f"{_huge_pages(rows_by_lib, libs, 'sample_uniform')} (row 5); "
        f"{_huge_pages(rows_by_lib, libs, 'atari_sample')} (row 9).",
        "Scalar leaves are 0-d arrays (views of the pool, the form of echo's example) for "
        "echo, cpprb and id-echo, and Python floats and bools for rlox, which takes no 0-d "
        "array; its actions are f32[1] arrays. Row 12 passes numpy scalars (np.int64, "
        "np.float32, np.bool_ as indexing a column gives them) instead, to all four.",
        "Rows 13 and 14 pass a row's leaves positionally, through each library's entry point "
        "for that: echo's SampleWriter (w = server.writer(), then w(*leaves), the example's "
        "leaves in order), rlox's push (its only single-row insert, as in rows 1 and 2); "
        "cpprb's add and id-echo's submit take no positional leaves.",
        "id-echo 0.2.1 is a FIFO ring: its insert rows fill a ring of the table's size, and "
        "steady inserts keep it full with one sample() (a view, timed) per ring batch of "
        f"{pc.IdEcho.ring_batch(int(size)):,} rows; it has no replay sampling, batch insert or "
        "sequences. Sequences: echo "
        f"steps {params['seq_streams']} streams in turn (submit(step, stream=k, "
        f"end_episode=...)), episodes of {params['seq_episode']} steps; rlox has one stream, "
        "its episodes one after another, the same lengths.",
    ]
    skipped = r.get("skipped") or []
    if skipped:
        notes.append(f"Skipped (out of time): {', '.join(skipped)}.")
    main = {
        "title": "echo against cpprb, rlox and id-echo 0.2.1, one thread each, rates (higher is "
        "better)",
        "columns": columns,
        "rows": out_rows,
        "notes": notes,
    }
    api_rows = []
    for lib in libs:
        impl = pc.CLASSES[lib]
        status = r.get("setup", {}).get(lib, {}).get("status", "")
        api = impl.api
        missing = "; ".join(f"{k}: {v}" for k, v in impl.unsupported.items())
        api_rows.append(
            [
                _label(lib, versions),
                status if lib in ("echo", "memcpy") else _venv_word(status),
                api.get("new", "-"),
                api.get("insert1", "-"),
                api.get("insert64", "-"),
                api.get("sample", "-"),
                api.get("prio", "-"),
                api.get("seq", "-"),
                missing or "-",
            ]
        )
    apis = {
        "title": "The API each library was measured through",
        "columns": [
            "library",
            "virtualenv",
            "table",
            "single-row insert",
            "64-row insert",
            "sample",
            "prioritized",
            "sequences",
            "not available",
        ],
        "rows": api_rows,
    }
    return [main, apis]
