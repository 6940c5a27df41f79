"""``ddtree generate``: one prompt through the engine, printed as text or JSON."""

from __future__ import annotations

import json
from dataclasses import replace

import typer

from ddtree.engine.api import METHODS, GenerationRequest, SamplingParams
from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options, tree_settings


def _parse_window(value: str | None) -> int | None:
    if value is None or value.lower() in ("none", "all", "0"):
        return None
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"--draft-window must be an integer or 'none', got {value!r}") from None


# The engine's own flags (--target, --draft, --device, --dtype, --max-len, --cuda-graphs, ...) come from
# EngineConfig; this command sets the batch and the limits from the one request it runs.
@engine_options(exclude=("max_batch", "max_budget", "max_block_size", "seed"), defaults={"max_len": 16384})
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (with --chat: the user message)."),
    method: str = typer.Option("ddtree", help=f"One of {', '.join(METHODS)}."),
    budget: str = typer.Option("16", help="Draft nodes verified per round (ddtree), or 'auto': chosen per round."),
    topk: int | None = typer.Option(None, help="Most candidates per draft depth (default: no cap)."),
    block_size: int | None = typer.Option(None, "--block-size", help="Draft positions per pass (default: trained)."),
    draft_window: str | None = typer.Option(None, "--draft-window", help="Drafter context window, or 'none'."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int | None = typer.Option(None),
    max_tokens: int = typer.Option(256, "--max-tokens"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    chat: bool = typer.Option(False, "--chat", help="Apply the tokenizer's chat template to the prompt."),
    as_json: bool = typer.Option(False, "--json", help="Print text, token ids and stats as JSON."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Generate a completion for one prompt with AR, the DFlash chain or a DDTree tree."""
    tree = tree_settings(method, budget, topk, block_size, _parse_window(draft_window))
    max_budget = engine_config.max_budget if tree.budget == "auto" else max(tree.budget, 1)  # type: ignore[call-overload]
    config = replace(engine_config, max_batch=1, max_budget=max_budget, max_block_size=block_size, default_tree=tree)
    from ddtree.engine.engine import Engine

    engine = Engine.from_config(config)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                              max_tokens=max_tokens, stop=tuple(stop), ignore_eos=ignore_eos)
    if chat:
        request = GenerationRequest(prompt_token_ids=engine.encode_chat([{"role": "user", "content": prompt}]),
                                    tree=tree, sampling=sampling)
    else:
        request = GenerationRequest(prompt=prompt, tree=tree, sampling=sampling)
    engine.validate(request)
    engine.start()
    try:
        (out,) = engine.generate([request])
    finally:
        engine.shutdown(drain_timeout=0)
    if as_json:
        typer.echo(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "prompt_tokens": len(out.prompt_token_ids),
            "finish_reason": out.finish_reason, "error": out.error, "stats": out.stats.to_dict(),
        }, indent=2))
    else:
        typer.echo(out.text)
        s = out.stats
        typer.secho(
            f"[{out.finish_reason}] {s.completion_tokens} tokens, {s.verify_rounds} rounds, "
            f"acceptance {s.accept_length:.2f}, {s.completion_tokens / max(s.latency_s or 1e-9, 1e-9):.1f} tok/s",
            err=True, fg=typer.colors.BLUE,
        )
    if out.finish_reason == "error":
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
