"""``ddtree train quality``: the demo pair's acceptance table, measured by the engine on held-out prompts.

Prompts are evenly spaced windows of the held-out token stream (files never trained on), of exactly
``prompt_len`` tokens; every request decodes ``new_tokens`` tokens greedily with ``ignore_eos`` so all methods
produce the same number of tokens. Acceptance length is the engine's: completion tokens / verify rounds (bonus
included). The AR row doubles as the losslessness check: every speculative method must reproduce its tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
from ddtree.train.corpus import Corpus
from ddtree.train.data import encode_documents, fixed_windows
from ddtree.train.tokenizer import load_raw_tokenizer

DEFAULT_BUDGETS: tuple[int, ...] = (8, 16, 32, 64, 128, 256)


def held_out_prompts(corpus: Corpus, tokenizer_dir: str | Path, prompt_len: int, count: int) -> torch.Tensor:
    """``count`` held-out prompts of exactly ``prompt_len`` tokens.  # -> [count, prompt_len] int64"""
    tokenizer = load_raw_tokenizer(tokenizer_dir)
    stream = encode_documents(tokenizer, [f.text for f in corpus.held_out])
    return fixed_windows(stream, prompt_len, count)


def measure_acceptance(
    engine: Any,
    prompts: torch.Tensor,  # [N, P] token ids
    *,
    new_tokens: int = 256,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
) -> dict[str, Any]:
    """Run AR, the DFlash chain and DDTree at each budget over ``prompts``; return per-method statistics.

    ``engine`` is a started :class:`ddtree.engine.Engine`. Each method's entry has ``accept_length`` (total
    completion tokens / total verify rounds), its per-prompt mean, wall seconds and ``matches_ar`` (the number
    of prompts whose tokens equal plain decoding's)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    methods: list[tuple[str, TreeSettings]] = [("ar", TreeSettings(method="ar")),
                                               ("dflash", TreeSettings(method="dflash"))]
    methods += [(f"ddtree-{b}", TreeSettings(method="ddtree", budget=b)) for b in budgets]
    rows = [list(map(int, p)) for p in prompts]
    results: dict[str, Any] = {}
    reference: list[list[int]] | None = None
    for name, tree in methods:
        started = time.perf_counter()
        outputs = engine.generate(
            [GenerationRequest(prompt_token_ids=ids, tree=tree, sampling=sampling) for ids in rows]
        )
        wall = time.perf_counter() - started
        tokens = sum(o.stats.completion_tokens for o in outputs)
        rounds = sum(o.stats.verify_rounds for o in outputs)
        produced = [o.token_ids for o in outputs]
        if reference is None:
            reference = produced
        results[name] = {
            "accept_length": round(tokens / max(rounds, 1), 4),
            "accept_length_per_prompt_mean": round(
                sum(o.stats.accept_length for o in outputs) / len(outputs), 4),
            "completion_tokens": tokens,
            "verify_rounds": rounds,
            "matches_ar": sum(a == b for a, b in zip(produced, reference, strict=True)),
            "prompts": len(outputs),
            "wall_s": round(wall, 2),
        }
    return results


def markdown_table(results: dict[str, Any]) -> str:
    """One row per method: acceptance length, ratio to the chain, agreement with AR."""
    chain = results["dflash"]["accept_length"]
    lines = ["| method | acceptance length | x chain | outputs equal to AR |", "| --- | --- | --- | --- |"]
    for name, r in results.items():
        ratio = f"{r['accept_length'] / chain:.2f}" if name != "ar" else "-"
        lines.append(f"| {name} | {r['accept_length']:.2f} | {ratio} | {r['matches_ar']}/{r['prompts']} |")
    return "\n".join(lines)


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
