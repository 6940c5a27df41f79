#!/usr/bin/env bash
# The exact pipeline that trained the shipped demo pair (src/ddtree/assets/demo/{target,drafter}).
#
# Corpus: the full CPython 3.11.7 standard library (Lib/, test suite included, 1790 .py files), packed once on a
# machine that has it (`scripts/train_demo.sh corpus WORK` with that python3 first on PATH) and
# carried to the GPU machine. Why not the GPU machine's own stdlib: its Debian Python 3.12 ships without the
# test suite (569 files, 2.5 M tokens); a first run on it overfit (held-out perplexity 176).
#
# Run on one NVIDIA H200 (Python 3.12, torch 2.11, transformers 5.17), in two calls of at most 10 minutes:
#   scripts/train_demo.sh stage1 WORK   # tokenizer + target
#   scripts/train_demo.sh stage2 WORK   # continuation data + drafter
#   scripts/train_demo.sh mix WORK      # the shipped drafter fine-tuned on contexts of 8 to 6k tokens
# WORK holds every intermediate output and JSON log.
# `scripts/train_demo.sh smoke WORK` runs the same steps at toy sizes on a CPU (this interpreter's stdlib).
set -euo pipefail
stage=${1:?usage: train_demo.sh corpus|stage1|stage2|mix|smoke WORK}
work=${2:?usage: train_demo.sh corpus|stage1|stage2|mix|smoke WORK}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
train="python3 -m ddtree.train.cli"
mkdir -p "$work"

corpus_tar=build/train_corpus/cpython-3.11.7-lib.tar.gz
unpack_corpus() {
  if [ ! -d "$work/corpus/python3.11" ]; then mkdir -p "$work/corpus" && tar -C "$work/corpus" -xzf "$corpus_tar"; fi
}
root="$work/corpus/python3.11"

case "$stage" in
corpus)
  lib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  mkdir -p "$(dirname "$corpus_tar")"
  dest="$PWD/$corpus_tar"
  (cd "$(dirname "$lib")" && find "$(basename "$lib")" -name '*.py' -not -path '*/site-packages/*' \
     -not -path '*/__pycache__/*' | sort | tar -czf "$dest" -T -)
  ;;
stage1)
  unpack_corpus
  $train tokenizer --corpus-root "$root" --out "$work/tokenizer" --vocab-size 8192
  $train target --corpus-root "$root" --tokenizer "$work/tokenizer" --out "$work/target" --preset demo \
    --max-epochs 12 --time-budget-s 270 --seed 0 --perplexity-lengths 1024,4096,8192
  ;;
stage2)
  # Continuations shaped like the evaluation (1024-token prefix, 256 greedy tokens): many short rows rather than
  # few long ones, because the target falls into repetition loops as it goes on (85 % of tokens after 256), and
  # rows full of loops teach the drafter only to copy. The 6k rows keep long-context positions in training.
  unpack_corpus
  $train data --corpus-root "$root" --target "$work/target" --out "$work/data_1k.safetensors" \
    --num-prompts 24576 --prompt-len 1024 --new-tokens 256 --batch-size 2048 --seed 1
  $train data --corpus-root "$root" --target "$work/target" --out "$work/data_6k.safetensors" \
    --num-prompts 512 --prompt-len 6144 --new-tokens 512 --batch-size 512 --seed 2
  for ctx in 1024 4096 8192; do
    n=$((65536 / ctx)); [ "$n" -gt 64 ] && n=64
    $train data --corpus-root "$root" --target "$work/target" --out "$work/eval_${ctx}.safetensors" \
      --split held-out --num-prompts "$n" --prompt-len "$ctx" --new-tokens 256 --batch-size 64
  done
  # The drafter gets what is left of a 10-minute call (STAGE_SECONDS), less a minute for evaluation and saving.
  budget=$(( ${STAGE_SECONDS:-570} - SECONDS - 60 ))
  [ "$budget" -gt 420 ] && budget=420
  echo "data done after ${SECONDS}s; drafter time budget ${budget}s"
  $train drafter --target "$work/target" --data "$work/data_1k.safetensors" --data "$work/data_6k.safetensors" \
    --eval-data "$work/eval_1024.safetensors" --eval-data "$work/eval_4096.safetensors" \
    --eval-data "$work/eval_8192.safetensors" --out "$work/drafter" --preset demo --time-budget-s "$budget" \
    --rows-per-step 64 --anchors-per-row 128 --seed 0
  ;;
mix)
  # stage2's drafter saw only contexts of 1k and more, so at a 64-token prompt it guessed worse than it could.
  # This stage starts from the shipped drafter (target unchanged) and trains on rows whose prompts are 8, 64,
  # 256 and 1024 tokens (256 greedy tokens each: blocks anchored at contexts of 7 to 1279 tokens) plus 6k rows,
  # so the long-context numbers are kept while short contexts are learned. Held-out sets at 64 and 512 tokens of
  # context join those at 1k, 4k and 8k; the first (64) picks the best step.
  unpack_corpus
  target=src/ddtree/assets/demo/target
  seed=11
  for plen in 8 64 256 1024; do
    $train data --corpus-root "$root" --target "$target" --out "$work/mix_${plen}.safetensors" \
      --num-prompts 8192 --prompt-len "$plen" --new-tokens 256 --batch-size 2048 --seed "$seed"
    seed=$((seed + 1))
  done
  $train data --corpus-root "$root" --target "$target" --out "$work/mix_6k.safetensors" \
    --num-prompts 256 --prompt-len 6144 --new-tokens 512 --batch-size 256 --seed "$seed"
  evals=()
  for ctx in 64 512 1024 4096 8192; do
    n=$((65536 / ctx)); [ "$n" -gt 64 ] && n=64
    $train data --corpus-root "$root" --target "$target" --out "$work/eval_${ctx}.safetensors" \
      --split held-out --num-prompts "$n" --prompt-len "$ctx" --new-tokens 256 --batch-size 64
    evals+=(--eval-data "$work/eval_${ctx}.safetensors")
  done
  budget=$(( ${STAGE_SECONDS:-570} - SECONDS - 60 ))
  [ "$budget" -gt 420 ] && budget=420
  echo "data done after ${SECONDS}s; drafter time budget ${budget}s"
  $train drafter --target "$target" --init-from src/ddtree/assets/demo/drafter \
    --data "$work/mix_8.safetensors" --data "$work/mix_64.safetensors" --data "$work/mix_256.safetensors" \
    --data "$work/mix_1024.safetensors" --data "$work/mix_6k.safetensors" "${evals[@]}" \
    --out "$work/drafter" --preset demo --time-budget-s "$budget" --rows-per-step 64 --anchors-per-row 128 \
    --lr 3e-4 --seed 0
  ;;
smoke)
  $train tokenizer --out "$work/tokenizer" --vocab-size 320 --max-files 80 --held-out-fraction 0.1
  $train target --tokenizer "$work/tokenizer" --out "$work/target" --preset smoke \
    --max-files 80 --held-out-fraction 0.1 --device cpu --perplexity-lengths 64
  $train data --target "$work/target" --out "$work/data.safetensors" --num-prompts 32 --prompt-len 64 \
    --new-tokens 64 --batch-size 16 --max-files 80 --held-out-fraction 0.1 --device cpu
  $train data --target "$work/target" --out "$work/eval.safetensors" --split held-out --num-prompts 4 \
    --prompt-len 64 --new-tokens 32 --batch-size 4 --max-files 80 --held-out-fraction 0.1 --device cpu
  $train drafter --target "$work/target" --data "$work/data.safetensors" --eval-data "$work/eval.safetensors" \
    --out "$work/drafter" --preset smoke --device cpu
  ;;
*)
  echo "unknown stage $stage (stage1, stage2 or smoke)" >&2
  exit 2
  ;;
esac
