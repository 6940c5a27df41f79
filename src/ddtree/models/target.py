"""The target model (Qwen3 / Qwen2 / Llama) with a static KV cache, explicit positions and explicit visibility.

One forward serves every engine step: prefill chunks, plain decoding, chain and tree verification. The caller
says, for each request row ``r`` and new token ``t``, which RoPE position it has (``positions``, a tree node's is
``start + depth``), where its K/V goes in the cache (``write_pos``) and which cache positions it may see
(``visibility``). New tokens are written into the cache *before* attention, so a token sees itself and any
earlier new token through the cache like any committed token. Example: a prefix of 5 committed tokens and a tree
root(0) -> a(1), root -> b(2), a -> c(3) written at cache indices 5..8 with positions 5, 6, 6, 7:

    node  sees cache 0..4  5  6  7  8
    root      all          1  .  .  .
    a         all          1  1  .  .
    b         all          1  .  1  .
    c         all          1  1  .  1

``visibility`` is one argument that names the attention path by its type, never by a ``None``:

- a dense bool mask ``attn_mask[r, t, s]`` over cache positions (a ``Tensor``): the dense path, the reference;
- a :class:`~ddtree.speculative.attention.TreeVisibility` ``(start, new_vis, kv_len)`` when the new tokens sit at
  ``start + t`` (tree rounds and prefill chunks): the layers attend through :mod:`ddtree.models.tree_attention`,
  which reads K/V from the cache by slot and never builds the mask, where the target
  :meth:`~TargetModel.supports_tree_attention` (CUDA with Triton, a head dim the kernel takes); otherwise the
  forward builds the dense mask from it once.

Which one to pass is the caller's choice (the engine's ``KernelSet.tree_attention``). The other per-op choices of a
forward, the layers' element-wise kernels (``fused_ops``) and the cuBLAS front end (``blas_rule``), come with the
``kernels`` argument (the engine's :class:`~ddtree.engine.kernels.KernelSet`); the model keeps no choice of its own.

Returns logits only at ``logits_at`` and the hidden states after the decoder layers in ``hidden_layers``
(DFlash context features) without keeping every layer's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from ddtree.errors import ConfigError, ShapeError
from ddtree.models import exact_forward, tree_attention
from ddtree.models.config import TargetConfig
from ddtree.models.gemm_backend import blas_for_rows
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import DecoderLayer, RMSNorm, Rotary, masked_attention
from ddtree.speculative.attention import TreeVisibility, build_attention_mask
from ddtree.triton_runtime import can_run

if TYPE_CHECKING:
    from ddtree.engine.kernels import KernelSet


def attend_over_cache(cache: KVCache, layer: int, q: Tensor, k: Tensor, v: Tensor, slots: Tensor,
                      write_pos: Tensor, visibility: Tensor | TreeVisibility) -> Tensor:
    """Write the new tokens' K/V (k, v [R, KV, T, D]) at ``write_pos`` [R, T] of ``slots`` [R], then attend
    q [R, H, T, D] over the cache -> [R, H, T, D].

    ``visibility`` a dense mask [R, T, S]: the reference path (gather positions ``0 .. S - 1`` of the slots, one
    masked SDPA/matmul call). A :class:`TreeVisibility`: the Triton tree-attention kernel (``write_pos`` must then
    be ``start + arange(T)``); :meth:`TargetModel.forward` picks the path once. The only place the target touches
    cache layout and visibility; the kernel path also writes the K/V with one kernel
    (:func:`ddtree.models.tree_attention.write_kv`) instead of ``KVCache.write``'s two indexing kernels."""
    if isinstance(visibility, TreeVisibility):
        tree = visibility
        tree_attention.write_kv(cache.k[layer], cache.v[layer], slots, write_pos, k, v)
        return tree_attention.tree_attention(q, cache.k[layer], cache.v[layer], slots, tree.start, tree.new_vis,
                                             tree.kv_len, packed=tree.packed)
    attn_mask = visibility
    cache.write(layer, slots, write_pos, k, v)
    k_all, v_all = cache.read(layer, slots, attn_mask.shape[-1])
    return masked_attention(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask[:, None])


class Segment(NamedTuple):
    """One group of rows of a segmented forward (:meth:`TargetModel.forward_segments`), in
    :meth:`TargetModel.forward`'s own terms: rows of one width, their own visibility (and so attention path)."""

    input_ids: Tensor  # [R, T]
    positions: Tensor  # [R, T] RoPE
    slots: Tensor  # [R]
    write_pos: Tensor  # [R, T]
    visibility: Tensor | TreeVisibility  # a dense mask [R, T, S] or a TreeVisibility, as forward takes it
    logits_at: Tensor | None  # [R, N] indices into T whose final-normed states come back; None = all T


class TargetOutput(NamedTuple):
    logits: Tensor | None  # [R, N, V]
    hidden: Tensor | None  # [R, T, len(hidden_layers) * H]
    # [R, N, H] the final-normed states at logits_at, in place of the logits of a forward with head=False
    # (TargetModel.head_logits applies the head: the same bits as the forward's own)
    normed: Tensor | None = None


class TargetModel(nn.Module):
    """Parameter names equal transformers' with the ``model.`` prefix dropped (``lm_head`` absent when tied)."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        # nn.Embedding's own initialisation, written out: on the meta device (every checkpoint load builds there)
        # its normal_ goes through a Python reference that imports torch._dynamo, about 3 s of a cold start
        weight = torch.empty(c.vocab_size, c.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(i, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         c.rms_norm_eps, qkv_bias=c.attention_bias, o_bias=c.o_bias, qk_norm=c.qk_norm)
            for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, ids: Tensor) -> Tensor:
        """ids [R, T] -> [R, T, H]."""
        return self.embed_tokens(ids)

    def lm_logits(self, normed_hidden: Tensor) -> Tensor:
        """[..., H] (after the final norm) -> [..., V], through the tied embedding or the separate head."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(normed_hidden, weight)

    def allocate_cache(self, slots: int, max_len: int, *, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> KVCache:
        c = self.config
        return KVCache.allocate(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim,
                                dtype=dtype or self.dtype, device=device or self.device)

    def _check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None:
        for i in hidden_layers:
            if not 0 <= i < self.config.num_layers:
                raise ConfigError(
                    f"hidden layer {i} is out of range for a target with {self.config.num_layers} layers"
                )

    def supports_tree_attention(self) -> bool:
        """Whether a forward given a :class:`TreeVisibility` attends through the Triton kernel: it can run on this
        model's weights (:func:`ddtree.triton_runtime.can_run`) and takes its head dim. Otherwise such a forward
        builds the dense mask from it."""
        return can_run(self.embed_tokens.weight) and tree_attention.supports_head_dim(self.config.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, cache: KVCache, slots: Tensor, write_pos: Tensor,
                visibility: Tensor | TreeVisibility, *, kernels: KernelSet | None = None,
                logits_at: Tensor | None = None, hidden_layers: tuple[int, ...] = (), head: bool = True) -> TargetOutput:
        """One step for a batch of requests.

        input_ids [R, T]; positions [R, T] (RoPE); slots [R] (padding rows: ``cache.scratch_slot``);
        write_pos [R, T] cache index of each new token; visibility, which also picks the attention path:
        either a dense mask [R, T, S] bool over cache positions ``0..S-1`` (True = attend; each row must allow at
        least one position, its own included), or ``TreeVisibility(start [R], new_vis [R, T, T], kv_len)``
        describing the same visibility as ``build_attention_mask(start, write_pos, new_vis, kv_len)``, valid only
        when ``write_pos == start + arange(T)`` (the Triton kernel runs where :meth:`supports_tree_attention`,
        otherwise the dense mask is built once from it);
        kernels: the engine's :class:`~ddtree.engine.kernels.KernelSet` (``exact``: the whole forward is
        :func:`ddtree.models.exact_forward.forward`, which needs a TreeVisibility), of which this forward reads ``fused_ops``
        (the fused layers' element-wise Triton kernels) and ``blas_rule`` (:mod:`ddtree.models.gemm_backend`);
        None = no Triton kernel in the layers and the BLAS rule on (a plain forward, as tests and tools run it);
        logits_at [R, N] indices into T (None = all T, ``[R, 0]`` = none); hidden_layers: decoder layer ids
        whose outputs are returned concatenated (after layer i = transformers' ``hidden_states[i + 1]``, which
        for the last layer is the final-normed state); head: False returns the final-normed states at
        ``logits_at`` as ``normed`` instead of their logits (:meth:`head_logits` makes the same logits later: the
        CUDA-graph runner captures the layers once for every sampling variant of a round)."""
        self._check_hidden_layers(hidden_layers)
        if kernels is not None and kernels.exact:  # exact mode: its own forward (ddtree.models.exact_forward)
            return exact_forward.forward(self, input_ids, positions, cache, slots, write_pos, visibility, logits_at,
                                         hidden_layers, triton=can_run(input_ids), blas=kernels.exact_blas, head=head)
        attend = self._attender(cache, slots, write_pos, visibility)
        fused = kernels is not None and kernels.fused_ops
        with blas_for_rows(input_ids.numel(), input_ids.device, rule=kernels is None or kernels.blas_rule):
            return self._run(input_ids, positions, attend, logits_at, hidden_layers, fused, head)

    def _attender(self, cache: KVCache, slots: Tensor, write_pos: Tensor,
                  visibility: Tensor | TreeVisibility) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        """The layers' attention over ``cache`` for rows of ``slots`` (:func:`attend_over_cache`), its path picked
        once from the visibility's type: the kernel's packed visibility, or the dense mask built here."""
        if isinstance(visibility, TreeVisibility):
            if self.supports_tree_attention():
                visibility = visibility.with_packed()  # once here, not in each layer's kernel call
            else:
                visibility = build_attention_mask(visibility.start, write_pos, visibility.new_vis, visibility.kv_len)
        elif not isinstance(visibility, Tensor):
            raise ShapeError(f"TargetModel.forward takes a dense mask tensor or a TreeVisibility as visibility, "
                             f"got {type(visibility).__name__}")

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return attend_over_cache(cache, layer, q, k, v, slots, write_pos, visibility)

        return attend

    def forward_segments(self, segments: list[Segment], cache: KVCache, *, kernels: KernelSet | None = None,
                         hidden_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
        """One forward over several groups of rows of different widths: per segment, ``hidden`` [R, T, F] and the
        final-normed states at its ``logits_at`` as ``normed`` [R, N, H] (:meth:`head_logits` gives the logits).

        Why: a verify round's trees (R rows of N nodes) and a prompt chunk (a row of hundreds of tokens) share the
        target's weights; padding both to one width would multiply the trees' rows, two forwards read the weights
        twice. Here every token-wise op (embedding, norms, the five linears, RoPE) runs once over all the segments'
        tokens, flattened to one row ``[1, sum R x T]``, and attention runs per segment over its own rows and
        visibility (each writes its K/V before it attends, as :meth:`forward` does; the segments' rows must be
        different requests, whose cache slots they alone touch). In exact mode the token-wise ops compute a row the
        same way whatever else is in the call, so every segment gets the bits :meth:`forward` gives it alone."""
        self._check_hidden_layers(hidden_layers)
        if not segments:
            raise ShapeError("forward_segments needs at least one segment")
        exact = kernels is not None and kernels.exact
        ids = torch.cat([s.input_ids.reshape(1, -1) for s in segments], 1)
        positions = torch.cat([s.positions.reshape(1, -1) for s in segments], 1)
        dims = [tuple(s.input_ids.shape) for s in segments]
        if exact:
            triton = can_run(ids)
            attends = [exact_forward.attender(self, cache, s.slots, s.write_pos, s.positions, s.visibility,
                                              triton=triton) for s in segments]
        else:
            attends = [self._attender(cache, s.slots, s.write_pos, s.visibility) for s in segments]
        index, offset = [], 0  # each segment's logits_at as indices into the flat row
        for s, (r, t) in zip(segments, dims, strict=True):
            at = s.logits_at if s.logits_at is not None else torch.arange(t, device=ids.device).expand(r, t)
            index.append((at + offset + torch.arange(r, device=ids.device)[:, None] * t).reshape(1, -1))
            offset += r * t
        logits_at = torch.cat(index, 1)
        attend = _segmented_attend(attends, dims)
        if exact:
            out = exact_forward.run(self, ids, positions, attend, logits_at, hidden_layers, triton=triton,
                                    blas=kernels.exact_blas, head=False)
        else:
            with blas_for_rows(ids.numel(), ids.device, rule=kernels is None or kernels.blas_rule):
                out = self._run(ids, positions, attend, logits_at, hidden_layers,
                                kernels is not None and kernels.fused_ops, head=False)
        outs, offset, at_offset = [], 0, 0
        for s, (r, t) in zip(segments, dims, strict=True):
            n = t if s.logits_at is None else s.logits_at.shape[1]
            hidden = None if out.hidden is None else out.hidden[0, offset : offset + r * t].view(r, t, -1)
            normed = out.normed[0, at_offset : at_offset + r * n].view(r, n, -1)
            outs.append(TargetOutput(None, hidden, normed))
            offset += r * t
            at_offset += r * n
        return outs

    def head_logits(self, normed: Tensor, *, kernels: KernelSet | None = None) -> Tensor:
        """The logits ``[R, N, V]`` of a ``head=False`` forward's ``normed [R, N, H]``: bit for bit what that forward
        would have returned with ``logits_at`` None (the verify's case), the same head under the same matmul choice
        (the BLAS rule for the token count R x N, then equal to the forward's; exact mode's own head). With a
        ``logits_at`` the forward's rule counted all R x T tokens, so the bits may differ."""
        if kernels is not None and kernels.exact:
            return exact_forward.head_logits(self, normed, triton=can_run(normed), blas=kernels.exact_blas)
        with blas_for_rows(normed.shape[0] * normed.shape[1], normed.device, rule=kernels is None or kernels.blas_rule):
            return self.lm_logits(normed)

    def forward_train(self, input_ids: Tensor, hidden_layers: tuple[int, ...] = (), *,
                      with_logits: bool = True) -> TargetOutput:
        """Plain causal forward without a cache (training, feature extraction): input_ids [B, T] ->
        logits [B, T, V] (None unless ``with_logits``) and hidden [B, T, len(hidden_layers) * H]."""
        self._check_hidden_layers(hidden_layers)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return masked_attention(q, k, v, None, causal=True)

        none = input_ids.new_zeros((input_ids.shape[0], 0))
        return self._run(input_ids, positions, attend, None if with_logits else none, hidden_layers, False)

    def _run(self, input_ids: Tensor, positions: Tensor, attend, logits_at: Tensor | None,
             hidden_layers: tuple[int, ...], kernels: bool, head: bool = True) -> TargetOutput:
        """The layers, then the final norm and the head at ``logits_at``; kernels: the layers' element-wise Triton
        kernels (``KernelSet.fused_ops``); head False: no head (``normed`` returned)."""
        return self.run_layers(input_ids, positions, lambda layer, h, cos, sin: layer(h, cos, sin, attend,
                                                                                         kernels=kernels),
                               self.norm, self.lm_logits if head else None, logits_at, hidden_layers)

    def run_layers(self, input_ids: Tensor, positions: Tensor, step: Callable[..., Tensor],
                   norm: Callable[[Tensor], Tensor], head: Callable[[Tensor], Tensor] | None,
                   logits_at: Tensor | None, hidden_layers: tuple[int, ...]) -> TargetOutput:
        """The forward's skeleton, shared with exact mode (:mod:`ddtree.models.exact_forward`, which brings its own
        layer step, norm and head): embed and rotate, ``step(layer, h, cos, sin) -> h`` per layer keeping the
        hidden states asked for, then ``head(norm(h))`` at every position (``logits_at`` None), at the positions
        ``logits_at`` [R, N] names, or nowhere (N = 0); ``head`` None: ``norm(h)`` there, as ``normed``."""
        h = self.embed(input_ids)  # [R, T, H]
        cos, sin = self.rotary(positions, h.dtype)
        wanted = set(hidden_layers)
        kept: dict[int, Tensor] = {}
        last = self.config.num_layers - 1
        for layer in self.layers:
            h = step(layer, h, cos, sin)
            if layer.index in wanted and layer.index != last:
                kept[layer.index] = h
        if last in wanted:
            kept[last] = norm(h)
        hidden = torch.cat([kept[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        if logits_at is None:
            normed = norm(h)
        elif logits_at.shape[1] == 0:
            return TargetOutput(None, hidden)
        else:
            normed = norm(torch.gather(h, 1, logits_at[..., None].expand(-1, -1, h.shape[-1])))  # [R, N, H]
        if head is None:
            return TargetOutput(None, hidden, normed)
        return TargetOutput(head(normed), hidden)


def _segmented_attend(attends: list[Callable[[int, Tensor, Tensor, Tensor], Tensor]],
                      dims: list[tuple[int, int]]) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
    """The attention of a flat forward over segments (:meth:`TargetModel.forward_segments`): q [1, H, sum R x T, D]
    (k, v with KV heads) cut into each segment's [R, H, T, D], attended by that segment's ``attends`` entry, and put
    back as [1, H, sum R x T, D] (a transposed view of [1, tokens, H, D] memory, as the layers' own attention returns)."""

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs, offset = [], 0
        for fn, (r, t) in zip(attends, dims, strict=True):
            # [1, heads, tokens, D] -> this segment's [R, heads, T, D]
            q_, k_, v_ = (x[0, :, offset : offset + r * t].unflatten(1, (r, t)).transpose(0, 1).contiguous()
                          for x in (q, k, v))
            out = fn(layer, q_, k_, v_)  # [R, H, T, D]
            outs.append(out.transpose(1, 2).reshape(1, r * t, *out.shape[1:2], out.shape[-1]))
            offset += r * t
        return torch.cat(outs, 1).transpose(1, 2)

    return attend
