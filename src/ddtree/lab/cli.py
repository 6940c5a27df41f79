"""The lab's commands: ``ddtree bench`` and ``ddtree eval humaneval`` (plus the sweep's ``sweep``, ``report``
and ``replay``, registered by :mod:`ddtree.lab.sweep.cli`).

Each command only parses flags into the library's frozen configs (:class:`BenchTarget`, :class:`Workload`) and
calls the library function the sweep also calls, so the CLI and the sweep measure the same way.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import typer

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options
from ddtree.errors import ConfigError

eval_app = typer.Typer(help="Quality gates against a running server.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """``bench`` and ``eval`` from here; ``sweep``, ``report`` and ``replay`` from the sweep's own module."""
    from ddtree.lab.sweep.cli import register as register_sweep

    app.command("bench")(bench)
    app.add_typer(eval_app, name="eval")
    register_sweep(app)


# ------------------------------------------------------------------------------------------------ helpers


def parse_ints(text: str, *, what: str) -> tuple[int, ...]:
    """``"60,1024,4096"`` -> ``(60, 1024, 4096)``; a readable error naming the flag otherwise."""
    from ddtree.engine.options import int_list

    values = int_list(text, name=what)
    if not values:
        raise ConfigError(f"{what} needs at least one value, got {text!r}")
    return values


def parse_json_object(text: str | None, *, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{what} must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object, got {text!r}")
    return value


def _stamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _target(url: str, engine: str, model: str | None, endpoint: str, extra_body: str | None,
            tokenizer: str | None, api_key: str | None, timeout: float):
    from ddtree.lab.client import BenchTarget

    return BenchTarget(url=url, engine=engine, model=model, endpoint=endpoint,  # type: ignore[arg-type]
                       extra_body=parse_json_object(extra_body, what="--extra-body"), tokenizer=tokenizer,
                       api_key=api_key, timeout_s=timeout).validated()


# -------------------------------------------------------------------------------------------------- bench


# With --in-process the engine's flags (--target, --draft, --device, --max-batch, --cuda-graphs, ...) come from
# EngineConfig (ddtree.engine.options); --seed and --warmup stay the prompts' seed and the cells' warm-up (the
# engine's start-up warm-up is --engine-warmup), and max_batch / max_len default to fit the matrix.
@engine_options(exclude=("seed",), defaults={"max_batch": None, "max_len": None},
                names={"warmup": "--engine-warmup"})
def bench(
    url: str | None = typer.Option(None, help="OpenAI-compatible server root, e.g. http://127.0.0.1:8000 "
                                              "(or --in-process)."),
    in_process: bool = typer.Option(False, "--in-process", help="Drive an engine in this process instead of a "
                                    "server: no HTTP, times from the engine's results (the engine flags apply)."),
    engine: str = typer.Option("auto", help="ddtree | sglang | vllm | openai; auto-detected by default."),
    model: str | None = typer.Option(None, help="Model name to send (default: the first of /v1/models)."),
    endpoint: str = typer.Option("completions", help="completions (token-id prompts, exact) or chat."),
    extra_body: str | None = typer.Option(None, help='JSON merged into every request, e.g. \'{"ddtree": {"budget": 8}}\'.'),
    tokenizer: str | None = typer.Option(None, help="The served model's tokenizer (dir or hub id); default: the demo target's."),
    contexts: str = typer.Option("60,1024", help="Prompt lengths in tokens, comma-separated."),
    concurrency: str = typer.Option("1,8", help="Requests in flight, comma-separated."),
    output_tokens: int = typer.Option(128, help="Tokens generated per request (ignore_eos)."),
    num_requests: int | None = typer.Option(None, help="Requests per run (default: max(2 x concurrency, 8))."),
    repeats: int = typer.Option(1, help="Runs per cell; the spread of output tok/s is reported."),
    seed: int = typer.Option(0, help="Seed of the prompts."),
    text: str = typer.Option("words", help="Prompt filler: 'words' (English) or 'code' (held-out stdlib Python)."),
    warmup: bool = typer.Option(True, help="Before measuring a cell, run it once unmeasured (its request count, "
                                           "output length and concurrency; other prompts)."),
    config: str | None = typer.Option(None, help="JSON recorded as the cells' 'config' (what is being measured)."),
    out: Path | None = typer.Option(None, help="Directory for the cell JSON files (default: results/bench-<time>)."),
    api_key: str | None = typer.Option(None, help="Bearer token, if the server wants one."),
    timeout: float = typer.Option(600.0, help="Per-request timeout in seconds."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Benchmark a server (or, with --in-process, an engine) on a context x concurrency matrix; one JSON file per
    cell and a summary table."""
    from rich.console import Console

    from ddtree.lab.bench import Workload, run_bench, summary_table

    if (url is None) == (not in_process):
        raise ConfigError("give either --url (a running server) or --in-process (an engine in this process)")
    workload = Workload(contexts=parse_ints(contexts, what="--contexts"),
                        concurrency=parse_ints(concurrency, what="--concurrency"), output_tokens=output_tokens,
                        num_requests=num_requests, repeats=repeats, seed=seed, warmup=warmup,
                        text=text).validated()
    out_dir = out if out is not None else Path("results") / f"bench-{_stamp()}"
    recorded = parse_json_object(config, what="--config")
    if in_process:
        cells = _bench_in_process(engine_config, workload, parse_json_object(extra_body, what="--extra-body"),
                                  out_dir=out_dir, config=recorded, progress=progress)
    else:
        target = _target(url, engine, model, endpoint, extra_body, tokenizer, api_key, timeout)
        cells = asyncio.run(run_bench(target, workload, out_dir=out_dir, config=recorded, progress=progress))
    console = Console()
    console.print(summary_table(cells))
    console.print(f"cells written to {out_dir}/")


def _bench_in_process(engine_config: EngineConfig, workload: Any, extra_body: dict, *, out_dir: Path,
                      config: dict, progress: bool) -> list[dict]:
    """The matrix against ``Engine.from_config``: max_batch defaults to the highest concurrency, max_len to the
    longest prompt plus the output, max_budget to cover ``--extra-body``'s budget."""
    import dataclasses

    from ddtree.engine import Engine
    from ddtree.lab.bench.inprocess import run_engine_bench, tree_from_extra_body

    tree = tree_from_extra_body(extra_body)
    cfg = engine_config
    cfg = dataclasses.replace(
        cfg, max_batch=cfg.max_batch if cfg.max_batch is not None else max(workload.concurrency),
        max_len=cfg.max_len if cfg.max_len is not None else max(workload.contexts) + workload.output_tokens + 16,
        max_budget=max(cfg.max_budget, tree.budget if tree is not None and isinstance(tree.budget, int) else 0)).validated()
    with Engine.from_config(cfg) as engine:
        return run_engine_bench(engine, workload, out_dir=out_dir, config=config, tree=tree, progress=progress)


# ---------------------------------------------------------------------------------------------------- eval


@eval_app.command("humaneval")
def humaneval(
    url: str | None = typer.Option(None, help="Server root (not needed with --responses)."),
    engine: str = typer.Option("auto", help="ddtree | sglang | vllm | openai; auto-detected by default."),
    model: str | None = typer.Option(None, help="Model name to send (default: the first of /v1/models)."),
    endpoint: str = typer.Option("completions", help="completions (prompt as is) or chat (instruction + block)."),
    extra_body: str | None = typer.Option(None, help='JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'.'),
    tasks: str | None = typer.Option(None, help="Task ids or numbers, comma-separated (e.g. 0,12,HumanEval/23)."),
    gate: bool = typer.Option(False, help="Run the fixed 5-task gate subset (GATE_TASKS)."),
    limit: int | None = typer.Option(None, help="Only the first N of the selected tasks."),
    max_tokens: int = typer.Option(512, help="Token limit per answer (answers cut by it count as truncated)."),
    responses: Path | None = typer.Option(None, help="Score answers from a JSONL file (task_id + text) instead."),
    baseline: Path | None = typer.Option(None, help="A previous result JSON: report byte-identical outputs and "
                                         "classify each differing one (numeric near-tie or real divergence)."),
    logprobs: int | None = typer.Option(None, help="Record each emitted token with its top N log-probs (a baseline "
                                        "needs them to classify differences; the sweep's gate asks for 5)."),
    near_tie_margin: float = typer.Option(0.5, help="Nats within which the baseline's log-probs of the two tokens "
                                          "at the first differing one count as a near-tie (0.5 for bf16, 1e-3 fp32)."),
    out: Path | None = typer.Option(None, help="Result JSON path (default: results/humaneval-<time>.json)."),
    concurrency: int = typer.Option(4, help="Requests in flight."),
    api_key: str | None = typer.Option(None, help="Bearer token, if the server wants one."),
    timeout: float = typer.Option(600.0, help="Per-request timeout in seconds."),
) -> None:
    """HumanEval pass@1 (greedy) with sandboxed execution; optionally the lossless check against a baseline."""
    from ddtree.lab.humaneval import GATE_TASKS, run_humaneval, score_responses_file

    if gate and tasks:
        raise ConfigError("give either --gate or --tasks, not both")
    selected = list(GATE_TASKS) if gate else ([t.strip() for t in tasks.split(",") if t.strip()] if tasks else None)
    out_path = out if out is not None else Path("results") / f"humaneval-{_stamp()}.json"
    if responses is not None:
        result = score_responses_file(responses, tasks=selected, limit=limit, endpoint=endpoint, out=out_path,
                                      baseline=baseline, near_tie_margin=near_tie_margin)
    else:
        if url is None:
            raise ConfigError("--url is required (or --responses FILE.jsonl to score saved answers)")
        target = _target(url, engine, model, endpoint, extra_body, None, api_key, timeout)
        result = run_humaneval(target, tasks=selected, limit=limit, max_tokens=max_tokens, out=out_path,
                               baseline=baseline, concurrency=concurrency, logprobs=logprobs,
                               near_tie_margin=near_tie_margin)
    _print_eval(result, out_path)


def _print_eval(result: dict, out_path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    failed = [t for t in result["tasks"] if not t["passed"]]
    if failed:
        table = Table(title="failed tasks")
        for column in ("task", "finish", "reason"):
            table.add_column(column)
        for task in failed:
            table.add_row(task["task_id"], str(task["finish_reason"]), task["reason"][:120])
        console.print(table)
    console.print(
        f"pass@1 {result['pass_at_1']:.3f}  ({result['passed']}/{result['total']} passed, "
        f"{result['truncated']} truncated, {result['wrong']} wrong, {result['errors']} request errors)"
    )
    lossless = result.get("lossless")
    if lossless is not None:
        from rich.markup import escape

        from ddtree.lab.humaneval import warning_lines

        console.print(f"lossless: {lossless['identical']}/{lossless['compared']} byte-identical to "
                      f"{lossless['baseline']}, {lossless.get('near_tie', 0)} numeric near-tie(s), "
                      f"{lossless.get('real', 0)} real divergence(s): {lossless.get('verdict')}", highlight=False)
        for line in warning_lines(lossless):  # real ones were also logged as warnings when they were found
            console.print(escape(line), highlight=False)
    console.print(f"result written to {out_path}")
