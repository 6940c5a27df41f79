#!/usr/bin/env bash
# Installs ddtree (CPU torch first, so pip never pulls a CUDA build) and runs the main job: a sweep of tree
# settings on the embedded demo pair, ending with the report under results/<run>/ (into the active virtual
# environment or .venv, see scripts/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
ddtree sweep --preset demo "$@"
