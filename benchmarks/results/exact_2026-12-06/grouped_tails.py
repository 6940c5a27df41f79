"""benchmarks/exact_mode.py with every tree forward's tails grouped (tail_chunks), as before 2026-12-06's
groups_tails (which gives forwards that take the split launch a chunk per query), for a before/after in one device
call; the arguments are exact_mode.py's."""
import runpy
import sys

from ddtree.models import batch_invariant as bi

bi.groups_tails = lambda rows, tokens, group, kv_heads: True
sys.argv[0] = "benchmarks/exact_mode.py"
runpy.run_path("benchmarks/exact_mode.py", run_name="__main__")
