#!/usr/bin/env bash
# The field's own clients against `ddtree serve` on the demo pair (CPU, loopback): lm-evaluation-harness
# (local-completions: a small local generate task and a local multiple-choice task), GuideLLM and AIPerf.
# Not part of CI. Records which ran and what each showed under $OUT (default results/clients/<time>/), one
# log per tool plus summary.txt.
#
#   CLIENTS_VENV=/tmp/venv-clients bash benchmarks/clients.sh
#
# CLIENTS_VENV: a virtual environment with `pip install lm-eval guidellm aiperf` (kept apart from the project's:
# the three pin their own torch/transformers). PYTHON: the project's interpreter (default: python on PATH).
# TOOLS: which of them to run (default "lm_eval guidellm aiperf"; e.g. TOOLS=lm_eval for lm-eval alone).
# Every step is bounded (timeout) and the server is killed by its process group at exit.
set -uo pipefail

CLIENTS_VENV=${CLIENTS_VENV:-/tmp/venv-clients}
PYTHON=${PYTHON:-python}
PORT=${PORT:-8765}
REQUESTS=${REQUESTS:-8}
TOOLS=${TOOLS:-lm_eval guidellm aiperf}
wanted() { [[ " $TOOLS " == *" $1 "* ]]; }
OUT=${OUT:-results/clients/$(date +%Y%m%d-%H%M%S)}
URL="http://127.0.0.1:${PORT}"
mkdir -p "$OUT/tasks"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

TOKENIZER=$("$PYTHON" -c "import ddtree, pathlib; print(pathlib.Path(ddtree.__file__).parent / 'assets/demo/target')")

# ------------------------------------------------------------------------------------------------ the server
setsid "$PYTHON" -m ddtree.server --device cpu --port "$PORT" --max-len 2048 --max-batch 8 --log-level warning \
  > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -9 -- -"$SERVER_PID" 2>/dev/null' EXIT
for _ in $(seq 1 600); do
  curl -sf "$URL/health" > /dev/null && break
  sleep 0.5
done
curl -sf "$URL/health" > /dev/null || { note "server: did not become healthy (see server.log)"; exit 1; }
MODEL=$(curl -s "$URL/v1/models" | "$PYTHON" -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
note "server: ddtree serve, demo pair, CPU, model id $MODEL, $URL"

accept() {  # acceptance since the last reset, from /server_info (what SGLang-style tools read)
  curl -s "$URL/server_info" | "$PYTHON" -c \
    "import json, sys; s = json.load(sys.stdin)['since_reset']; print(f\"verify rounds {s['verify_rounds']}, tokens {s['generation_tokens']}, accept length {s['accept_length']:.3f}\")"
}
vllm_counters() {  # vLLM's speculative counters from /metrics (what vLLM dashboards read; cumulative since start)
  curl -s "$URL/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' | tr '\n' ' '
}

# ------------------------------------------------------------------------------------ lm-evaluation-harness
TASKS="$OUT/tasks"
cat > "$TASKS/gen.jsonl" <<'EOF'
{"prompt": "def add(a, b):\n    return", "answer": " a + b"}
{"prompt": "def square(x):\n    return", "answer": " x * x"}
{"prompt": "for i in range(10):\n    print(", "answer": "i)"}
{"prompt": "import numpy as", "answer": " np"}
EOF
cat > "$TASKS/mc.jsonl" <<'EOF'
{"question": "import numpy as", "choices": [" np", " pd"], "label": 0}
{"question": "def f(x):\n    return", "choices": [" x", " }"], "label": 0}
EOF
cat > "$TASKS/ddtree_gen.yaml" <<EOF
task: ddtree_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: $TASKS/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
EOF
cat > "$TASKS/ddtree_mc.yaml" <<EOF
task: ddtree_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: $TASKS/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
EOF

run_tool() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  curl -s -X POST "$URL/flush_cache" > /dev/null
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: exit $rc; acceptance: $(accept); $(vllm_counters)"
  return $rc
}

if ! wanted lm_eval; then
  note "lm_eval: not asked for (TOOLS=$TOOLS)"
elif [ -x "$CLIENTS_VENV/bin/lm_eval" ]; then
  # Default local-completions settings: one prompt per request, sent as a list (the case that used to be a 400).
  run_tool lm_eval_generate 900 env HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$CLIENTS_VENV/bin/lm_eval" \
    --model local-completions --include_path "$TASKS" --tasks ddtree_gen \
    --model_args "model=$MODEL,base_url=$URL/v1/completions,num_concurrent=2,max_retries=1,tokenizer_backend=huggingface,tokenizer=$TOKENIZER" \
    --output_path "$OUT/lm_eval_generate"
  grep -E "exact_match" "$OUT/lm_eval_generate.log" | tail -2 | tee -a "$SUMMARY"
  # Multiple choice needs prompt log-probs (echo + logprobs: the target's own, from the prefill's logits).
  run_tool lm_eval_multiple_choice 600 env HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$CLIENTS_VENV/bin/lm_eval" \
    --model local-completions --include_path "$TASKS" --tasks ddtree_mc \
    --model_args "model=$MODEL,base_url=$URL/v1/completions,num_concurrent=1,max_retries=1,tokenizer_backend=huggingface,tokenizer=$TOKENIZER" \
    --output_path "$OUT/lm_eval_mc"
  grep -E '\|acc|"message": ?"[^"]*"' "$OUT/lm_eval_multiple_choice.log" | sort -u | head -4 | tee -a "$SUMMARY"
else
  note "lm_eval: not installed in $CLIENTS_VENV"
fi

# ------------------------------------------------------------------------------------------------- GuideLLM
if ! wanted guidellm; then
  note "guidellm: not asked for (TOOLS=$TOOLS)"
elif [ -x "$CLIENTS_VENV/bin/guidellm" ]; then
  # GuideLLM 0.8's `run` takes kind=... component specs (the older `benchmark --target ...` form is gone). Its
  # synthetic data needs a tokenizer: without --tokenizer it loads the served model id from the hub (offline: fails).
  run_tool guidellm 900 env HF_HUB_OFFLINE=1 "$CLIENTS_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL" --profile kind=synchronous \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
    --data "kind=synthetic_text,prompt_tokens=64,output_tokens=32" \
    --output "kind=json,path=$OUT/guidellm.json" --output kind=console --disable-console-interactive
  tail -25 "$OUT/guidellm.log" | tee -a "$SUMMARY"
  # GuideLLM prints no acceptance; it keeps each response's `metrics` object (vLLM's speculative_decoding) in
  # its JSON as the request's response_metrics: summed here from GuideLLM's own file.
  "$PYTHON" - "$OUT/guidellm.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
reqs = json.load(open(sys.argv[1]))["benchmarks"][0]["requests"]["successful"]
specs = [r["response_metrics"]["speculative_decoding"] for r in reqs
         if (r.get("response_metrics") or {}).get("speculative_decoding")]
steps = sum(s["num_spec_steps"] for s in specs)
accepted = sum(s["num_accepted_draft_tokens"] for s in specs)
drafts = sum(s["num_draft_tokens"] for s in specs)
print(f"guidellm.json: {len(specs)} of {len(reqs)} successful requests carry metrics.speculative_decoding: "
      f"{steps} steps, mean acceptance length {1 + accepted / max(steps, 1):.3f}, "
      f"draft acceptance rate {accepted / max(drafts, 1):.4f}")
EOF
else
  note "guidellm: not installed in $CLIENTS_VENV"
fi

# --------------------------------------------------------------------------------------------------- AIPerf
if ! wanted aiperf; then
  note "aiperf: not asked for (TOOLS=$TOOLS)"
elif [ -x "$CLIENTS_VENV/bin/aiperf" ]; then
  # --tokenizer: the demo tokenizer's absolute path (AutoTokenizer reads the directory; no hub call). Not with
  # HF_HUB_OFFLINE=1: aiperf 0.13's offline branch sends every name, a local path too, through
  # snapshot_download(local_files_only=True) as a hub repo id (HFValidationError). `builtin` (tiktoken o200k)
  # would download its vocabulary.
  run_tool aiperf 900 "$CLIENTS_VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" \
    --endpoint-type completions --streaming --tokenizer "${AIPERF_TOKENIZER:-$TOKENIZER}" --request-count "$REQUESTS" --concurrency 2 \
    --synthetic-input-tokens-mean 64 --output-tokens-mean 32 --artifact-dir "$OUT/aiperf" --ui-type none
  tail -40 "$OUT/aiperf.log" | tee -a "$SUMMARY"
  grep -a -A12 "LLM Metrics: Spec Decode" "$OUT/aiperf.log" | tee -a "$SUMMARY"  # its acceptance table
else
  note "aiperf: not installed in $CLIENTS_VENV"
fi
note "done: $OUT"
