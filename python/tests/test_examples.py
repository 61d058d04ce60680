"""The examples in examples/ run, small, and check what they claim (each asserts its own)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.skipif(
    importlib.util.find_spec("gymnasium") is None,
    reason="needs gymnasium (the `test` extra: pip install -e '.[test]')",
)
@pytest.mark.timeout(150)
def test_dqn_distributed_example_survives_a_learner_restart(tmp_path: Path) -> None:
    # --ci: 2 worker processes x 4 CartPole envs, 4,000 transitions each, at most 40 s of
    # training (a few seconds on 2 idle cores), a checkpoint, a restart on the same port, and
    # the example's own check that every transition that had to survive is in the restored
    # table once. The process is bounded at 120 s; CI's budget for it is under 90.
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "dqn_distributed.py"), "--ci", f"--run-dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "restored on the same port" in result.stdout, output
    assert "nothing lost:" in result.stdout, output
    # The workers rode through on reconnect=True, and their warnings name them.
    assert "worker-0 (127.0.0.1:" in result.stderr, output


@pytest.mark.timeout(60)
def test_llm_rollouts_example_delivers_every_group_whole() -> None:
    # 2 worker threads, 24 prompts x 4 completions of up to 128 tokens, FIFO batches of at
    # most 1,024 completion tokens: about a second on 2 idle cores. The example checks that
    # every completion arrived once and every group came whole in one batch.
    args = ["--prompts", "24", "--group-size", "4", "--workers", "2", "--batch-tokens", "1024"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "llm_rollouts.py"), *args],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "96 completions in 24 groups of 4" in result.stdout, output
    assert "nothing lost:" in result.stdout, output
