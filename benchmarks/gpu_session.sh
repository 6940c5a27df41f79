#!/usr/bin/env bash
# One H200 device call (at most 10 minutes): the Triton kernels' tests on the GPU, the tree-op timings, then the
# engine on the Qwen3-8B stand-in at concurrency 1 and then 64 / 8. If any kernel's GPU tests fail, the engine runs
# with EngineConfig(gpu_kernels=False) (gpu.py --no-kernels) and the log says so.
#   OUT=/some/dir bash benchmarks/gpu_session.sh
# pytest is installed from build/wheels (carry it) when the machine lacks it.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
SECONDS=0
if ! python3 -c "import pytest" 2>/dev/null; then
  pip install -q --no-index --target /tmp/pydeps build/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/pydeps"
fi
kernels=()
for file in tests/models/test_fused_ops.py tests/models/test_tree_attention.py tests/spec/test_vocab_topk.py; do
  log="$OUT/$(basename "$file" .py).log"
  if python3 -m pytest -q -p no:cacheprovider "$file" >"$log" 2>&1; then
    echo "$file: GPU tests pass ($(tail -1 "$log"))"
  else
    kernels=(--no-kernels)
    echo "$file: GPU tests FAIL ($(tail -1 "$log")): the engine runs without the Triton kernels"
  fi
done
echo "tests done at ${SECONDS}s"
python3 benchmarks/tree_ops.py --device cuda --cuda-graph --dtype bfloat16 --out "$OUT/tree_ops.json" \
  >"$OUT/tree_ops.md" 2>&1 || echo "tree_ops failed: $(tail -3 "$OUT/tree_ops.md")"
echo "tree ops done at ${SECONDS}s"
python3 benchmarks/gpu.py --out "$OUT/c1" --no-hf "${kernels[@]}" --concurrency 1 --contexts 1024,60,8192,4096 \
  --budgets 8,16,32,64,128,256 --time-budget 150 >"$OUT/c1.log" 2>&1 || echo "c1 failed: $(tail -3 "$OUT/c1.log")"
echo "c1 done at ${SECONDS}s"
python3 benchmarks/gpu.py --out "$OUT/c64" --no-hf "${kernels[@]}" --concurrency 64,32,8 --contexts 60,1024 \
  --budgets 8,16,32 --time-budget "$(( 560 - SECONDS ))" >"$OUT/c64.log" 2>&1 || echo "c64 failed: $(tail -3 "$OUT/c64.log")"
echo "c64 done at ${SECONDS}s"
tail -25 "$OUT/tree_ops.md"
cat "$OUT/c1/gpu.md" "$OUT/c64/gpu.md" 2>/dev/null
