"""``ddtree train ...``: the demo pair's pipeline, one command per step, each writing a JSON log.

    ddtree train tokenizer --out DIR                    byte-level BPE on the stdlib's train split
    ddtree train target --tokenizer DIR --out DIR       Qwen3 target (Hugging Face format, tokenizer included)
    ddtree train data --target DIR --out FILE           target-generated continuations of corpus prefixes
    ddtree train drafter --target DIR --data FILE --out DIR   DFlash drafter (z-lab format)

Every step has a ``--preset`` (``demo`` for the shipped pair, ``smoke`` for seconds on a CPU) whose fields the
other flags override. ``scripts/train_demo.sh`` is the exact sequence run for the shipped pair. The module also
runs on its own (``python -m ddtree.train.cli``) so the device machine needs none of the other parts' packages.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options, int_list

train_app = typer.Typer(
    name="train",
    help="Train the embedded demo pair: tokenizer, target, continuation data, DFlash drafter.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_HELD_OUT_HELP = "Fraction of corpus files (by a stable hash of the path) never trained on."


def _corpus(max_files: int | None, held_out_fraction: float, root: Path | None):
    from ddtree.train.corpus import load_corpus

    return load_corpus(root, held_out_fraction=held_out_fraction, max_files=max_files)


@train_app.command("tokenizer")
def tokenizer_command(
    out: Path = typer.Option(..., help="Directory for tokenizer.json + tokenizer_config.json."),
    vocab_size: int = typer.Option(8192, help="Vocabulary size, special tokens and 256 byte symbols included."),
    max_files: int | None = typer.Option(None, help="Use only the first N corpus files (smoke runs)."),
    held_out_fraction: float = typer.Option(0.04, help=_HELD_OUT_HELP),
    corpus_root: Path | None = typer.Option(None, help="Corpus folder (default: this interpreter's stdlib)."),
    log: Path | None = typer.Option(None, help="JSON log path (default: OUT/tokenizer_log.json)."),
) -> None:
    """Train the byte-level BPE tokenizer on the corpus' train split."""
    from ddtree.train.runtime import RunLog
    from ddtree.train.tokenizer import TokenizerTrainConfig, save_tokenizer, train_tokenizer

    config = TokenizerTrainConfig(vocab_size=vocab_size)
    corpus = _corpus(max_files, held_out_fraction, corpus_root)
    run = RunLog(log or out / "tokenizer_log.json", "tokenizer",
                 {"vocab_size": vocab_size, "corpus": corpus.describe()})
    tokenizer = train_tokenizer((f.text for f in corpus.train), config)
    save_tokenizer(tokenizer, out)
    run.results.update(vocab_size=tokenizer.get_vocab_size(), saved_to=str(out))
    run.write()
    typer.echo(f"tokenizer: {tokenizer.get_vocab_size()} tokens -> {out} ({run.elapsed():.1f}s)")


@train_app.command("target")
def target_command(
    tokenizer: Path = typer.Option(..., help="Directory written by `ddtree train tokenizer`."),
    out: Path = typer.Option(..., help="Output directory (Hugging Face format, tokenizer copied in)."),
    preset: str = typer.Option("demo", help="demo (the shipped target) or smoke (seconds on a CPU)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    steps: int | None = typer.Option(None, help="Maximum optimizer steps."),
    max_epochs: float | None = typer.Option(None, help="Cap on passes over the train tokens."),
    time_budget_s: float | None = typer.Option(None, help="Fit the step count to this many seconds of training."),
    seq_len: int | None = typer.Option(None, help="Tokens per training sequence."),
    batch_size: int | None = typer.Option(None, help="Sequences per step."),
    lr: float | None = typer.Option(None, help="Peak learning rate."),
    seed: int | None = typer.Option(None, help="Random seed."),
    perplexity_lengths: str = typer.Option("", help="Comma-separated extra held-out lengths for perplexity."),
    max_files: int | None = typer.Option(None, help="Use only the first N corpus files (smoke runs)."),
    held_out_fraction: float = typer.Option(0.04, help=_HELD_OUT_HELP),
    corpus_root: Path | None = typer.Option(None, help="Corpus folder (default: this interpreter's stdlib)."),
    log: Path | None = typer.Option(None, help="JSON log path (default: OUT/train_log.json)."),
) -> None:
    """Train the Qwen3 target on the corpus and save it in Hugging Face format."""
    from ddtree.train.target import preset as target_preset
    from ddtree.train.target import train_target

    config = target_preset(preset, max_steps=steps, max_epochs=max_epochs, time_budget_s=time_budget_s,
                           seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed)
    lengths = int_list(perplexity_lengths, name="--perplexity-lengths")
    corpus = _corpus(max_files, held_out_fraction, corpus_root)
    result = train_target(corpus, tokenizer, out, config, device=device, log_path=log or out / "train_log.json",
                          perplexity_lengths=lengths)
    typer.echo(json.dumps(result["results"], indent=2))


@train_app.command("data")
def data_command(
    target: Path = typer.Option(..., help="Target directory written by `ddtree train target`."),
    out: Path = typer.Option(..., help="Output .safetensors file of continuations."),
    num_prompts: int = typer.Option(2048, help="Number of corpus prefixes to continue."),
    prompt_len: int = typer.Option(1024, help="Tokens per prefix."),
    new_tokens: int = typer.Option(1024, help="Target tokens generated per prefix."),
    batch_size: int = typer.Option(1024, help="Prefixes decoded together."),
    temperature: float = typer.Option(0.0, help="0 = greedy (the target's argmax chain)."),
    seed: int = typer.Option(1, help="Seed for prefix sampling (and token sampling when temperature > 0)."),
    split: str = typer.Option("train", help="train (drafter training data) or held-out (evaluation prompts)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    max_files: int | None = typer.Option(None, help="Use only the first N corpus files (smoke runs)."),
    held_out_fraction: float = typer.Option(0.04, help=_HELD_OUT_HELP),
    corpus_root: Path | None = typer.Option(None, help="Corpus folder (default: this interpreter's stdlib)."),
    log: Path | None = typer.Option(None, help="JSON log path (default: OUT with .json suffix)."),
) -> None:
    """Generate target continuations of corpus prefixes (drafter training data or evaluation set)."""
    from ddtree.train.data import ContinuationSettings, make_continuations

    settings = ContinuationSettings(num_prompts=num_prompts, prompt_len=prompt_len, new_tokens=new_tokens,
                                    batch_size=batch_size, temperature=temperature, seed=seed,
                                    split=split)
    corpus = _corpus(max_files, held_out_fraction, corpus_root)
    result = make_continuations(corpus, target, out, settings, device=device,
                                log_path=log or out.with_suffix(".json"))
    typer.echo(json.dumps(result["results"], indent=2))


@train_app.command("drafter")
def drafter_command(
    target: Path = typer.Option(..., help="Target directory written by `ddtree train target`."),
    data: list[Path] = typer.Option(..., help="Continuation file(s) from `ddtree train data` (repeatable)."),
    out: Path = typer.Option(..., help="Output directory (z-lab DFlash format)."),
    eval_data: list[Path] = typer.Option([], help="Held-out greedy continuations (`train data --split held-out`)."),
    preset: str = typer.Option("demo", help="demo (the shipped drafter) or smoke (seconds on a CPU)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    num_layers: int | None = typer.Option(None, help="Drafter layers."),
    steps: int | None = typer.Option(None, help="Maximum optimizer steps."),
    time_budget_s: float | None = typer.Option(None, help="Fit the step count to this many seconds of training."),
    rows_per_step: int | None = typer.Option(None, help="Continuation rows per step."),
    anchors_per_row: int | None = typer.Option(None, help="Blocks drawn per row."),
    lr: float | None = typer.Option(None, help="Peak learning rate."),
    init: str | None = typer.Option(None, help="random, or target (start from the target's last layers)."),
    init_from: Path | None = typer.Option(None, help="A trained drafter directory to start from (fine-tuning)."),
    seed: int | None = typer.Option(None, help="Random seed."),
    log: Path | None = typer.Option(None, help="JSON log path (default: OUT/train_log.json)."),
) -> None:
    """Train the DFlash drafter on target continuations and save it in z-lab format."""
    from ddtree.train.drafter import preset as drafter_preset
    from ddtree.train.drafter import train_drafter

    config = drafter_preset(preset, num_layers=num_layers, max_steps=steps, time_budget_s=time_budget_s,
                            rows_per_step=rows_per_step, anchors_per_row=anchors_per_row, lr=lr, seed=seed,
                            init=init, init_from=str(init_from) if init_from else None)
    result = train_drafter(target, data, out, config, eval_paths=eval_data, device=device,
                           log_path=log or out / "train_log.json")
    typer.echo(json.dumps(result["results"], indent=2))


@train_app.command("quality")
# The engine's flags (--target, --draft, --device, --dtype, --max-batch, --cuda-graphs, ...) come from EngineConfig;
# max_len and max_budget follow from the prompts and the budgets measured.
@engine_options(exclude=("max_len", "max_budget"))
def quality_command(
    out: Path = typer.Option(..., help="JSON report path (a markdown table is printed)."),
    prompts: int = typer.Option(16, help="Held-out prompts."),
    prompt_len: int = typer.Option(1024, help="Tokens per prompt."),
    new_tokens: int = typer.Option(256, help="Greedy tokens generated per prompt (EOS ignored)."),
    budgets: str = typer.Option("8,16,32,64,128,256", help="Comma-separated DDTree budgets."),
    held_out_fraction: float = typer.Option(0.04, help=_HELD_OUT_HELP),
    corpus_root: Path | None = typer.Option(None, help="Corpus folder (default: this interpreter's stdlib)."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Measure AR / DFlash chain / DDTree acceptance with the engine on held-out prompts."""
    from dataclasses import replace

    from ddtree.assets import demo_target_path
    from ddtree.engine import Engine
    from ddtree.train.quality import held_out_prompts, markdown_table, measure_acceptance, write_report
    from ddtree.train.runtime import environment

    budget_list = int_list(budgets, name="--budgets")
    config = replace(engine_config, max_len=prompt_len + new_tokens + 16,
                     max_budget=max(budget_list + (16,))).validated()
    corpus = _corpus(None, held_out_fraction, corpus_root)
    rows = held_out_prompts(corpus, config.target or demo_target_path(), prompt_len, prompts)
    engine = Engine.from_config(config)
    engine.start()
    try:
        results = measure_acceptance(engine, rows, new_tokens=new_tokens, budgets=budget_list)
    finally:
        engine.shutdown()
    report = {"environment": environment(), "engine": engine.info(), "corpus": corpus.describe(),
              "prompts": int(rows.shape[0]), "prompt_len": prompt_len, "new_tokens": new_tokens, "results": results}
    write_report(out, report)
    typer.echo(markdown_table(results))


def register(app: typer.Typer) -> None:
    """Add the ``train`` sub-app to the main ``ddtree`` command."""
    app.add_typer(train_app, name="train")


if __name__ == "__main__":
    train_app()
