"""From a model's answer to a runnable HumanEval program.

Vocabulary
----------
answer
    What the model wrote after its reasoning. Reasoning is either a separate field (SGLang ``reasoning_content``,
    vLLM ``reasoning``) or inline, closed by ``</think>``: everything up to the *last* ``</think>`` is dropped.
    An opened ``<think>`` that never closes means the model was cut off while thinking: the answer is empty.
code
    The last fenced Python block of the answer (```` ```python ````, ```` ```py ````, or an untagged fence when no
    tagged one exists). A final fence that never closes (a truncated answer) still yields its code. Without any
    fence the code is the raw answer; for completion models that raw text continues the prompt, so it is cut at
    the usual HumanEval stop sequences (a new top-level ``def``/``class``/``if``/``print``/comment).
program
    ``prompt + code`` when the code continues the function body, else ``prompt + "\\n" + code`` when it (re)defines
    the entry point (the prompt's stub, which has only its docstring, is then overridden while the prompt's imports
    and helper functions stay), followed by the task's tests and ``check(entry_point)``.

Worked example: a thinking model answers ``"<think>maybe ```python\\nreturn 0\\n```</think>Here:\\n```python\\n
def add(a, b):\\n    return a + b\\n```"``; the decoy block inside the reasoning is ignored and the code is the
definition of ``add``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Literal

THINK_CLOSE = "</think>"
THINK_OPEN = "<think>"
# The Codex paper's stop sequences for completion models (a new top-level statement ends the function body).
STOP_SEQUENCES: tuple[str, ...] = ("\nclass ", "\ndef ", "\n#", "\nif ", "\nprint(")

_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[^\n]*$", re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}

Source = Literal["fenced", "raw", "none"]


@dataclass(frozen=True)
class Extracted:
    answer: str  # the text after reasoning
    code: str
    source: Source  # "fenced" (from a code block), "raw" (no block: the answer itself), "none" (nothing usable)
    in_reasoning: bool  # the output ended inside an unclosed <think>


def strip_reasoning(text: str) -> tuple[str, bool]:
    """The answer part of ``text``, and whether the output ended inside unclosed reasoning.

    Reasoning returned in a separate field needs no stripping: ``text`` is then already the answer (a stray
    ``</think>`` in it is still honoured)."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1], False
    if THINK_OPEN in text:
        before = text.split(THINK_OPEN, 1)[0]
        return before, True
    return text, False


def fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """Every fenced block as ``(tag, body, closed)`` in order of appearance."""
    blocks: list[tuple[str, str, bool]] = []
    fences = list(_FENCE.finditer(text))
    i = 0
    while i < len(fences):
        opening = fences[i]
        tag = opening.group(1).lower()
        body_start = opening.end() + 1
        if i + 1 < len(fences):
            closing = fences[i + 1]
            blocks.append((tag, text[body_start:closing.start()], True))
            i += 2
        else:
            blocks.append((tag, text[body_start:], False))
            i += 1
    return blocks


def extract_code(text: str, *, completion_mode: bool = False) -> Extracted:
    """The code to run, from a model's output text (see the module docstring for the rules)."""
    answer, in_reasoning = strip_reasoning(text)
    blocks = fenced_blocks(answer)
    tagged = [b for b in blocks if b[0] in _PYTHON_TAGS]
    untagged = [b for b in blocks if b[0] == ""]
    chosen = tagged[-1] if tagged else (untagged[-1] if untagged else None)
    if chosen is not None:
        return Extracted(answer, textwrap.dedent(chosen[1]).rstrip() + "\n", "fenced", in_reasoning)
    if not answer.strip():
        return Extracted(answer, "", "none", in_reasoning)
    code = truncate_at_stop(answer) if completion_mode else answer
    return Extracted(answer, code, "raw", in_reasoning)


def truncate_at_stop(completion: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """``completion`` up to the first stop sequence (the function body a completion model wrote)."""
    cut = len(completion)
    for stop in stops:
        at = completion.find(stop)
        if at != -1:
            cut = min(cut, at)
    return completion[:cut]


def defines(code: str, entry_point: str) -> bool:
    """Whether ``code`` defines the function ``entry_point`` at its top level."""
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def build_program(prompt: str, code: str, test: str, entry_point: str) -> str:
    """The test program for one task: solution, the task's ``check`` and its call."""
    if defines(code, entry_point):
        solution = prompt + "\n" + code
    else:
        first = next((line for line in code.splitlines() if line.strip()), "")
        body = code if first.startswith((" ", "\t")) or not first else _indent(code)
        solution = prompt + body
    return f"{solution}\n\n{test}\n\ncheck({entry_point})\n"


def _indent(code: str) -> str:
    return "".join(("    " + line if line.strip() else line) for line in code.splitlines(keepends=True))
