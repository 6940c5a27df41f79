"""``ddtree replay record`` (one greedy trace) and ``ddtree replay predict`` (acceptance for every setting)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options
from ddtree.errors import ConfigError

replay_app = typer.Typer(
    help="Predict greedy acceptance for every budget and top-k from one recorded trace.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(replay_app, name="replay")


def read_prompts(path: Path) -> list[str]:
    """Prompts from a JSON-lines file (``prompt`` or ``text`` per line)."""
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc}); write one {{\"prompt\": ...}} per line") from None
        text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{path}:{number}: needs a non-empty \"prompt\" (or \"text\") string")
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def _list(text: str, *, what: str, optional: bool) -> tuple[int | None, ...]:
    from ddtree.lab.sweep.grid import parse_list

    return parse_list(text, what=what, optional=optional)


@replay_app.command("record")
# The engine's flags (--target, --draft, --device, --dtype, --max-len, ...) come from EngineConfig; the batch and the
# budget and block limits follow from the prompts, --top-m and --block-size.
@engine_options(exclude=("max_batch", "max_budget", "max_block_size"))
def record(
    out: Path = typer.Option(Path("trace.safetensors"), help="Trace file to write."),
    prompts: Path | None = typer.Option(None, help="JSON-lines prompts ({\"prompt\": ...}); default: the 5 HumanEval gate prompts."),
    max_tokens: int = typer.Option(128, help="Completion tokens per prompt (EOS ignored, like the bench)."),
    block_size: int | None = typer.Option(None, help="Draft block size (default: the drafter's trained size)."),
    draft_window: int | None = typer.Option(None, help="Drafter context window (default: all)."),
    top_m: int = typer.Option(64, help="Tokens kept per depth: the largest budget the trace can predict."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Run the target greedily and record the drafter's marginals at every position."""
    from dataclasses import replace

    from ddtree.engine import Engine
    from ddtree.lab.replay.trace import record_trace

    if prompts is not None:
        texts = read_prompts(prompts)
    else:
        from ddtree.lab.humaneval import GATE_TASKS, load_problems

        problems = load_problems()
        texts = [problems[t]["prompt"] for t in GATE_TASKS]
    config = replace(engine_config, max_batch=min(8, len(texts)), max_budget=max(64, top_m),
                     max_block_size=block_size).validated()
    engine = Engine.from_config(config)
    engine.start()
    try:
        trace = record_trace(engine, texts, max_tokens, block_size, draft_window, top_m=top_m, out=out)
    finally:
        engine.shutdown(drain_timeout=0)
    meta = trace.metadata()
    typer.echo(f"{out}: {meta['sequences']} sequences, {meta['anchors']} anchors, block {meta['block_size']}, "
               f"window {meta['draft_window'] or 'none'}, top-{meta['top_m']}")


@replay_app.command("predict")
def predict_cmd(
    trace: Path = typer.Argument(..., help="A trace written by `ddtree replay record`."),
    budget: str = typer.Option("2,4,8,16,32,64", help="Budgets to predict."),
    topk: str = typer.Option("none", help="Top-k caps to predict (none = no cap)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the predictions as JSON here."),
) -> None:
    """Print predicted acceptance length per setting (AR and the DFlash chain included)."""
    from rich.console import Console
    from rich.table import Table

    from ddtree.lab.replay.predict import predict
    from ddtree.lab.replay.trace import Trace
    from ddtree.lab.sweep.layout import atomic_write_json

    loaded = Trace.load(trace)
    budgets = [b for b in _list(budget, what="budget", optional=False) if b is not None]
    predictions = predict(loaded, budgets, _list(topk, what="topk", optional=True))
    chain = next(p.accept_length for p in predictions if p.setting.method == "dflash")
    table = Table(title=f"predicted acceptance ({loaded.model}, block {loaded.block_size}, "
                        f"window {loaded.draft_window or 'none'}, {loaded.num_sequences} sequences x "
                        f"{loaded.max_tokens} tokens)")
    for column in ("setting", "accept length", "rounds", "vs DFlash"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for p in predictions:
        table.add_row(p.setting.label, f"{p.accept_length:.3f}", str(p.rounds),
                      f"{p.accept_length / chain:.2f}x" if chain else "-")
    Console().print(table)
    if json_out is not None:
        atomic_write_json(json_out, {"trace": loaded.metadata(), "predictions": [p.to_dict() for p in predictions]})


__all__ = ["read_prompts", "register"]
