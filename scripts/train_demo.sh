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
# WORK holds every intermediate output and JSON log.
# `scripts/train_demo.sh smoke WORK` runs the same steps at toy sizes on a CPU (this interpreter's stdlib).
set -euo pipefail
stage=${1:?usage: train_demo.sh corpus|stage1|stage2|smoke WORK}
work=${2:?usage: train_demo.sh corpus|stage1|stage2|smoke WORK}
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
