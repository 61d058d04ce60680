"""Every ```python block in README.md and docs/**/*.md is executed, so the examples cannot rot.

Each block is one test case (id `docs/guides/tcp.md:42`, the line of its opening fence) and
runs in a fresh interpreter (`sys.executable -c`) whose working directory is an empty temporary
folder; the environment is passed through unchanged (relative PYTHONPATH entries are made
absolute, so they keep naming the same folders). The block passes if the interpreter exits
with status 0.

A block runs as it stands unless HTML comments on the lines directly above its fence say
otherwise (mkdocs renders them as nothing). Words and `key="value"` pairs, any number per
comment, any number of comment lines:

    <!-- docs-test: skip reason="needs PyTorch, which echo does not install" -->
        Not run; reported as skipped with the reason. `reason` is required.
    <!-- docs-test: setup="filled-server, train_step" -->
        Runs the named preludes of `SETUPS` below, in order, before the block (and their
        epilogues, in reverse order, after it). A prelude supplies what a fragment takes from
        its page (`server`, `example`), stands in for the reader's code (`train_step`, an
        environment), or points a remote or fixed address at a loopback learner.
    <!-- docs-test: file="worker.py" -->
        Also writes the block to that file in the working directory of every block of the
        same page (for a page whose learner starts `worker.py`).
    <!-- docs-test: raises="ValueError" -->
        Each top-level statement of the block is run on its own and must raise that built-in
        exception (for blocks that show errors, one per line).
    <!-- docs-test: requires="detailed-metrics" -->
        Runs only in the telemetry build (`echo.DETAILED_METRICS`); skipped, with that reason,
        in the default build. `requires="jax"` / `requires="torch"` / `requires="ray"`: runs
        only where that package is installed (JAX and Ray are in the `test` extra, so CI runs
        those; PyTorch is not). A Ray block gets `RAY_TIMEOUT_S` and a loopback-only Ray.

A block with neither a marker nor a clean exit fails, and so does a malformed marker, a marker
that is not directly above a ```python fence, or a fence the parser did not collect.

The block is compiled with its markdown file as file name and its own line numbers, so a
traceback points at the markdown line. The preludes' own names start with `_dt_`.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import echo

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0
# A block that starts a local Ray instance (a few seconds, more on a loaded machine).
RAY_TIMEOUT_S = 120.0


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# --------------------------------------------------------------------------------------------
# Setups: preludes run before a block, epilogues after it (in the block's globals).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    doc: str
    prelude: str
    epilogue: str = ""


# Always first when a block has setups. Records every Server (weakly) and its example, and
# starts loopback learners that consume everything until the epilogue closes them.
_BASE_PRELUDE = """
import dataclasses as _dt_dataclasses
import threading as _dt_threading
import time as _dt_time
import weakref as _dt_weakref

import echo as _dt_echo
import numpy as _dt_np
import optree as _dt_optree

_dt_RealTcpTransport = _dt_echo.TcpTransport
_dt_RealTcpClient = _dt_echo.TcpClient
_dt_servers = _dt_weakref.WeakSet()  # every Server of this process
_dt_learners = []  # (server, consumer thread) started by _dt_start_learner
_dt_errors = []  # exceptions of the setups' threads
_dt_real_server_init = _dt_echo.Server.__init__


def _dt_server_init(self, example, *args, **kwargs):
    _dt_real_server_init(self, example, *args, **kwargs)
    self._dt_example = example
    _dt_servers.add(self)


_dt_echo.Server.__init__ = _dt_server_init


def _dt_zeros(example):
    return _dt_optree.tree_map(_dt_np.zeros_like, example)


def _dt_thread(target, *args):
    def run():
        try:
            target(*args)
        except BaseException as exc:
            _dt_errors.append(exc)

    thread = _dt_threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _dt_start_learner(example, batch_size=8):
    # A loopback learner that samples (and drops) every batch until the epilogue closes it.
    transport = _dt_RealTcpTransport(port=0, host="127.0.0.1")
    server = _dt_echo.Server(example, batch_size, transport=transport)
    server.start()
    thread = _dt_thread(lambda: [None for _ in server.dataset_iter()])
    _dt_learners.append((server, thread))
    return server


def _dt_feed_tcp(server, num_samples):
    # Sends `num_samples` zero samples to `server` from a real TcpClient on the loopback.
    client = _dt_RealTcpClient("127.0.0.1", server.port, server._dt_example)
    for _ in range(num_samples):
        client.send(_dt_zeros(server._dt_example))
    client.close()
"""

_BASE_EPILOGUE = """
for _dt_server, _dt_consumer in _dt_learners:
    _dt_server.close()
    _dt_consumer.join(10)
    assert not _dt_consumer.is_alive(), "a setup's learner thread did not stop"
if _dt_errors:
    raise _dt_errors[0]
"""

_EXAMPLE = """
import numpy as np
from echo import Server

example = {"obs": np.zeros((4,), np.float32), "reward": np.zeros((1,), np.float32)}
"""

_SERVER = (
    _EXAMPLE
    + """
server = Server(example, batch_size=32)
"""
)

SETUPS: dict[str, Setup] = {
    "example": Setup(
        doc="`np`, `Server` and the quick start's `example` ({'obs': f32[4], 'reward': f32[1]}),"
        " as an earlier block of the page defined them.",
        prelude=_EXAMPLE,
    ),
    "tcp-example": Setup(
        doc="`np`, `TcpClient` and the TCP guide's `example` ({'obs': f32[4], 'reward': f32[]}).",
        prelude="""
import numpy as np
from echo import TcpClient

example = {"obs": np.zeros((4,), np.float32), "reward": np.zeros((), np.float32)}
""",
    ),
    "server": Setup(
        doc="`example` and an in-process `server = Server(example, batch_size=32)`, empty.",
        prelude=_SERVER,
    ),
    "filled-server": Setup(
        doc="`example` and an in-process `server` (batch_size=32) holding two complete batches.",
        prelude=_SERVER
        + """
for _dt_i in range(64):
    server.submit({"obs": np.full(4, _dt_i, np.float32), "reward": np.ones(1, np.float32)})
""",
    ),
    "view": Setup(
        doc="After `filled-server`: `sample = server.sample()` and `obs = sample.batch['obs']`.",
        prelude="""
sample = server.sample()
obs = sample.batch["obs"]
""",
    ),
    "info": Setup(
        doc="After `filled-server`: `sample = server.sample()` and `info = sample.info`.",
        prelude="""
sample = server.sample()
info = sample.info
""",
    ),
    "log": Setup(
        doc="`step = 0` and a `log()` that prints.",
        prelude="""
step = 0


def log(stats):
    print(stats)
""",
    ),
    "env_step": Setup(
        doc="After `example`: `env_step()` returns a new sample for it.",
        prelude="""
def env_step():
    return {"obs": np.random.randn(4).astype(np.float32), "reward": np.ones(1, np.float32)}
""",
    ),
    "train_step": Setup(
        doc="`training = True` and a `train_step(...)` that ends the run on its 2nd call: it sets"
        " `training = False` and closes every Server, which ends `dataset_iter()` loops.",
        prelude="""
training = True
_dt_train_calls = 0


def train_step(*args):
    global training, _dt_train_calls
    _dt_train_calls += 1
    if _dt_train_calls == 2:
        training = False
        for _dt_s in list(_dt_servers):
            _dt_s.close()
""",
        epilogue="""
assert _dt_train_calls == 2, f"train_step was called {_dt_train_calls} times, expected 2"
""",
    ),
    "loopback-learner": Setup(
        doc="`TcpTransport(port=50051)` binds a free port on 127.0.0.1 instead, and once the"
        " Server has started, a thread sends it two batches from a TcpClient.",
        prelude="""
def _dt_loopback_transport(*args, **kwargs):
    transport = _dt_RealTcpTransport(*args, **kwargs)
    assert transport.port == 50051, transport
    return _dt_dataclasses.replace(transport, port=0, host="127.0.0.1")


_dt_echo.TcpTransport = _dt_loopback_transport
_dt_real_start = _dt_echo.Server.start


def _dt_start_and_feed(self):
    _dt_real_start(self)
    if self.port is not None and not hasattr(self, "_dt_fed"):
        self._dt_fed = _dt_thread(_dt_feed_tcp, self, 2 * self.batch_size)


_dt_echo.Server.start = _dt_start_and_feed
""",
    ),
    "learner": Setup(
        doc="After `example` or `tcp-example`: a learner for `example` on 127.0.0.1 consumes"
        " every batch; `port` is its port.",
        prelude="""
port = _dt_start_learner(example).port
""",
    ),
    "worker-argv": Setup(
        doc="After `learner`: the command line `worker.py PORT 0 1000`.",
        prelude="""
import sys as _dt_sys

_dt_sys.argv = ["worker.py", str(port), "0", "1000"]
""",
    ),
    "learner-host": Setup(
        doc='`TcpClient("learner-host", 50051, example)` connects to a learner for `example`'
        " started on 127.0.0.1 instead; afterwards every client must have had all its samples"
        " acknowledged.",
        prelude="""
_dt_clients = []


class _DtTcpClient(_dt_RealTcpClient):
    def __init__(self, host, port, data_sample, *args, **kwargs):
        if (host, port) == ("learner-host", 50051):
            host, port = "127.0.0.1", _dt_start_learner(data_sample).port
        super().__init__(host, port, data_sample, *args, **kwargs)
        _dt_clients.append(self)


_dt_echo.TcpClient = _DtTcpClient
""",
        epilogue="""
assert _dt_clients, "no TcpClient was created"
for _dt_client in _dt_clients:
    _dt_client.close(timeout=10)
    assert _dt_client.sent > 0, "nothing was sent"
    assert _dt_client.acked == _dt_client.sent, _dt_client
""",
    ),
    "fake-env": Setup(
        doc="`env` (`reset()`, `step(action) -> (obs f32[4], reward, done)`) and `policy(obs)`;"
        " the 65th `env.step()` ends the example (4 trajectories of 16 steps).",
        prelude="""
class _DtEnv:
    def __init__(self):
        self.steps = 0

    def reset(self):
        return _dt_np.zeros(4, _dt_np.float32)

    def step(self, action):
        self.steps += 1
        if self.steps > 64:
            raise _DocsTestStop
        return _dt_np.full(4, self.steps, _dt_np.float32), 1.0, self.steps % 10 == 0


env = _DtEnv()


def policy(obs):
    return 0
""",
    ),
    "full-accumulator": Setup(
        doc="The trajectory guide's `example`, an `acc` with every slot filled, and a `step` item"
        " for 'steps'; afterwards `first` must show `step` in slot 0, as the page says.",
        prelude="""
import numpy as np
from echo import TrajectoryAccumulator

T, OBS = 16, 4
_dt_step = {"obs": np.zeros(OBS, np.float32), "action": np.int64(0), "reward": np.float32(0),
            "done": np.bool_(False)}
# The guide's `example`: T slots of every step leaf, and one bootstrap observation.
example = {
    "steps": {_dt_k: np.zeros((T, *np.shape(_dt_v)), np.asarray(_dt_v).dtype)
              for _dt_k, _dt_v in _dt_step.items()},
    "bootstrap": {"obs": np.zeros((1, OBS), np.float32)},
}
acc = TrajectoryAccumulator(example)
for _dt_t in range(T):
    acc.add("steps", {**_dt_step, "action": np.int64(_dt_t)})
acc.add("bootstrap", {"obs": np.zeros(OBS, np.float32)})
step = {"obs": np.full(OBS, 7, np.float32), "action": np.int64(1), "reward": np.float32(1),
        "done": np.bool_(True)}
""",
        epilogue="""
assert (first["steps"]["obs"][0] == step["obs"]).all(), first["steps"]["obs"][0]
""",
    ),
    "tcp-fed-server": Setup(
        doc="`example` and a `server` on 127.0.0.1 into which 64 samples were sent over TCP"
        " (all inserted by the drainers).",
        prelude=_EXAMPLE
        + """
from echo import TcpTransport

server = Server(example, batch_size=32, transport=TcpTransport(port=0, host="127.0.0.1"))
server.start()
_dt_feed_tcp(server, 64)
_dt_deadline = _dt_time.monotonic() + 10
while server.stats().samples_inserted_total < 64:
    assert _dt_time.monotonic() < _dt_deadline, server.stats()
    _dt_time.sleep(0.01)
""",
        epilogue="""
server.close()
""",
    ),
}

REQUIREMENTS = {
    "jax": (
        lambda: importlib.util.find_spec("jax") is not None,
        "needs JAX (the `test` extra: pip install -e '.[test]')",
    ),
    "torch": (
        lambda: importlib.util.find_spec("torch") is not None,
        "needs PyTorch, which CI does not install (see .ci/run)",
    ),
    "ray": (
        lambda: importlib.util.find_spec("ray") is not None,
        "needs Ray (the `distributed` extra: pip install -e '.[distributed]')",
    ),
    "detailed-metrics": (
        lambda: bool(echo.DETAILED_METRICS),
        "needs the telemetry build (cargo feature detailed-metrics); echo.DETAILED_METRICS is"
        " False in this one",
    ),
}


# --------------------------------------------------------------------------------------------
# Finding the blocks
# --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
_MARKER_TOKEN = re.compile(r'\s*(?:(?P<key>[a-z_-]+)="(?P<value>[^"]*)"|(?P<word>[a-z_-]+))')
_MARKER_KEYS = {"reason", "setup", "file", "raises", "requires"}
_PYTHON_LANGS = {"python", "py", "python3"}
# Any line that opens a python fence, however the collector treats it: a cross-check.
_NAIVE_PYTHON_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*\{?\.?(python3?|py)\b")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str = ""
    skip: str | None = None
    setups: tuple[str, ...] = ()
    file: str | None = None
    raises: str | None = None
    requires: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_marker(body: str, block: Block) -> None:
    pos = 0
    words: set[str] = set()
    values: dict[str, str] = {}
    while pos < len(body.rstrip()):
        token = _MARKER_TOKEN.match(body, pos)
        if token is None:
            block.errors.append(f"cannot parse marker text {body[pos:].strip()!r}")
            return
        if token["word"]:
            words.add(token["word"])
        else:
            values[token["key"]] = token["value"]
        pos = token.end()
    unknown = (words - {"skip"}) | (values.keys() - _MARKER_KEYS)
    if unknown:
        block.errors.append(f"unknown marker keys {sorted(unknown)}")
    if "skip" in words:
        reason = values.get("reason", "").strip()
        if not reason:
            block.errors.append('`skip` needs a non-empty reason="..."')
        block.skip = reason
    elif "reason" in values:
        block.errors.append("`reason` without `skip`")
    if "setup" in values:
        names = tuple(n for n in re.split(r"[,\s]+", values["setup"]) if n)
        missing = [n for n in names if n not in SETUPS]
        if missing or not names:
            block.errors.append(f"unknown setups {missing} (known: {sorted(SETUPS)})")
        block.setups += names
    if "file" in values:
        if not re.fullmatch(r"[\w.-]+\.py", values["file"]):
            block.errors.append(f"file={values['file']!r} is not a plain *.py file name")
        block.file = values["file"]
    if "raises" in values:
        exc = getattr(builtins, values["raises"], None)
        if not (isinstance(exc, type) and issubclass(exc, BaseException)):
            block.errors.append(f"raises={values['raises']!r} is not a built-in exception")
        block.raises = values["raises"]
    if "requires" in values:
        if values["requires"] not in REQUIREMENTS:
            block.errors.append(f"requires={values['requires']!r}: known {sorted(REQUIREMENTS)}")
        block.requires = values["requires"]
    if block.skip is not None and (block.setups or block.raises or block.requires):
        block.errors.append("a skipped block takes no other marker")


def _scan(path: Path) -> tuple[list[Block], list[str]]:
    """The python blocks of one markdown file, and its misplaced markers."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    stray: list[str] = []
    pending: list[tuple[int, str]] = []  # markers directly above the current line
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        if marker:
            pending.append((i + 1, marker["body"]))
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if not fence:
            stray += [f"{rel}:{n}: marker not directly above a ```python fence" for n, _ in pending]
            pending = []
            i += 1
            continue
        # A fenced block: find its end (same character, at least as long, nothing after it).
        indent, opener = fence["indent"], fence["fence"]
        info = fence["info"].strip()
        lang = info.split()[0].lstrip("{.").rstrip("}") if info else ""
        end = i + 1
        closing = re.compile(rf"^[ \t]*{re.escape(opener[0])}{{{len(opener)},}}[ \t]*$")
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        if lang in _PYTHON_LANGS:
            block = Block(rel, i + 1)
            body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
            block.code = "\n".join(body) + "\n"
            for _, text in pending:
                _parse_marker(text, block)
            if end == len(lines):
                block.errors.append("the fence is never closed")
            blocks.append(block)
        else:
            stray += [f"{rel}:{n}: marker above a ```{lang} fence" for n, _ in pending]
        pending = []
        i = end + 1
    stray += [f"{rel}:{n}: marker at the end of the file" for n, _ in pending]
    return blocks, stray


def _collect() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    stray: list[str] = []
    for path in _markdown_files():
        found, misplaced = _scan(path)
        blocks += found
        stray += misplaced
    return blocks, stray


BLOCKS, STRAY_MARKERS = _collect()


# --------------------------------------------------------------------------------------------
# Running a block
# --------------------------------------------------------------------------------------------


def _program(block: Block) -> str:
    """The `-c` program: driver, preludes, the block, epilogues."""
    filename = str(ROOT / block.path)
    # Blank lines up to the fence, so the block's line numbers are the markdown file's.
    source = "\n" * block.line + block.code
    parts = [
        f"""
import faulthandler as _dt_faulthandler
import sys as _dt_sys

# A hang shows every thread's stack before the test's timeout kills the process.
_dt_faulthandler.dump_traceback_later({TIMEOUT_S - 5}, exit=True)


class _DocsTestStop(BaseException):
    \"\"\"Raised by a setup's stand-in to end an example that would run forever.\"\"\"
"""
    ]
    setups = [SETUPS[name] for name in block.setups]
    if setups:
        parts.append(_BASE_PRELUDE)
    parts += [s.prelude for s in setups]
    if block.raises:
        parts.append(
            f"""
import ast as _dt_ast

for _dt_stmt in _dt_ast.parse({source!r}, {filename!r}).body:
    try:
        exec(compile(_dt_ast.Module([_dt_stmt], []), {filename!r}, "exec"))
    except {block.raises}:
        continue
    raise AssertionError(f"{block.path}:{{_dt_stmt.lineno}} raised no {block.raises}")
"""
        )
    else:
        parts.append(
            f"""
try:
    exec(compile({source!r}, {filename!r}, "exec"))
except _DocsTestStop:
    pass
"""
        )
    parts += [s.epilogue for s in reversed(setups)]
    if setups:
        parts.append(_BASE_EPILOGUE)
    # The block must have used the echo this test imported, not another installation.
    parts.append(
        f"""
_dt_echo_file = getattr(_dt_sys.modules.get("echo"), "__file__", None)
assert _dt_echo_file in (None, {echo.__file__!r}), f"imported another echo: {{_dt_echo_file}}"
_dt_faulthandler.cancel_dump_traceback_later()
"""
    )
    return "\n".join(textwrap.dedent(p) for p in parts)


def _environment(block: Block) -> dict[str, str]:
    env = dict(os.environ)
    if block.requires == "ray":
        # A local Ray advertises this machine's outside address unless told it is one node's
        # worth of loopback: the blocks keep every byte on loopback.
        env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if env.get("PYTHONPATH"):
        # The blocks run in another directory: keep relative entries pointing where they did.
        env["PYTHONPATH"] = os.pathsep.join(
            str(Path(p).resolve()) if p else p for p in env["PYTHONPATH"].split(os.pathsep)
        )
    return env


def _files_for(page: str) -> Iterator[Block]:
    return (b for b in BLOCKS if b.path == page and b.file is not None)


def _report(block: Block, what: str, stdout: str, stderr: str) -> str:
    setups = f" (setup: {', '.join(block.setups)})" if block.setups else ""
    return (
        f"{block.id}{setups} {what}\n--- code ---\n{block.code}"
        f"--- stdout ---\n{stdout}--- stderr ---\n{stderr}"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_docs_example(block: Block, tmp_path: Path) -> None:
    if block.errors:
        pytest.fail(f"{block.id}: bad docs-test marker: {'; '.join(block.errors)}")
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    if block.requires is not None:
        available, reason = REQUIREMENTS[block.requires]
        if not available():
            pytest.skip(f"{block.id}: {reason}")
    for file_block in _files_for(block.path):
        assert file_block.file is not None
        (tmp_path / file_block.file).write_text(file_block.code, encoding="utf-8")
    try:
        result = subprocess.run(
            [sys.executable, "-c", _program(block)],
            cwd=tmp_path,
            env=_environment(block),
            capture_output=True,
            text=True,
            timeout=RAY_TIMEOUT_S if block.requires == "ray" else TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:

        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        pytest.fail(_report(block, f"ran past {TIMEOUT_S} s", text(exc.stdout), text(exc.stderr)))
    if result.returncode != 0:
        pytest.fail(
            _report(block, f"exited with {result.returncode}", result.stdout, result.stderr)
        )


def test_markers_are_attached() -> None:
    """Every docs-test marker sits directly above a ```python fence."""
    assert not STRAY_MARKERS, "\n".join(STRAY_MARKERS)


def test_every_python_fence_is_collected() -> None:
    """The collector found every line that opens a python fence (no block escapes the test)."""
    for path in _markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        naive = [n for n, line in enumerate(lines, 1) if _NAIVE_PYTHON_FENCE.match(line)]
        assert naive == [b.line for b in BLOCKS if b.path == rel], rel
    assert len(BLOCKS) >= 40, f"only {len(BLOCKS)} python blocks found: is the parser broken?"


def test_setups_are_used() -> None:
    """Every setup and every `file=` block is used, so none lingers after the docs change."""
    used = {name for b in BLOCKS for name in b.setups}
    assert used == set(SETUPS), f"unused setups: {sorted(set(SETUPS) - used)}"
    for b in BLOCKS:
        if b.file is not None:
            others = [o for o in BLOCKS if o.path == b.path and o is not b]
            assert any(b.file in o.code for o in others), f"{b.id}: nothing uses {b.file}"


# Sentences the code proved wrong, as regular expressions over each page with its whitespace
# collapsed (so a sentence broken across lines still matches), each with what is true instead.
# A page that says one again fails here, whatever its examples do.
STALE_SENTENCES = {
    r"the wire format has no priority field": (
        "TcpClient.send(priority=) and send_batch(priority=) carry a priority over wire v2"
    ),
    r"rule it out \([^)]*`reconnect=True`": (
        "reconnect=True does not rule out shared memory: each new connection asks again"
    ),
    r"wire protocol is that of the published `id-echo` 0\.2\.1": (
        "echo speaks wire v2 and falls back to v1 (id-echo 0.2.1) with its peers"
    ),
    r"`TcpClient`, wire protocol v1\)": (
        "echo speaks wire v2 and falls back to v1 (id-echo 0.2.1) with its peers"
    ),
    r"carries shapes and element sizes, not dtypes": (
        "wire v2 checks every leaf's dtype, byte order and name"
    ),
}


@pytest.mark.parametrize("pattern", STALE_SENTENCES)
def test_no_page_repeats_a_stale_sentence(pattern: str) -> None:
    found = []
    for path in _markdown_files():
        text = " ".join(path.read_text(encoding="utf-8").split())
        for match in re.finditer(pattern, text, flags=re.IGNORECASE):
            found.append(f"{path.relative_to(ROOT).as_posix()}: ...{match.group(0)}...")
    assert not found, f"stale: {'; '.join(found)} (true instead: {STALE_SENTENCES[pattern]})"
