"""Tree attention's combine tile rule (``tuning.choose_combine_tile``) against the compiler: every tile it picks for
the engine's unrolled partial counts compiles for sm_90 (H100/H200) without spilling, while the split's own 64 x 64
tile at 17 partials spills (so the check can tell). Compiled on the CPU with Triton's bundled ptxas and read back
with its cuobjdump by ``benchmarks/combine_registers.py``, in a process of its own: the suite interprets the
kernels (``TRITON_INTERPRET``), which then do not compile. Skipped where the Triton install has no CUDA tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from benchmark_scripts import script_path  # noqa: E402

from ddtree import tuning  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists() or not (TOOLS / "ptxas").exists(),
                    reason="this Triton has no bundled ptxas/cuobjdump")
def test_the_rules_tiles_compile_without_spills_and_the_split_tile_does_not(tmp_path):
    out = tmp_path / "registers.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(script_path("combine_registers")), "--unroll", "5,9,17", "--rows", "16,64",
                    "--cols", "16,32,64", "--json", str(out)], check=True, env=env, capture_output=True, timeout=300)
    stack = {(t["unroll"], t["rows"], t["cols"]): t["STACK"] for t in json.loads(out.read_text())["tiles"]}
    assert len(stack) == 18
    for unroll in (5, 9, 17):
        tile = tuning.choose_combine_tile(64, unroll, 128)
        assert stack[(unroll, *tile)] == 0, (unroll, tile)
    assert stack[(17, 64, 64)] > 0
