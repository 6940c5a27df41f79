"""``ddtree bench``: the context x concurrency benchmark (prompts, timings, acceptance, one JSON per cell)."""

from ddtree.lab.bench.metrics import RUN_SUMMARY_KEYS, per_token_itl, summarize_cell, summarize_run
from ddtree.lab.bench.run import CELL_SCHEMA, cell_filename, run_bench, summary_table
from ddtree.lab.bench.workload import Prompt, Workload, build_prompts, load_tokenizer

__all__ = [
    "CELL_SCHEMA",
    "RUN_SUMMARY_KEYS",
    "Prompt",
    "Workload",
    "build_prompts",
    "cell_filename",
    "load_tokenizer",
    "per_token_itl",
    "run_bench",
    "summarize_cell",
    "summarize_run",
    "summary_table",
]
