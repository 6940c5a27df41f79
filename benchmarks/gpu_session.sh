#!/usr/bin/env bash
# The H200 measurements, as device calls of at most 10 minutes each (carry build/wheels for pytest):
#   OUT=/some/dir bash benchmarks/gpu_session.sh kernels   # kernel tests on the GPU, tree ops, vocabulary pass,
#                                                          # tree-attention tile sweep, kernel profile, divergence
#   OUT=/some/dir bash benchmarks/gpu_session.sh engine    # the engine on the Qwen3-8B stand-in at C=64/32/8, contexts
#                                                          # 60 and 1k, 4 waves (~8.5 min; run 38); C=1 is c1x8
#   OUT=/some/dir bash benchmarks/gpu_session.sh long      # C=8 at 4k and 8k (2 waves), then C=64/32 at 4k (one wave)
#                                                          # (~8 min; runs 39, 40)
#   OUT=/some/dir bash benchmarks/gpu_session.sh long8k    # C=64/32 at 8k, one wave per cell (~7 min; run 40)
#   OUT=/some/dir bash benchmarks/gpu_session.sh budgets   # GPU tests of the graphs, then budgets outside the main
#                                                          # matrix: 512 at C=1, 32-256 at C>=8, and HF generate
#                                                          # (~7 min; run 20)
#   OUT=/some/dir bash benchmarks/gpu_session.sh fp8       # the fp8 drafter: its GPU tests, C=1 at 1k and 60, C=64
#                                                          # and 8 at 60, all with --draft-fp8 (~4 min; run 23)
#   OUT=/some/dir bash benchmarks/gpu_session.sh c1x8      # C=1 with 8 prompts a cell, budgets 2^k - 1 and 2^k from
#                                                          # 15 to 128, every context (~4.5 min; run 33)
#   OUT=/some/dir bash benchmarks/gpu_session.sh rows      # one verify forward's cost against its row count (16 vs
#                                                          # 17, 64 vs 65, ...) at contexts 60 and 4096, cuBLAS and
#                                                          # cuBLASLt (~1.5 min; run 31)
#   OUT=/some/dir bash benchmarks/gpu_session.sh twice     # the same C=8 cells (1k; AR, chain, b8, b16) in two gpu.py
#                                                          # processes, with timelines and Triton compile logs: run 37
#                                                          # found the first-use stalls of runs 32-35 (~3 min)
#   OUT=/some/dir bash benchmarks/gpu_session.sh warmup    # GPU tests of the graphs, the warm-up and exact mode's
#                                                          # kernels, then --warmup full on a cold and a warm Triton
#                                                          # cache with the workloads and a re-capture (~8 min)
#   OUT=/some/dir bash benchmarks/gpu_session.sh exact     # exact attention per round shape, then exact mode's price
#                                                          # against the default engine (~9 min)
# Then: python benchmarks/gpu_report.py MAIN_RUNS/gpu.json ... --extra BUDGETS_RUNS/gpu.json --out docs/benchmarks
# If any kernel's GPU tests fail in the kernels part, the log says so; run the engine part with NO_KERNELS=1 then.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
SECONDS=0
part=${1:-kernels}

if [ "$part" = kernels ]; then
  if ! python3 -c "import pytest" 2>/dev/null; then
    pip install -q --no-index --target /tmp/pydeps build/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/pydeps"
  fi
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/models/test_fused_ops.py tests/models/test_tree_attention.py \
    tests/speculative/test_vocab_topk.py tests/speculative/test_tree_select.py tests/engine/test_engine_kernels.py \
    >"$OUT/kernel_tests.log" 2>&1
  echo "kernel tests on the GPU: rc=$? $(tail -1 "$OUT/kernel_tests.log") at ${SECONDS}s"
  { timeout 60 python3 benchmarks/tree_ops.py --device cuda --cuda-graph --dtype bfloat16 --rows 1 8 32 64 \
      --budgets 8 16 64 256 512 --out "$OUT/tree_ops.json"
    timeout 60 python3 benchmarks/vocab_topk.py; } >"$OUT/tree_ops.md" 2>&1
  echo "tree ops at ${SECONDS}s"; grep "^|" "$OUT/tree_ops.md" | head -40
  timeout 100 python3 benchmarks/tree_attention.py --out "$OUT/tree_attention.json" --time-budget 90 | grep "^|"
  echo "tile sweep at ${SECONDS}s"
  timeout 60 python3 benchmarks/profile_step.py --out "$OUT/profile.md" --context 1024 >/dev/null 2>&1
  echo "profile at ${SECONDS}s"; grep -A3 "^## " "$OUT/profile.md" | grep "device time"
  timeout $(( 580 - SECONDS )) python3 benchmarks/divergence.py --out "$OUT/div" --prompts 4 --tokens 128 | tail -6
  echo "divergence at ${SECONDS}s"
elif [ "$part" = long8k ]; then
  # 65 slots of 8k: a 1024-token prefill chunk keeps the per-slot headroom small enough to fit (peak 112 GiB).
  # Every cell runs twice (untimed, then timed): C=64 took 213 s for AR, chain, b4 and b8 in run 40.
  python3 benchmarks/gpu.py --out "$OUT/c8k" --no-hf --concurrency 64,32 --contexts 8192 --budgets 4,8 --waves 1 \
    --prefill-chunk 1024 --time-budget 540 >/dev/null 2>&1 || echo "c8k failed"
  echo "c8k done at ${SECONDS}s"; cat "$OUT/c8k/gpu.md" 2>/dev/null
elif [ "$part" = fp8 ]; then
  if ! python3 -c "import pytest" 2>/dev/null; then
    pip install -q --no-index --target /tmp/pydeps build/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/pydeps"
  fi
  timeout 130 python3 -m pytest -q -p no:cacheprovider tests/models/test_fp8.py >"$OUT/fp8_tests.log" 2>&1
  echo "fp8 tests on the GPU: rc=$? $(tail -1 "$OUT/fp8_tests.log") at ${SECONDS}s"
  python3 benchmarks/gpu.py --out "$OUT/c1_fp8" --no-hf --draft-fp8 --concurrency 1 --contexts 1024,60 \
    --budgets 8,16,64,128 --time-budget 150 >/dev/null 2>&1 || echo "c1_fp8 failed"
  echo "c1_fp8 done at ${SECONDS}s"
  python3 benchmarks/gpu.py --out "$OUT/c64_fp8" --no-hf --draft-fp8 --concurrency 64,8 --contexts 60 \
    --budgets 4,8,16 --time-budget "$(( 500 - SECONDS ))" >/dev/null 2>&1 || echo "c64_fp8 failed"
  echo "c64_fp8 done at ${SECONDS}s"
  cat "$OUT/c1_fp8/gpu.md" "$OUT/c64_fp8/gpu.md" 2>/dev/null
elif [ "$part" = budgets ]; then
  if ! python3 -c "import pytest" 2>/dev/null; then
    pip install -q --no-index --target /tmp/pydeps build/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/pydeps"
  fi
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/engine/test_engine_kernels.py \
    >"$OUT/tests.log" 2>&1
  echo "graph and kernel tests on the GPU: rc=$? $(tail -1 "$OUT/tests.log") at ${SECONDS}s"
  python3 benchmarks/gpu.py --out "$OUT/c1_b512" --concurrency 1 --contexts 1024,60,4096,8192 --budgets 512 \
    --time-budget 130 >/dev/null 2>&1 || echo "c1_b512 failed"
  echo "c1_b512 and HF generate done at ${SECONDS}s"
  python3 benchmarks/gpu.py --out "$OUT/big" --no-hf --concurrency 8,32,64 --contexts 1024,60 \
    --budgets 32,64,128,256 --time-budget "$(( 560 - SECONDS ))" >/dev/null 2>&1 || echo "big failed"
  echo "big done at ${SECONDS}s"
  cat "$OUT/c1_b512/gpu.md" "$OUT/big/gpu.md" 2>/dev/null
elif [ "$part" = rows ]; then
  for lib in cublas cublaslt; do
    timeout 250 python3 benchmarks/verify_rows.py --blas $lib --out "$OUT/verify_rows_$lib.json" --contexts 60,4096 \
      | grep "^|"
  done
  echo "rows done at ${SECONDS}s"
elif [ "$part" = twice ]; then
  for i in 1 2; do
    python3 benchmarks/gpu.py --out "$OUT/c8_run$i" --no-hf --concurrency 8 --contexts 1024 --budgets 8,16 \
      --time-budget 150 >/dev/null 2>&1 || echo "c8 run $i failed"
    echo "c8 run $i done at ${SECONDS}s"; grep "^| 8 " "$OUT/c8_run$i/gpu.md" 2>/dev/null
  done
elif [ "$part" = c1x8 ]; then
  # Three prompts a cell (gpu.py's default) rank budgets poorly at long contexts; eight took 246 s in all in run 33.
  python3 benchmarks/gpu.py --out "$OUT/c1x8" --no-hf --concurrency 1 --contexts 4096,8192,1024,60 \
    --budgets 15,31,32,63,64,127,128 --c1-prompts 8 --time-budget 400 >/dev/null 2>&1 || echo "c1x8 failed"
  echo "c1x8 done at ${SECONDS}s"; cat "$OUT/c1x8/gpu.md" 2>/dev/null
elif [ "$part" = long ]; then
  # Prefill-bound cells (64 x 4k prompts take seconds to prefill): few waves to fit 10 minutes (C=8: 126 s in run 39;
  # C=64 at 4k: 160 s for AR, chain, b4 and b8 in run 40).
  python3 benchmarks/gpu.py --out "$OUT/c8long" --no-hf --concurrency 8 --contexts 4096,8192 --budgets 4,8,16 \
    --waves 2 --time-budget 150 >/dev/null 2>&1 || echo "c8long failed"
  echo "c8long done at ${SECONDS}s"
  python3 benchmarks/gpu.py --out "$OUT/c4k" --no-hf --concurrency 64,32 --contexts 4096 --budgets 4,8 \
    --waves 1 --time-budget "$(( 540 - SECONDS ))" >/dev/null 2>&1 || echo "c4k failed"
  echo "c4k done at ${SECONDS}s"; cat "$OUT/c8long/gpu.md" "$OUT/c4k/gpu.md" 2>/dev/null
elif [ "$part" = warmup ]; then
  if ! python3 -c "import pytest" 2>/dev/null; then
    pip install -q --no-index --no-deps --target /tmp/pydeps build/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/pydeps"
  fi
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_cuda_graphs.py \
    tests/engine/test_warmup_gpu.py tests/models/test_batch_invariant.py >"$OUT/gpu_tests.log" 2>&1
  echo "graph, warm-up and exact-kernel tests on the GPU: rc=$? $(tail -1 "$OUT/gpu_tests.log") at ${SECONDS}s"
  export TRITON_CACHE_DIR=/tmp/ddtree-triton-cache  # empty on a fresh machine: the first process is the cold one
  timeout 150 python3 benchmarks/first_request.py --out "$OUT/cold_full" --warmup full --no-workloads \
    >"$OUT/cold_full.log" 2>&1 || echo "cold_full failed"
  grep -E "ready in" "$OUT/cold_full.log"; echo "cold done at ${SECONDS}s"
  timeout "$(( 570 - SECONDS ))" python3 benchmarks/first_request.py --out "$OUT/warm_full" --warmup full \
    --recapture 20 --cell-repeats 2 >"$OUT/warm_full.log" 2>&1 || echo "warm_full failed"
  grep -E "ready in|s then|recapture|misses|median" "$OUT/warm_full.log"; echo "warm done at ${SECONDS}s"
elif [ "$part" = exact ]; then
  ref=()  # REF=a single-file batch_invariant.py from before the package (carried) times that copy beside this tree's
  [ -n "${REF:-}" ] && ref=(--ref "$REF")
  timeout 90 python3 benchmarks/exact_attention_tune.py --out "$OUT" "${ref[@]}" | tail -10
  echo "exact attention at ${SECONDS}s"
  timeout "$(( 580 - SECONDS ))" python3 benchmarks/exact_mode.py --out "$OUT" --time-budget "$(( 520 - SECONDS ))" \
    >"$OUT/exact_mode.log" 2>&1 || echo "exact_mode failed"
  tail -25 "$OUT/exact_mode.log"
else
  kernels=()
  [ -n "${NO_KERNELS:-}" ] && kernels=(--no-kernels)
  # Budget 4 joins at C >= 8 (run 8's best at C = 64 was the list's bottom, 8); 32 was never best there. Each cell
  # runs untimed once, then timed (again if the timed run met a first-use cost): 502 s in all in run 38.
  python3 benchmarks/gpu.py --out "$OUT/c64" --no-hf "${kernels[@]}" --concurrency 64,32,8 --contexts 60,1024 \
    --budgets 4,8,16 --time-budget "$(( ${C64_END:-540} - SECONDS ))" >/dev/null 2>&1 || echo "c64 failed"
  echo "c64 done at ${SECONDS}s"
  cat "$OUT/c64/gpu.md" 2>/dev/null
fi
