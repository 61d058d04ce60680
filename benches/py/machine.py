"""Facts about the machine and checkout that every benchmark result records."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

__all__ = ["cpu_model", "git_commit"]


def git_commit() -> str | None:
    """The checkout's HEAD commit, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def cpu_model() -> str | None:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
