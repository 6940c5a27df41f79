#!/bin/bash
# One device call (2026-12-02): where the tokenizer's load goes on the GPU image (Python bytecode, custom-op
# registrations), a second sweep of exact attention's split size, the exact kernels' and warm-up's GPU tests, then
# `--warmup full` on an empty Triton cache and bytecode cache, on both warm, and on a warm Triton cache alone.
# Run from the repository root with OUT set: bash benchmarks/results/startup_2026-12-02b/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
python3 - <<'EOF'
import glob, os, sys
import torch, transformers
for m in (transformers, torch):
    d = os.path.dirname(m.__file__)
    print(m.__name__, m.__version__, "writable:", os.access(d, os.W_OK), "pyc:",
          len(glob.glob(d + "/**/__pycache__/*.pyc", recursive=True)), "py:", len(glob.glob(d + "/**/*.py", recursive=True)))
print("dont_write_bytecode", sys.dont_write_bytecode, "uid", os.getuid(), "python", sys.version.split()[0])
EOF
TIMEFORMAT="%R s"
for i in 1 2; do echo -n "import AutoTokenizer, no bytecode cache: "; { time python3 -c "from transformers import AutoTokenizer"; } 2>&1; done
for i in 1 2; do echo -n "import AutoTokenizer, PYTHONPYCACHEPREFIX: "; { time PYTHONPYCACHEPREFIX=/tmp/pyc-probe python3 -c "from transformers import AutoTokenizer"; } 2>&1; done
PYTHONPYCACHEPREFIX=/tmp/pyc-probe python3 -X importtime -c "from transformers import AutoTokenizer" 2>"$OUT/importtime.txt"
sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -12 | cut -c1-150
PYTHONPYCACHEPREFIX=/tmp/pyc-probe python3 - <<'EOF'
import time, traceback
from torch._library import custom_ops
orig = custom_ops.CustomOpDef.__init__
def timed(self, namespace, name, *a, **k):
    t = time.perf_counter(); orig(self, namespace, name, *a, **k); dt = time.perf_counter() - t
    frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename and "custom_ops" not in f.filename
              and "torch/library.py" not in f.filename]
    print(f"custom op {namespace}::{name} {dt:.2f} s from {frames[-1].filename}:{frames[-1].lineno}")
custom_ops.CustomOpDef.__init__ = timed
t = time.perf_counter()
from transformers import AutoTokenizer
from ddtree.models.standin import load_demo_benchmark_pair  # noqa: F401
print(f"imports {time.perf_counter() - t:.2f} s")
EOF
echo "probe done at ${SECONDS}s"
timeout 150 python3 benchmarks/exact_attention_tune.py --out "$OUT/sweep2" --sweep \
  --settings 64:512:4:2,64:1024:4:2,64:512:4:3,64:1024:4:3,64:2048:4:2 2>&1 | tee "$OUT/sweep2.log" | cut -c1-330
echo "sweep done at ${SECONDS}s"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/models/test_batch_invariant.py \
  tests/engine/test_warmup_gpu.py >"$OUT/gpu_tests.log" 2>&1
echo "exact-kernel and warm-up GPU tests: rc=$? $(tail -1 "$OUT/gpu_tests.log") at ${SECONDS}s"
export TRITON_CACHE_DIR=/tmp/ddtree-triton-fresh
PYTHONPYCACHEPREFIX=/tmp/ddtree-pyc timeout 150 python3 benchmarks/first_request.py --out "$OUT/cold_full" \
  --warmup full --no-workloads >"$OUT/cold_full.log" 2>&1 || echo "cold_full failed"
grep -E "ready in" "$OUT/cold_full.log" | cut -c1-200; echo "cold done at ${SECONDS}s"
PYTHONPYCACHEPREFIX=/tmp/ddtree-pyc timeout 100 python3 benchmarks/first_request.py --out "$OUT/warm_full" \
  --warmup full --no-workloads >"$OUT/warm_full.log" 2>&1 || echo "warm_full failed"
grep -E "ready in" "$OUT/warm_full.log" | cut -c1-200; echo "warm done at ${SECONDS}s"
timeout "$(( 590 - SECONDS ))" python3 benchmarks/first_request.py --out "$OUT/warm_full_nopyc" \
  --warmup full --no-workloads >"$OUT/warm_full_nopyc.log" 2>&1 || echo "warm_full_nopyc failed"
grep -E "ready in" "$OUT/warm_full_nopyc.log" | cut -c1-200; echo "warm without bytecode cache done at ${SECONDS}s"
for f in cold_full warm_full warm_full_nopyc; do
  python3 -c "import json,sys; s=json.load(open('$OUT/$f/first_request.json'))['startup']; s.pop('compiles_during_start'); print('$f', s)" 2>/dev/null
done
