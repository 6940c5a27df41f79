#!/bin/bash
# One device call (2026-12-04): mixed rounds with chunks as large as a prefill step (EngineConfig.mixed_chunk 2048
# = prefill_chunk, so prompts are admitted as fast as by prefill steps) and 512, against none, in one call: C = 64,
# contexts 60 and 1k, four waves, AR / chain / b7 / budget auto. Then the graphed-round GPU tests, which have not run
# since RoundGraphs.run was split and the mixed capture moved under Recorder.record_stages (git 7254e78, 0aa8c55).
# Run from the repository root with OUT set: bash benchmarks/results/mixed_2026-12-04b/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
run() {  # run MIXED CONTEXTS SECONDS
  timeout "$3" python3 benchmarks/gpu.py --out "$OUT/m$1" --no-hf --auto --contexts "$2" --concurrency 64 \
    --budgets 7 --waves 4 --mixed-chunk "$1" --time-budget $(( $3 - 40 )) > "$OUT/m$1.log" 2>&1 \
    || echo "gpu.py (mixed $1) failed or timed out"
  echo "mixed $1 done at ${SECONDS}s"
  grep "^| 64" "$OUT/m$1.log" | cut -d'|' -f1-6,10-12 | head -10
  grep -c "failed in its CUDA graphs" "$OUT/m$1.log"
}
run 2048 60,1024 215
run 0 60,1024 200
run 512 1024 $(( 500 - SECONDS ))
timeout $(( 585 - SECONDS )) python3 -m pytest -q -m gpu tests/engine/test_cuda_graphs.py tests/engine/test_mixed_rounds.py \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log" | cut -c1-300
echo "all done at ${SECONDS}s"
