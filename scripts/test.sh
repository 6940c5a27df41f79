#!/usr/bin/env bash
# Installs ddtree with its test extras (CPU torch first, so pip never pulls a CUDA build) and runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
python3 -m pytest -q -p no:cacheprovider "$@"
