#!/bin/bash
# One device call (2026-12-02, after call_c.sh): exact mode's kernel time by family at C = 64 (profile/).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02e/profile.sh
# (In this run the profile script still binned the default kernel's _tree_attention_combine_kernel as "exact
# attention"; benchmarks/exact_profile.py now bins it as tree attention.)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/exact_profile.py --out "$OUT" 2>&1 | grep -v USDT | grep -v "^\[W" | cut -c1-400
