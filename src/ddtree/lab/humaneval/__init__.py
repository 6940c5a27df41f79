"""``ddtree eval humaneval``: the coding gate (HumanEval problems, answer extraction, sandboxed execution)."""

from ddtree.lab.humaneval.extract import build_program, extract_code
from ddtree.lab.humaneval.run import (
    COMPLETION_STOP,
    EVAL_SCHEMA,
    GATE_TASKS,
    Answer,
    compare_with_baseline,
    load_problems,
    run_humaneval,
    run_humaneval_async,
    score_answers,
    score_responses_file,
)

__all__ = [
    "COMPLETION_STOP",
    "EVAL_SCHEMA",
    "GATE_TASKS",
    "Answer",
    "build_program",
    "compare_with_baseline",
    "extract_code",
    "load_problems",
    "run_humaneval",
    "run_humaneval_async",
    "score_answers",
    "score_responses_file",
]
