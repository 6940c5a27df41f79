"""benchmarks/exact_mode.py with exact attention's large-tree threshold as before 2026-12-06 (ATTN_LARGE_MIN_FOLDED
128: trees of 17-32 nodes in 32-row programs at every concurrency), for a before/after in one device call; the
arguments are exact_mode.py's."""
import runpy
import sys

from ddtree.models import batch_invariant as bi

bi.ATTN_LARGE_MIN_FOLDED = 128
sys.argv[0] = "benchmarks/exact_mode.py"
runpy.run_path("benchmarks/exact_mode.py", run_name="__main__")
