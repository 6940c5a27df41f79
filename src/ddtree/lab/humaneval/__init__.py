"""``ddtree eval humaneval``: the coding gate (HumanEval problems, answer extraction, sandboxed execution) and the
lossless gate (outputs against a baseline run, differences classified as numeric near-ties or real divergences)."""

from ddtree.lab.humaneval.divergence import (
    DEFAULT_NEAR_TIE_MARGIN,
    FP32_NEAR_TIE_MARGIN,
    TOP_LOGPROBS,
    Divergence,
    TokenTrace,
    TopEntry,
    classify,
    first_difference,
)
from ddtree.lab.humaneval.extract import build_program, extract_code
from ddtree.lab.humaneval.lossless import READABLE_SCHEMAS, warning_lines
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
    "DEFAULT_NEAR_TIE_MARGIN",
    "EVAL_SCHEMA",
    "FP32_NEAR_TIE_MARGIN",
    "GATE_TASKS",
    "READABLE_SCHEMAS",
    "TOP_LOGPROBS",
    "Answer",
    "Divergence",
    "TokenTrace",
    "TopEntry",
    "build_program",
    "classify",
    "compare_with_baseline",
    "extract_code",
    "first_difference",
    "load_problems",
    "run_humaneval",
    "run_humaneval_async",
    "score_answers",
    "score_responses_file",
    "warning_lines",
]
