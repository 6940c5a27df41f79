#!/usr/bin/env bash
# Installs ddtree with its test extras (CPU torch first, so pip never pulls a CUDA build) and runs the suite.
# It installs into the active virtual environment or .venv (scripts/venv.sh); .ci/run makes a fresh one each run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
# The versions the suite runs against, first (a run's record of what it tested; triton=None: not installed).
python3 -c 'from ddtree.lab.sweep.manifest import versions; print("versions:", " ".join(f"{k}={v}" for k, v in versions().items()))'
# -n auto: one pytest worker per core, at most 4 (pytest-xdist; every test is independent of the others' order).
python3 -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 "$@"
