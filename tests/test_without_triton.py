"""Triton is optional (a test extra; no wheels outside Linux): every module imports and the engine decodes on its
torch paths when ``import triton`` fails, as on a fresh ``pip install ddtree`` without the extras."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as when it is not installed
import pkgutil, importlib, ddtree
for mod in pkgutil.walk_packages(ddtree.__path__, "ddtree."):
    importlib.import_module(mod.name)
from ddtree import triton_runtime
assert triton_runtime.triton is None and triton_runtime.masked_if is None
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
with Engine.from_config(EngineConfig(device="cpu", max_batch=1, max_len=256)) as engine:
    out = engine.generate([GenerationRequest(prompt="def f(x):", tree=TreeSettings(method="ddtree", budget=4),
                                             sampling=SamplingParams(max_tokens=8, ignore_eos=True))])[0]
assert len(out.token_ids) == 8, out
print("ok")
"""


def test_every_module_imports_and_the_engine_runs_without_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
