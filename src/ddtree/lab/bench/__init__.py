"""``ddtree bench``: the context x concurrency benchmark (prompts, timings, acceptance, one JSON per cell).

Two targets: a server over HTTP (:func:`run_bench`) or an engine in this process (:func:`run_engine_bench`, whose
runs are :func:`run_cell`: the engine's own closed loop, every time taken from its results). ``matrix`` is the
method matrix ``benchmarks/gpu.py`` presets; ``kernel_timing`` what the kernel scripts share.
"""

from ddtree.lab.bench.inprocess import run_cell, run_closed_loop, run_engine_bench
from ddtree.lab.bench.metrics import RUN_SUMMARY_KEYS, per_token_itl, summarize_cell, summarize_run
from ddtree.lab.bench.run import CELL_SCHEMA, cell_filename, run_bench, summary_table
from ddtree.lab.bench.workload import (
    Prompt,
    Workload,
    build_prompts,
    held_out_token_stream,
    load_tokenizer,
    prompts_for,
)

__all__ = [
    "CELL_SCHEMA",
    "RUN_SUMMARY_KEYS",
    "Prompt",
    "Workload",
    "build_prompts",
    "cell_filename",
    "held_out_token_stream",
    "load_tokenizer",
    "per_token_itl",
    "prompts_for",
    "run_bench",
    "run_cell",
    "run_closed_loop",
    "run_engine_bench",
    "summarize_cell",
    "summarize_run",
    "summary_table",
]
