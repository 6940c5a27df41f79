"""The DFlash block-diffusion drafter (z-lab format), with a per-request cache of projected context.

Terms
-----
context features
    The target's hidden states after decoder layers ``target_layer_ids``, concatenated ``[.., n * H_target]``,
    then ``hidden_norm(fc(.))``. Every drafter layer turns them into context K/V (``k_norm`` + RoPE on K) without
    ``input_layernorm``; these never change once written, so they are cached (:meth:`DFlashDrafter.append_context`).
block
    ``[anchor, mask x (block_size - 1)]`` at absolute positions ``ctx_len .. ctx_len + block_size - 1``, where the
    anchor is the last committed token (whose target features do not exist yet). Position ``k`` predicts the token
    *at* ``k``; depths ``1 .. block_size - 1`` are the drafter's marginals ``q_1 .. q_L``.
visibility
    A block sees the context strictly before its anchor (within the draft window ``W``: positions
    ``ctx_len - W .. ctx_len - 1``) and its own block; full layers see the whole block, sliding layers are causal
    inside it and see only the last ``sliding_window`` positions (self included). For block_size 4, context length
    3 and a sliding window of 3, a sliding layer's query at depth 1 (position 4) sees::

        context 0 1 2 | block 3 4 5 6
                . . 1 |       1 1 . .

The drafter cache is indexed by absolute position (``write_pos == positions`` when appending context), so cache
index ``s`` is position ``s``. Blocks are recomputed each round and never cached.

:meth:`DFlashDrafter.draft_hidden` (engine, one block per request, context from the cache; :meth:`~DFlashDrafter.
draft_logits` adds the head) and
:meth:`DFlashDrafter.forward_train` (training, every anchored block of a sequence, context recomputed) share the
layer code and the mask rule (:func:`draft_visibility`), so a trained drafter drafts exactly as it was trained.

Kernels: the engine's calls pass its :class:`~ddtree.engine.kernels.KernelSet` (``kernels=``), of which the drafter
reads ``fused_ops`` (the fused layers' and the context/final norms' Triton kernels, the one-kernel context write),
``draft_attention`` (the block attention through the tree-attention kernel instead of a dense mask) and
``blas_rule``; without it (training, tests) every op runs its torch reference. The drafter keeps no choice of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ddtree.errors import ConfigError
from ddtree.models import fused_ops, tree_attention
from ddtree.models.config import DrafterConfig
from ddtree.models.gemm_backend import blas_for_rows
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import Attend, DecoderLayer, RMSNorm, Rotary, grad_needed, masked_attention
from ddtree.models.target import TargetModel
from ddtree.speculative.attention import pack_visibility
from ddtree.triton_runtime import can_run

if TYPE_CHECKING:
    from ddtree.engine.kernels import KernelSet


def draft_visibility(anchor: Tensor, depth: Tensor, query_block: Tensor, context_len: int, key_depth: Tensor,
                     key_block: Tensor, *, causal: bool, sliding_window: int | None,
                     window: Tensor | int | None = None, block_len: Tensor | None = None) -> Tensor:
    """Which keys each block query sees -> bool [R, Q, context_len + K] (True = attend).

    anchor [R, Q] position of the query's block anchor (= its context length); depth [Q] query depth in its
    block; query_block [Q] / key_block [K] block index of each query / block key; key_depth [K]; keys are the
    context positions ``0 .. context_len - 1`` followed by the K block keys. ``window`` ([R] or int) limits the
    context to the last ``window`` positions before the anchor; ``block_len`` [R] hides block keys at depth
    ``>= block_len`` from queries at depth ``< block_len`` (a shorter block drafts as if alone)."""
    qpos = anchor + depth  # [R, Q]
    s = torch.arange(context_len, device=anchor.device)
    ctx = s < anchor[..., None]  # [R, Q, S]
    if window is not None:
        lo = anchor - (window[:, None] if isinstance(window, Tensor) else window)
        ctx = ctx & (s >= lo[..., None])
    if sliding_window is not None:
        ctx = ctx & (qpos[..., None] - s < sliding_window)
    same = query_block[:, None] == key_block[None, :]  # [Q, K]
    diff = depth[:, None] - key_depth[None, :]  # query depth - key depth
    blk = same & (diff >= 0) if causal else same
    if sliding_window is not None:
        blk = blk & (diff < sliding_window) & (-diff < sliding_window)
    blk = blk.expand(anchor.shape[0], -1, -1)
    if block_len is not None:
        hidden_key = key_depth[None, None, :] >= block_len[:, None, None]
        live_query = depth[None, :, None] < block_len[:, None, None]
        blk = blk & ~(hidden_key & live_query)
    return torch.cat([ctx, blk], dim=-1)


def attend_with_context(q: Tensor, k: Tensor, v: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
    """Block queries q [R, H, Q, D] over ``[context ; block]`` keys: ctx_k/ctx_v [R, KV, S, D] then the block's
    k/v [R, KV, Q, D], under mask [R, 1, Q, S + Q] -> [R, H, Q, D]. The drafter's one attention entry point."""
    keys = torch.cat([ctx_k.to(k.dtype), k], dim=2)
    values = torch.cat([ctx_v.to(v.dtype), v], dim=2)
    return masked_attention(q, keys, values, mask)


class DFlashDrafter(nn.Module):
    """Parameter names equal the z-lab checkpoint's (``fc``, ``hidden_norm``, ``norm``, ``layers.N.*``)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(i, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         c.rms_norm_eps, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=True)
            for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def trained_block_size(self) -> int:
        return self.config.trained_block_size

    def allocate_cache(self, slots: int, max_len: int, *, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> KVCache:
        """Context K/V for every drafter layer: ``[layers, slots + 1, kv_heads, max_len, head_dim]``."""
        c = self.config
        return KVCache.allocate(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim,
                                dtype=dtype or self.dtype, device=device or self.device)

    def supports_tree_attention(self) -> bool:
        """Whether :meth:`draft_logits` can attend through the Triton tree-attention kernel (``draft_attention``):
        it can run on this drafter's weights, takes its head dim, and every layer sees its whole block (a causal
        or sliding layer's in-block rule is not the kernel's)."""
        c = self.config
        return (can_run(self.fc.weight) and tree_attention.supports_head_dim(c.head_dim)
                and all(not c.layer_is_causal(i) and c.layer_window(i) is None for i in range(c.num_layers)))

    def check_target(self, target: TargetModel) -> None:
        """Raise ConfigError unless this drafter can run on ``target`` (shared embedding and LM head)."""
        t, c = target.config, self.config
        if t.hidden_size != c.hidden_size:
            raise ConfigError(
                f"drafter hidden_size {c.hidden_size} differs from the target's {t.hidden_size}; the drafter "
                "uses the target's embedding and LM head, so they must match"
            )
        if c.mask_token_id >= t.vocab_size:
            raise ConfigError(f"drafter mask_token_id {c.mask_token_id} >= target vocab_size {t.vocab_size}")
        if max(c.target_layer_ids) >= t.num_layers:
            raise ConfigError(
                f"drafter target_layer_ids {c.target_layer_ids} reach past the target's {t.num_layers} layers"
            )
        if len(c.target_layer_ids) * t.hidden_size != c.feature_size:
            raise ConfigError(
                f"drafter fc expects {c.feature_size} feature columns, the target gives "
                f"{len(c.target_layer_ids)} x {t.hidden_size}"
            )

    def context(self, target_hidden: Tensor, *, kernels: bool = False) -> Tensor:
        """Target features [..., n * H_target] -> projected context [..., H] (``hidden_norm(fc(.))``); kernels: the
        norm as one Triton kernel where :meth:`_kernels_for` allows."""
        return self._norm(self.hidden_norm, self.fc(target_hidden.to(self.fc.weight.dtype)), kernels)

    def _kernels_for(self, x: Tensor, kernels: bool) -> bool:
        """Whether the drafter's own norms and context writes run the Triton kernels on ``x``: the caller chose
        them (``KernelSet.fused_ops``), the layers are fused (the layers' own kernels need that, and the drafter's
        follow them), ``x`` is on a device they run on and autograd needs none of it (no backward)."""
        attn = self.layers[0].self_attn
        return (attn.qkv is not None and attn.kernels_for(x, kernels)
                and not grad_needed(x, self.hidden_norm.weight, self.norm.weight))

    def _norm(self, norm: RMSNorm, x: Tensor, kernels: bool) -> Tensor:
        """``norm(x)``, as one Triton kernel where :meth:`_kernels_for` allows (the eager RMSNorm is five kernels;
        the context norm and the final norm run every round)."""
        return fused_ops.rms_norm(x, norm.weight, norm.eps) if self._kernels_for(x, kernels) else norm(x)

    def append_context(self, target_hidden: Tensor, positions: Tensor, cache: KVCache, slots: Tensor,
                       write_pos: Tensor, *, kernels: KernelSet | None = None) -> None:
        """Project new context features and write every layer's context K/V into the cache.

        target_hidden [R, N, n * H_target]; positions [R, N] absolute positions of those tokens; slots [R];
        write_pos [R, N] cache indices (equal to ``positions`` in the standard layout); kernels: the engine's
        KernelSet (``fused_ops`` is read; None = the torch reference)."""
        fused = kernels is not None and kernels.fused_ops
        ctx = self.context(target_hidden, kernels=fused)  # [R, N, H]
        cos, sin = self.rotary(positions, ctx.dtype)
        # One Triton kernel per layer instead of KVCache.write's two indexing kernels (0.038 of the 0.171 ms an
        # append of a 16-token path cost on the Qwen3-8B stand-in's drafter, H200 run 16).
        # write_kv reads slots and write_pos on the cache's device, write_pos at unit stride over T; KVCache.write
        # takes any layout. Autograd: the K/V projections may need grad even when ctx and the norms do not.
        one_kernel = (self._kernels_for(ctx, fused) and tree_attention.supports_head_dim(self.config.head_dim)
                      and cache.k.device == ctx.device == slots.device == write_pos.device
                      and write_pos.stride(-1) == 1)
        for layer in self.layers:
            k, v = layer.self_attn.project_kv(ctx, cos, sin, kernels=fused)
            if one_kernel and not grad_needed(k, v):
                tree_attention.write_kv(cache.k[layer.index], cache.v[layer.index], slots, write_pos, k, v)
            else:
                cache.write(layer.index, slots, write_pos, k, v)

    def head(self, target: TargetModel, normed: Tensor) -> Tensor:
        """Drafter hidden (after ``norm``) [..., H] -> logits [..., V]: the target's LM head, then z-lab's
        optional output multiplier and tanh soft-cap."""
        logits = target.lm_logits(normed.to(target.dtype))
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def _layer_masks(self, build) -> dict[int, Tensor]:
        """One [R, 1, Q, K] mask per distinct (causal, sliding window) among the layers, indexed by layer."""
        by_kind: dict[tuple[bool, int | None], Tensor] = {}
        masks: dict[int, Tensor] = {}
        for i in range(self.config.num_layers):
            kind = (self.config.layer_is_causal(i), self.config.layer_window(i))
            if kind not in by_kind:
                by_kind[kind] = build(*kind)[:, None]
            masks[i] = by_kind[kind]
        return masks

    def _run_blocks(self, target: TargetModel, ids: Tensor, positions: Tensor, attend: Attend,
                    kernels: KernelSet | None) -> Tensor:
        """Block tokens [R, Q] at positions [R, Q] through every layer -> final-normed hidden [R, Q, H]."""
        fused = kernels is not None and kernels.fused_ops
        h = target.embed(ids).to(self.dtype)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        cos, sin = self.rotary(positions, h.dtype)
        with blas_for_rows(ids.numel(), ids.device, rule=kernels is None or kernels.blas_rule):
            for layer in self.layers:
                h = layer(h, cos, sin, attend, kernels=fused)
        return self._norm(self.norm, h, fused)

    def draft_logits(self, target: TargetModel, root_tokens: Tensor, ctx_len: Tensor, cache: KVCache,
                     slots: Tensor, block_size: int, *, block_len: Tensor | None = None,
                     window: Tensor | None = None, kv_len: int | None = None,
                     kernels: KernelSet | None = None) -> Tensor:
        """Draft one block per request -> logits [R, block_size - 1, V] for depths 1 .. block_size - 1:
        :meth:`head` over :meth:`draft_hidden` (same arguments)."""
        return self.head(target, self.draft_hidden(target, root_tokens, ctx_len, cache, slots, block_size,
                                                   block_len=block_len, window=window, kv_len=kv_len,
                                                   kernels=kernels))

    def draft_hidden(self, target: TargetModel, root_tokens: Tensor, ctx_len: Tensor, cache: KVCache,
                     slots: Tensor, block_size: int, *, block_len: Tensor | None = None,
                     window: Tensor | None = None, kv_len: int | None = None,
                     kernels: KernelSet | None = None) -> Tensor:
        """Draft one block per request -> the final-normed hidden [R, block_size - 1, H] at depths 1 ..
        block_size - 1, before the head: the engine applies :meth:`head` only to the depths a round's trees can
        reach (a tree of B nodes is at most B deep), which at 64 rows of budget 4 is a quarter of the head's
        [R x 15, H] x [H, V] matmul.

        root_tokens [R] last committed token (the anchor, at position ``ctx_len``); ctx_len [R] context
        positions ``0 .. ctx_len - 1`` are in the cache; slots [R]; block_size the static block length of this
        call; block_len [R] per-request block size <= block_size (outputs past it are meaningless); window [R]
        draft window (None = all context); kv_len static number of cache positions read (a bound on every
        ``ctx_len``; None = the whole cache).

        kernels: the engine's KernelSet (None = the torch reference for every op); ``fused_ops`` and ``blas_rule``
        as in the target's forward. With ``draft_attention`` (the caller's choice, where
        :meth:`supports_tree_attention`) the block attends through the Triton tree-attention kernel instead of
        gathering the context and building a dense mask: the block's K/V are then written into the cache at
        ``ctx_len ..`` first (positions past the committed context: the next :meth:`append_context` overwrites
        them) and the kernel reads context and block from the cache by slot."""
        c = self.config
        length = cache.max_len if kv_len is None else kv_len
        device = root_tokens.device
        depth = torch.arange(block_size, device=device)
        ids = torch.where(depth == 0, root_tokens[:, None], c.mask_token_id)  # [R, bs]
        positions = ctx_len[:, None] + depth  # [R, bs]
        if kernels is not None and kernels.draft_attention:
            if not self.supports_tree_attention():
                raise ConfigError("draft_hidden with KernelSet.draft_attention needs supports_tree_attention(); "
                                  "resolve the KernelSet for this drafter (KernelSet.resolve) or turn it off")
            return self._run_blocks(target, ids, positions, self._kernel_attend(
                cache, slots, ctx_len, positions, block_size, block_len, window, length), kernels)[:, 1:]
        zeros = torch.zeros_like(depth)
        anchor = ctx_len[:, None].expand(-1, block_size)
        masks = self._layer_masks(lambda causal, sliding: draft_visibility(
            anchor, depth, zeros, length, depth, zeros, causal=causal, sliding_window=sliding,
            window=window, block_len=block_len))

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            ck, cv = cache.read(layer, slots, length)
            return attend_with_context(q, k, v, ck, cv, masks[layer])

        return self._run_blocks(target, ids, positions, attend, kernels)[:, 1:]

    def _kernel_attend(self, cache: KVCache, slots: Tensor, ctx_len: Tensor, positions: Tensor, block_size: int,
                       block_len: Tensor | None, window: Tensor | None, length: int) -> Attend:
        """The block attention of :func:`draft_visibility` for full layers, as the tree kernel's (start, new_vis,
        first): context ``[ctx_len - window, ctx_len)``, and every block key except, for live queries (depth below
        block_len), keys at depth >= block_len."""
        rows = ctx_len.shape[0]
        depth = torch.arange(block_size, device=ctx_len.device)
        new_vis = torch.ones(rows, block_size, block_size, dtype=torch.bool, device=ctx_len.device)
        if block_len is not None:
            hidden_key = depth[None, None, :] >= block_len[:, None, None]
            live_query = depth[None, :, None] < block_len[:, None, None]
            new_vis = ~(hidden_key & live_query)
        first = None if window is None else (ctx_len - window).clamp(min=0)
        kv_len = min(length + block_size, cache.max_len)  # ctx_len + block_size <= the engine's cache length
        packed = pack_visibility(new_vis)  # once for all layers

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            tree_attention.write_kv(cache.k[layer], cache.v[layer], slots, positions, k, v)
            return tree_attention.tree_attention(q, cache.k[layer], cache.v[layer], slots, ctx_len, new_vis, kv_len,
                                                 first=first, packed=packed)

        return attend

    def forward_train(self, target: TargetModel, input_ids: Tensor, target_hidden: Tensor, anchors: Tensor, *,
                      block_size: int | None = None, window: int | None = None,
                      return_hidden: bool = False) -> Tensor:
        """Every anchored block of each training sequence in one pass (the training objective's forward).

        input_ids [B, T] the sequence; target_hidden [B, T, n * H_target] the target's features for it
        (``target.forward_train(input_ids, self.config.target_layer_ids).hidden``); anchors [B, A] block anchor
        positions, each in ``0 .. T - 1`` (a block's context is positions ``< anchor``; its tokens sit at
        ``anchor .. anchor + block_size - 1``); block_size defaults to the drafter's; window limits the context
        to the last ``window`` positions before each anchor.

        Returns logits [B, A, block_size - 1, V] for depths 1.. (the token predicted at depth j is
        ``input_ids[b, anchor + j]``, when that is < T), or with ``return_hidden`` the final-normed hidden
        [B, A, block_size - 1, H] so a caller can apply :meth:`head` in chunks to save memory."""
        c = self.config
        bs = block_size or c.block_size
        batch, seq = input_ids.shape
        n_blocks = anchors.shape[1]
        device = input_ids.device
        depth = torch.arange(bs, device=device).repeat(n_blocks)  # [A * bs]
        block = torch.arange(n_blocks, device=device).repeat_interleave(bs)  # [A * bs]
        anchor = anchors.repeat_interleave(bs, dim=1)  # [B, A * bs]
        ids = torch.where(depth == 0, torch.gather(input_ids, 1, anchor), c.mask_token_id)
        positions = anchor + depth
        masks = self._layer_masks(lambda causal, sliding: draft_visibility(
            anchor, depth, block, seq, depth, block, causal=causal, sliding_window=sliding, window=window))
        ctx = self.context(target_hidden)  # [B, T, H]
        ctx_cos, ctx_sin = self.rotary(torch.arange(seq, device=device).expand(batch, -1), ctx.dtype)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            ck, cv = self.layers[layer].self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            return attend_with_context(q, k, v, ck, cv, masks[layer])

        h = self._run_blocks(target, ids, positions, attend, None)
        h = h.unflatten(1, (n_blocks, bs))[:, :, 1:]
        return h if return_hidden else self.head(target, h)
