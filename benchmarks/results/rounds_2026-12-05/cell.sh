# Sourced by this folder's calls: cell NAME CONTEXTS SECONDS [gpu.py flags...] runs benchmarks/gpu.py at C = 64, four
# waves, AR / chain / b7 / budget auto, within SECONDS, its log at $OUT/NAME.log, and prints the C = 64 rows.
cell() {
  local name=$1 contexts=$2 secs=$3; shift 3
  timeout "$secs" python3 benchmarks/gpu.py --out "$OUT/$name" --no-hf --auto --contexts "$contexts" --concurrency 64 \
    --budgets 7 --waves 4 --time-budget $(( secs - 35 )) "$@" > "$OUT/$name.log" 2>&1 \
    || echo "gpu.py ($name) failed or timed out"
  echo "$name done at ${SECONDS}s"
  grep "^| 64" "$OUT/$name.log" | cut -d'|' -f1-6,10-12 | head -10
  grep -c "failed in its CUDA graphs" "$OUT/$name.log"
}
