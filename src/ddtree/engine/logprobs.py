"""Log-probabilities of the target's distribution: computed on the device, carried home in the round's one copy.

Which distribution: the target's *raw* next-token distribution, ``log_softmax(logits)`` before temperature,
top-p and top-k, as vLLM returns by default (its ``logprobs_mode="raw_logprobs"``). So a request's log-probs are
the same whichever method (AR, the DFlash chain, DDTree) or sampling settings produced its tokens, and they are
always the target's, never the drafter's.

Where they come from: under speculation, the verify forward's logits at the nodes the walk accepted. A round
commits ``n`` tokens; token ``j`` is the target's choice at accepted node ``path[j]``, so its log-probs are those of
``logits[path[j]]`` (the bonus token's are those of the last accepted node). An AR round is the tree of the root
alone, so the same code covers it. The first completion token's come from the prefill's last logits, a prompt's
(``prompt_logprobs``, for ``echo``) from the prefill's logits at every prompt position.

How they travel: a round's result is one ``long`` tensor ``[R, 1 + (L + 1)]`` (count, tokens). A round that
computes log-probs appends, per row, the chosen tokens' log-probs, then the top-``MAX_LOGPROBS`` ids, then their
log-probs; the float32 values ride bit-cast to int32 and widened to int64 (exact both ways), so the round still
crosses to the host as one tensor in one copy (:class:`ddtree.engine.runner.HostCopy`) and the CUDA graph of the
round simply has a wider output. The device always computes the top ``MAX_LOGPROBS``; each request's ``N`` is
cut on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.engine.api import MAX_LOGPROBS, TokenLogprob

__all__ = ["MAX_LOGPROBS", "TokenLogprob", "bits_to_floats", "device_logprobs", "float_bits", "host_entries",
           "pack_round_logprobs", "unpack_logprobs"]


def device_logprobs(logits: Tensor, chosen: Tensor, k: int = MAX_LOGPROBS) -> tuple[Tensor, Tensor, Tensor]:
    """logits ``[..., V]`` (any float dtype), chosen ``[...]`` long -> (chosen log-probs ``[...]`` float32,
    top log-probs ``[..., k]`` float32, top ids ``[..., k]`` long). Pure tensor ops: no host sync."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    top_lp, top_ids = torch.topk(logp, k, dim=-1)
    chosen_lp = torch.gather(logp, -1, chosen.long().unsqueeze(-1)).squeeze(-1)
    return chosen_lp, top_lp, top_ids


def float_bits(values: Tensor) -> Tensor:
    """float32 values as int64 carrying their bit pattern (sign-extended int32): exact, reversible on the host."""
    return values.float().contiguous().view(torch.int32).long()


def bits_to_floats(bits: list[int]) -> list[float]:
    """The host side of :func:`float_bits`."""
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).tolist()


def pack_round_logprobs(logits: Tensor, path: Tensor, new_tokens: Tensor, k: int = MAX_LOGPROBS) -> Tensor:
    """The log-prob columns of a round's result: ``[R, (L + 1) * (1 + 2k)]`` long.

    logits ``[R, N, V]`` (the verify's), path ``[R, L + 1]`` accepted node indices (padded), new_tokens
    ``[R, L + 1]`` the committed tokens (token ``j`` was chosen at node ``path[j]``). Layout per row: chosen
    log-probs (L + 1), top ids ((L + 1) * k), top log-probs ((L + 1) * k); floats as :func:`float_bits`."""
    rows, width = path.shape
    node_logits = torch.gather(logits, 1, path[:, :, None].expand(-1, -1, logits.shape[-1]))  # [R, L + 1, V]
    chosen_lp, top_lp, top_ids = device_logprobs(node_logits, new_tokens, k)
    return torch.cat([float_bits(chosen_lp), top_ids.reshape(rows, -1), float_bits(top_lp).reshape(rows, -1)], 1)


def unpack_logprobs(cols: list[int], tokens: list[int], width: int, k: int, n_top: int) -> list[TokenLogprob]:
    """One row's log-prob columns (:func:`pack_round_logprobs`, ``width`` = L + 1 positions) -> the first
    ``len(tokens)`` positions' :class:`TokenLogprob`, keeping ``n_top`` of the ``k`` top entries."""
    chosen = bits_to_floats(cols[:width])
    ids = cols[width : width + width * k]
    top = bits_to_floats(cols[width + width * k : width + 2 * width * k])
    return [_entry(tok, chosen[j], ids[j * k : j * k + n_top], top[j * k : j * k + n_top])
            for j, tok in enumerate(tokens)]


def host_entries(chosen: list[float], top_lp: list[list[float]], top_ids: list[list[int]], tokens: list[int],
                 n_top: int) -> list[TokenLogprob]:
    """Entries from already-host values (the prefill path: ``device_logprobs``' outputs after ``tolist``)."""
    return [_entry(tok, chosen[j], top_ids[j][:n_top], top_lp[j][:n_top]) for j, tok in enumerate(tokens)]


def _entry(token: int, logprob: float, ids: list[int], lps: list[float]) -> TokenLogprob:
    return TokenLogprob(token_id=int(token), logprob=float(logprob),
                        top=tuple((int(i), float(v)) for i, v in zip(ids, lps, strict=True)))
