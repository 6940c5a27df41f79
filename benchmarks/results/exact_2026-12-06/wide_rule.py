"""benchmarks/exact_mode.py with exact attention's wide programs on (one 128-row, 8-warp program for a tree of 17-32
nodes where a call has WIDE_MIN_PER_TILE to WIDE_MAX_PER_TILE rows x KV heads; fused when WIDE_FUSED is 1), for a before/after
in one device call; the arguments are exact_mode.py's."""
import os
import runpy
import sys

from ddtree.models import batch_invariant as bi

bi.ATTN_WIDE_MIN_PER_TILE = int(os.environ.get("WIDE_MIN_PER_TILE", bi.ATTN_WIDE_MIN_PER_TILE))
bi.ATTN_WIDE_MAX_PER_TILE = int(os.environ["WIDE_MAX_PER_TILE"])
bi.ATTN_WIDE_FUSED = os.environ.get("WIDE_FUSED", "1") == "1"
print(f"wide programs at {bi.ATTN_WIDE_MIN_PER_TILE} to {bi.ATTN_WIDE_MAX_PER_TILE} rows x KV heads, fused: {bi.ATTN_WIDE_FUSED}", flush=True)
sys.argv[0] = "benchmarks/exact_mode.py"
runpy.run_path("benchmarks/exact_mode.py", run_name="__main__")
