"""Runs one suite's ``measure`` in this interpreter: ``python -m benches._child MODULE
PARAMS_JSON OUT_JSON``, from the repository root (what ``python -m benches`` starts for each
side of a suite run). Writes ``{"interpreter": {...}, "result": ...}`` or, when the
measurement raised, ``{"interpreter": {...}, "error": "..."}`` to OUT_JSON; exit status 0
when a result was written, 1 otherwise."""

from __future__ import annotations

import importlib
import json
import platform
import sys
import traceback
from typing import Any


def interpreter() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "executable": sys.executable,
        "python_version": platform.python_version(),
    }
    for name in ("numpy", "echo"):
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            facts[f"{name}_error"] = str(e)
            continue
        facts[f"{name}_version"] = getattr(module, "__version__", None)
        if name == "echo":
            facts["echo_path"] = getattr(module, "__file__", None)
    return facts


def main(argv: list[str]) -> int:
    module_name, params_json, out_path = argv
    doc: dict[str, Any] = {"interpreter": interpreter()}
    status = 0
    try:
        module = importlib.import_module(module_name)
        doc["result"] = module.measure(json.loads(params_json))
    except Exception as e:  # noqa: BLE001  reported in the record, not lost
        traceback.print_exc()
        doc["error"] = f"{type(e).__name__}: {e}"
        status = 1
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
