"""``ddtree standin``: write a big-bodied stand-in of a small pair (see :mod:`ddtree.models.standin`).

    ddtree standin --shape qwen3-8b --out DIR [--target DIR --draft DIR] [--device cuda] [--dtype bfloat16]

writes ``DIR/target`` (Hugging Face layout, the small target's tokenizer files copied in), ``DIR/drafter`` (z-lab
layout) and ``DIR/standin.json`` (where it came from, the layer plan, the build time and how closely the big target
reproduces the small one's logits on random tokens). Without ``--target``/``--draft`` it uses the demo pair.
Benchmarks that only need the models in memory call :func:`ddtree.models.standin.load_standin` instead.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
import typer

from ddtree.devices import resolve_device, resolve_dtype
from ddtree.errors import ConfigError
from ddtree.models.loading import save_drafter, save_target
from ddtree.models.standin import (
    SHAPES,
    build_standin,
    load_small_pair,
    logit_agreement,
    plan_standin,
    standin_shape,
)

# Files of a Hugging Face model directory that make up its tokenizer (and generation defaults), not its weights.
_TOKENIZER_GLOBS: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "*.tiktoken", "generation_config.json",
)
def register(app: typer.Typer) -> None:
    app.command("standin")(standin)


def _check_outside_package(out: Path) -> None:
    """Stand-ins are many gigabytes and never shipped: refuse to write one inside the installed package."""
    import ddtree

    package = Path(ddtree.__file__).resolve().parent
    if out.resolve().is_relative_to(package):
        raise ConfigError(f"--out {out} is inside the ddtree package ({package}); stand-ins are never shipped, "
                          "write them elsewhere")


def copy_tokenizer_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files of model directory ``source`` into ``dest``; returns the names copied."""
    copied = []
    for pattern in _TOKENIZER_GLOBS:
        for file in sorted(source.glob(pattern)):
            if file.is_file() and file.name not in copied:
                shutil.copy2(file, dest / file.name)
                copied.append(file.name)
    return copied


def standin(
    shape: str = typer.Option("qwen3-8b", help=f"Body to build: {', '.join(SHAPES)}."),
    out: Path = typer.Option(..., help="Output directory: OUT/target (HF + tokenizer), OUT/drafter (z-lab)."),
    target: str | None = typer.Option(None, help="Small target directory or hub id (default: the demo target)."),
    draft: str | None = typer.Option(None, help="Small drafter directory or hub id (default: the demo drafter)."),
    device: str = typer.Option("auto", help="Where to build: auto (cuda when available), cpu, cuda or cuda:N."),
    dtype: str = typer.Option("bfloat16", help="Stand-in dtype: bfloat16, float16 or float32."),
    seed: int = typer.Option(0, help="Seed of the values that cannot reach the output."),
    max_shard_gb: float = typer.Option(5.0, help="Largest safetensors shard of the target, in GB."),
) -> None:
    """Build a target/drafter with a big body (e.g. Qwen3-8B's) that computes a small pair's functions."""
    body = standin_shape(shape)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    _check_outside_package(out)
    small = load_small_pair(target, draft, device=dev)
    small_target, small_drafter = small.target, small.drafter
    start = time.perf_counter()
    big_target, big_drafter = build_standin(small_target, small_drafter, body, seed=seed, device=dev, dtype=dt)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    build_s = time.perf_counter() - start
    probe = torch.randint(0, small_target.config.vocab_size, (2, 128),
                          generator=torch.Generator().manual_seed(seed))
    dtype_name = str(dt).removeprefix("torch.")
    agreement = {"vs_small_float32": logit_agreement(small_target, big_target, probe)}
    if dt != torch.float32:  # how much of that is the stand-in's own rounding, not the dtype's
        agreement[f"vs_small_{dtype_name}"] = logit_agreement(copy.deepcopy(small_target).to(dt), big_target, probe)
    plan = plan_standin(small_target.config, small_drafter.config, body)
    n_target = sum(p.numel() for p in big_target.parameters())
    n_drafter = sum(p.numel() for p in big_drafter.parameters())

    start = time.perf_counter()
    save_target(big_target, out / "target", max_shard_bytes=int(max_shard_gb * 1e9))
    copied = copy_tokenizer_files(small.target_dir, out / "target")
    save_drafter(big_drafter, out / "drafter")
    save_s = time.perf_counter() - start
    record = {
        "shape": dataclasses.asdict(body),
        "small_target": str(small.target_dir),
        "small_drafter": str(small.drafter_dir),
        "plan": dataclasses.asdict(plan),
        "seed": seed,
        "device": str(dev),
        "dtype": dtype_name,
        "target_params": n_target,
        "drafter_params": n_drafter,
        "build_s": build_s,
        "save_s": save_s,
        "tokenizer_files": copied,
        "agreement_on_random_tokens": agreement,
    }
    (out / "standin.json").write_text(json.dumps(record, indent=2) + "\n")
    typer.echo(
        f"stand-in {body.name}: target {n_target / 1e9:.2f}B params, drafter {n_drafter / 1e9:.2f}B, built in "
        f"{build_s:.1f}s on {dev} ({dtype_name}), saved in {save_s:.1f}s -> {out}\n"
        f"  target layers of the small model: {plan.target_layers}; drafter reads {plan.feature_ids}"
        + "".join(f"\n  {name} on random tokens: max relative logit diff {a['max_rel_logit_diff']:.2e}, "
                  f"argmax agreement {a['argmax_agreement']:.4f}" for name, a in agreement.items())
    )
