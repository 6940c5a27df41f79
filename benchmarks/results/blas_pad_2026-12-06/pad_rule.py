"""benchmarks/exact_mode.py with the pads exact mode's start-up check tries (models.exact_blas.PAD_ROWS) set from
the environment: PAD_ROWS="" tries none (o_proj and down stay on the Triton matmul where their plain cuBLAS calls
change with the row count, as before git 7ec87ff), PAD_ROWS="16,32" those; unset: the module's. For a
before/after in one device call; the arguments are exact_mode.py's."""
import os
import runpy
import sys

from ddtree.models import exact_blas

if "PAD_ROWS" in os.environ:
    exact_blas.PAD_ROWS = tuple(int(r) for r in os.environ["PAD_ROWS"].split(",") if r.strip())
print(f"exact mode's cuBLAS pads tried: {exact_blas.PAD_ROWS}", flush=True)
sys.argv[0] = "benchmarks/exact_mode.py"
runpy.run_path("benchmarks/exact_mode.py", run_name="__main__")
