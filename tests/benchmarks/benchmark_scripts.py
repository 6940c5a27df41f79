"""The benchmark scripts under ``benchmarks/`` as importable modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script_path(name: str) -> Path:
    return BENCHMARKS / f"{name}.py"


def load_script(name: str) -> ModuleType:
    """benchmarks/<name>.py, executed as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
