"""benchmarks/exact_mode.py with exact attention's extra rows and small last tiles set from the environment
(EXTRA_ROWS, SMALL_TAIL_ROWS: 0 turns them off, the rule before them; EXTRA_WARPS; EXTRA_MIN_PER_TILE), for a
before/after in one device call; the arguments are exact_mode.py's. Ran at git 81d089b (calls I and J); the extra
rows' constants left the module with git 5e4bce2, where setting them does nothing."""
import os
import runpy
import sys

from ddtree.models import batch_invariant as bi

bi.ATTN_EXTRA_ROWS = int(os.environ.get("EXTRA_ROWS", getattr(bi, "ATTN_EXTRA_ROWS", 0)))
bi.ATTN_EXTRA_WARPS = int(os.environ.get("EXTRA_WARPS", getattr(bi, "ATTN_EXTRA_WARPS", 4)))
bi.ATTN_EXTRA_MIN_PER_TILE = int(os.environ.get("EXTRA_MIN_PER_TILE", getattr(bi, "ATTN_EXTRA_MIN_PER_TILE", 64)))
bi.ATTN_SMALL_TAIL_ROWS = int(os.environ.get("SMALL_TAIL_ROWS", bi.ATTN_SMALL_TAIL_ROWS))
print(f"extra rows {bi.ATTN_EXTRA_ROWS} at {bi.ATTN_EXTRA_WARPS} warps from {bi.ATTN_EXTRA_MIN_PER_TILE} rows x KV "
      f"heads; small last tiles {bi.ATTN_SMALL_TAIL_ROWS}", flush=True)
sys.argv[0] = "benchmarks/exact_mode.py"
runpy.run_path("benchmarks/exact_mode.py", run_name="__main__")
