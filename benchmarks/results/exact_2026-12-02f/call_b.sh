#!/bin/bash
# One device call (2026-12-02, after call_a.sh): the fused launch's tails in a kernel of their own (a program per
# query) beside the tails in their tile's program, the attention GPU tests, and where a served round's device time
# goes at C = 64 now (benchmarks/profile_rounds.py, the chain and DDTree 8, both modes).
# It ran on a working tree whose batch_invariant.attention had a ``tail_kernel=`` launch option (a second kernel,
# _attention_tail_kernel, one program per tree query, resuming from the stored state) and whose tune timed it as
# ``exact_fused_tk`` (call_b_tune_bucket.log). The option gained 2-8 us at C = 64 and cost the chain 17 us (its
# empty programs), so it was removed before the commit; on the committed tree this script fails at ``tail_kernel``.
# The profile ran out of its time after the default engine's cells (no exact-mode profile came back).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02f/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
HERE=benchmarks/results/exact_2026-12-02f
timeout 120 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider -k fused_launch \
  2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 170 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" --bucket \
  2>&1 | tee "$OUT/tune_bucket.log" | cut -c1-460
echo "tune done at ${SECONDS}s"
timeout "$(( 450 - SECONDS ))" python3 benchmarks/profile_rounds.py --out "$OUT/prof" --methods dflash,ddtree-8 \
  --concurrency 64 --context 1024 --top 16 2>&1 | grep -v USDT | grep -v "^\[W" | tail -50 | cut -c1-300
echo "all done at ${SECONDS}s"
