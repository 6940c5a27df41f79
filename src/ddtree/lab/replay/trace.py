"""Record one greedy trace that predicts DDTree acceptance for every budget and top-k.

Under greedy decoding the committed text does not depend on the tree settings (decoding is lossless), so every
speculative round of every setting starts from a prefix of the same continuation. What a round accepts depends only
on the drafter's marginals for the block anchored at that round's last committed token, and on the continuation
itself. A *trace* records both, for every position where a round could start:

    sequence s:   prompt p_1..p_P, continuation t_1..t_{T + L}   (T = max_tokens; L extra tokens of look-ahead so
                                                                  the last round's walk is known to its end)
    anchor (s, j), j = 1..T-1:  the block anchored at t_j (position P + j - 1; context = positions before it),
                                drafter log-probs per depth d = 1..L: the top-M tokens and their log-probs

Positions follow the engine (:mod:`ddtree.engine.request_state`): the first completion token comes from the
prefill; every later round is anchored at the last committed token. ``M`` must be at least the largest budget
to be predicted: a tree of budget B only ever holds tokens among the top min(B, V) of each depth.

The file is safetensors (tensors below) with the metadata as JSON in the header::

    tokens        [sum of sequence lengths] int64   prompt + continuation of every sequence, concatenated
    seq_offsets   [S + 1] int64                     where each sequence starts in ``tokens``
    prompt_lens   [S] int64
    top_ids       [A, L, M] int32                   top-M token ids per anchor and depth, best first
    top_logprobs  [A, L, M] float32                 their log-probs under the drafter (full-vocabulary softmax)
    anchor_seq    [A] int64, anchor_j [A] int64     which sequence, which completion token t_j anchors the block
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ddtree import speculative
from ddtree.errors import ConfigError

if TYPE_CHECKING:
    from ddtree.engine import Engine

TRACE_SCHEMA = "ddtree.replay.trace/1"
_NO_WINDOW = 1 << 30  # the engine's "whole context" window value


@dataclass(frozen=True)
class Trace:
    """A recorded trace (see the module docstring for the meaning of every field)."""

    block_size: int
    draft_window: int | None
    max_tokens: int  # T: completion tokens each sequence is scored on
    top_m: int
    vocab_size: int
    model: str
    tokens: Tensor  # [sum S_i] int64
    seq_offsets: Tensor  # [S + 1] int64
    prompt_lens: Tensor  # [S] int64
    top_ids: Tensor  # [A, L, M] int32
    top_logprobs: Tensor  # [A, L, M] float32
    anchor_seq: Tensor  # [A] int64
    anchor_j: Tensor  # [A] int64, 1-based completion index of the anchor token

    @property
    def depth(self) -> int:
        return self.block_size - 1

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.shape[0])

    def sequence(self, s: int) -> tuple[list[int], list[int]]:
        """(prompt ids, continuation ids including the look-ahead) of sequence ``s``."""
        lo, hi = int(self.seq_offsets[s]), int(self.seq_offsets[s + 1])
        ids = self.tokens[lo:hi].tolist()
        p = int(self.prompt_lens[s])
        return ids[:p], ids[p:]

    def metadata(self) -> dict[str, Any]:
        return {
            "schema": TRACE_SCHEMA,
            "block_size": self.block_size,
            "draft_window": self.draft_window,
            "max_tokens": self.max_tokens,
            "top_m": self.top_m,
            "vocab_size": self.vocab_size,
            "model": self.model,
            "sequences": self.num_sequences,
            "anchors": int(self.anchor_seq.shape[0]),
        }

    def save(self, path: str | Path) -> Path:
        """Write the trace as safetensors (atomically: a temp file renamed over ``path``)."""
        from safetensors.torch import save

        from ddtree.files import atomic_write_bytes

        tensors = {
            "tokens": self.tokens,
            "seq_offsets": self.seq_offsets,
            "prompt_lens": self.prompt_lens,
            "top_ids": self.top_ids,
            "top_logprobs": self.top_logprobs,
            "anchor_seq": self.anchor_seq,
            "anchor_j": self.anchor_j,
        }
        meta = {"ddtree": json.dumps({**self.metadata(), "created": time.time()})}
        path = Path(path)
        atomic_write_bytes(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"trace file {path} does not exist; record one with `ddtree replay record`")
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = json.loads((fh.metadata() or {}).get("ddtree", "{}"))
                tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 (not a dict)
        except Exception as exc:  # safetensors raises its own error types for malformed files
            raise ConfigError(f"{path} is not a readable trace file: {exc}") from None
        if meta.get("schema") != TRACE_SCHEMA:
            raise ConfigError(f"{path} is not a ddtree trace (schema {meta.get('schema')!r}, want {TRACE_SCHEMA})")
        return cls(
            block_size=int(meta["block_size"]),
            draft_window=meta["draft_window"],
            max_tokens=int(meta["max_tokens"]),
            top_m=int(meta["top_m"]),
            vocab_size=int(meta["vocab_size"]),
            model=str(meta["model"]),
            **tensors,
        )


# ------------------------------------------------------------------------------------------------ recording
def _greedy_continuations(engine: Engine, prompts: list[list[int]], length: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt, ``length`` tokens (EOS ignored), from the engine's plain
    decoder: the text every lossless setting reproduces."""
    from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings

    requests = [
        GenerationRequest(
            prompt_token_ids=ids,
            tree=TreeSettings(method="ar"),
            sampling=SamplingParams(max_tokens=length, ignore_eos=True),
            request_id=f"trace-{i}",
        )
        for i, ids in enumerate(prompts)
    ]
    outputs = engine.generate(requests)
    for out in outputs:
        if out.finish_reason != "length" or len(out.token_ids) != length:
            raise ConfigError(
                f"the engine stopped a trace continuation after {len(out.token_ids)} of {length} tokens "
                f"({out.finish_reason}: {out.error or 'max_len reached'}); raise the engine's max_len"
            )
    return [list(out.token_ids) for out in outputs]


@torch.inference_mode()
def _drafter_marginals(
    engine: Engine, ids: list[int], anchors: Tensor, block_size: int, window: int | None, top_m: int, chunk: int
) -> tuple[Tensor, Tensor]:
    """Top-M drafter log-probs for blocks anchored at ``anchors`` ([A] positions) of one sequence.

    The target runs once over the whole sequence (causal, like a prefill) and its features fill a one-slot
    drafter cache; each anchor's block then sees exactly the positions before it, as in the engine's rounds.
    Returns (top_ids [A, L, M] int32, top_logprobs [A, L, M] float32)."""
    target, drafter = engine.target, engine.drafter
    # the engine's element-wise kernels and BLAS rule; attention on the dense path (the mask below)
    kernels = dataclasses.replace(engine.runner.kernels, tree_attention=False, draft_attention=False)
    device = next(target.parameters()).device
    n = len(ids)
    slot0 = torch.zeros(1, dtype=torch.long, device=device)
    tcache = target.allocate_cache(1, n + 1)
    dcache = drafter.allocate_cache(1, n + 1)
    x = torch.tensor([ids], device=device)
    positions = torch.arange(n, device=device)[None]
    mask = speculative.build_attention_mask(
        torch.zeros(1, dtype=torch.long, device=device),
        positions,
        speculative.causal_visibility(n, torch.tensor([n], device=device)),
        n,
    )
    out = target(x, positions, tcache, slot0, positions, mask, kernels=kernels, logits_at=x.new_zeros((1, 0)),
                 hidden_layers=tuple(drafter.config.target_layer_ids))
    drafter.append_context(out.hidden, positions, dcache, slot0, positions, kernels=kernels)
    all_ids, all_lp = [], []
    for part in anchors.to(device).split(chunk):
        rows = part.shape[0]
        logits = drafter.draft_logits(
            target,
            x[0, part],
            part,
            dcache,
            torch.zeros(rows, dtype=torch.long, device=device),
            block_size,
            block_len=torch.full((rows,), block_size, device=device),
            window=torch.full((rows,), window or _NO_WINDOW, device=device),
            kv_len=n,
            kernels=kernels,
        )  # [rows, L, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, idx = torch.topk(logp, min(top_m, logp.shape[-1]), dim=-1)
        all_ids.append(idx.to(torch.int32).cpu())
        all_lp.append(vals.cpu())
    return torch.cat(all_ids), torch.cat(all_lp)


def record_trace(
    source: Engine | tuple[Any, Any, Any],
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int,
    block_size: int | None = None,
    draft_window: int | None = None,
    *,
    top_m: int = 64,
    out: str | Path | None = None,
    chunk: int = 32,
) -> Trace:
    """Record a trace for ``prompts`` (text or token ids), ``max_tokens`` completion tokens each.

    ``source`` is a running :class:`~ddtree.engine.Engine` or a ``(target, drafter, tokenizer)`` tuple (an engine
    is built over them for the greedy continuations). ``block_size`` defaults to the drafter's trained size,
    ``draft_window`` to the whole context; both shape the drafter's marginals, so each needs its own trace.
    ``top_m`` bounds the largest budget :func:`~ddtree.lab.replay.predict` can answer exactly. ``chunk`` anchors are
    drafted per call (memory: chunk x L x V floats)."""
    from ddtree.engine import Engine

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ConfigError(f"max_tokens must be an integer >= 2 (one round needs an anchor), got {max_tokens!r}")
    if not prompts:
        raise ConfigError("record_trace needs at least one prompt")
    if top_m < 1:
        raise ConfigError(f"top_m must be >= 1, got {top_m}")
    built = not isinstance(source, Engine)
    engine = _engine_for(source, prompts, max_tokens, block_size) if built else source
    try:
        if engine.drafter is None:
            raise ConfigError("the engine has no drafter: a trace records the drafter's marginals")
        bs = engine.trained_block_size if block_size is None else block_size
        if not 2 <= bs <= engine.max_block_size:
            raise ConfigError(f"block_size must be in 2..{engine.max_block_size} for this engine, got {bs}")
        if draft_window is not None and draft_window < bs:
            raise ConfigError(f"draft_window must be >= block_size {bs}, got {draft_window}")
        encoded = [engine.encode_prompt(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if any(not ids for ids in encoded):
            raise ConfigError("every prompt needs at least one token")
        lookahead = bs - 1  # the last round may walk this far past max_tokens
        continuations = _greedy_continuations(engine, encoded, max_tokens + lookahead)
        tokens, offsets, plens, ids_parts, lp_parts, seqs, js = [], [0], [], [], [], [], []
        for s, (prompt, cont) in enumerate(zip(encoded, continuations, strict=True)):
            full = prompt + cont
            tokens.extend(full)
            offsets.append(len(tokens))
            plens.append(len(prompt))
            j = torch.arange(1, max_tokens)  # anchors t_1 .. t_{T-1}
            anchors = len(prompt) + j - 1
            top_ids, top_lp = _drafter_marginals(engine, full, anchors, bs, draft_window, top_m, chunk)
            ids_parts.append(top_ids)
            lp_parts.append(top_lp)
            seqs.append(torch.full_like(j, s))
            js.append(j)
        trace = Trace(
            block_size=bs,
            draft_window=draft_window,
            max_tokens=max_tokens,
            top_m=int(ids_parts[0].shape[-1]),
            vocab_size=int(engine.target.config.vocab_size),
            model=engine.model_name,
            tokens=torch.tensor(tokens, dtype=torch.long),
            seq_offsets=torch.tensor(offsets, dtype=torch.long),
            prompt_lens=torch.tensor(plens, dtype=torch.long),
            top_ids=torch.cat(ids_parts),
            top_logprobs=torch.cat(lp_parts),
            anchor_seq=torch.cat(seqs),
            anchor_j=torch.cat(js),
        )
    finally:
        if built:
            engine.shutdown(drain_timeout=0)
    if out is not None:
        trace.save(out)
    return trace


def _engine_for(source: Any, prompts: Sequence[Any], max_tokens: int, block_size: int | None) -> Engine:
    from ddtree.engine import Engine, EngineConfig

    try:
        target, drafter, tokenizer = source
    except (TypeError, ValueError):
        raise ConfigError("record_trace needs an Engine or a (target, drafter, tokenizer) tuple") from None
    longest = max(len(p) if not isinstance(p, str) else len(tokenizer.encode(p)) for p in prompts)
    bs = block_size or int(drafter.config.block_size)
    config = EngineConfig(
        max_batch=min(len(prompts), 8),
        max_len=max(64, longest + max_tokens + bs + 8),
        max_block_size=max(bs, int(drafter.config.block_size)),
    )
    engine = Engine.from_models(target, drafter, tokenizer, config, model_name="trace")
    engine.start()
    return engine


__all__ = ["TRACE_SCHEMA", "Trace", "record_trace"]
