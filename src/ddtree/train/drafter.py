"""``ddtree train drafter``: a DFlash drafter trained on the target's own continuations (the DFlash recipe).

Recipe (as in the DFlash paper and SpecForge's trainer, written here from the description):

* each training row is ``[corpus prefix | target continuation]`` (``ddtree train data``);
* ``anchors_per_row`` anchor positions are drawn without replacement from ``prompt_len - 1 .. T - 2``, so every
  block's labels are target-generated tokens; a block is ``[anchor token, mask x (block_size - 1)]`` at positions
  ``anchor .. anchor + block_size - 1`` and sees the target features of positions strictly before its anchor;
* the loss is cross-entropy on depths ``k = 1 .. block_size - 1`` (labels past the row end are dropped), weighted
  ``exp(-(k - 1) / gamma)`` with ``gamma = 7``: early depths decide the acceptance length, so they count most;
* AdamW, linear warm-up then cosine decay; bf16 autocast on CUDA.

The forward is :meth:`ddtree.models.DFlashDrafter.forward_train`, which shares its layer code and mask rule with
the engine's ``draft_logits``, so the drafter drafts exactly as it was trained. The target is frozen and supplies
the context features (``TargetModel.forward_train(ids, target_layer_ids)``), the embedding and the LM head.

Evaluation (``block_acceptance``): replays the DFlash chain on held-out *greedy* continuations. On such a row the
target's choices are known in advance, so a round anchored at ``a`` commits ``1 + m`` tokens, ``m`` being the number
of leading depths at which the drafter's argmax equals the row; the replay starts where decoding starts (the first
generated token comes from prefill) and jumps anchor to anchor exactly as the engine would, so ``accept_length``
(generated tokens / rounds) is the chain's acceptance length whenever the engine reproduces the row (same
numerics). ``anchor_mean_accept`` (1 + ``m`` averaged over *every* anchor) is reported for diagnosis only: it
over-weights easy stretches (a round that accepts 15 tokens is one round, but 15 anchors), which repetition loops
make very optimistic.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddtree.devices import resolve_device
from ddtree.errors import ConfigError
from ddtree.models import (
    DFlashDrafter,
    DrafterConfig,
    TargetModel,
    default_target_layer_ids,
    load_drafter,
    load_target,
    save_drafter,
)
from ddtree.train.data import Continuations, load_continuations
from ddtree.train.runtime import RunLog, StepPlan, finish_step, lr_at, seed_everything
from ddtree.train.tokenizer import MASK_TOKEN, load_raw_tokenizer


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Shape and training settings of a drafter run (hidden size, heads and vocab come from the target)."""

    num_layers: int = 3
    intermediate_size: int = 768
    block_size: int = 16
    num_target_inputs: int | None = None  # target layers feeding the drafter; None = num_layers (z-lab)
    rows_per_step: int = 32
    anchors_per_row: int = 256
    max_steps: int = 3000
    time_budget_s: float | None = None
    calibration_steps: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    loss_decay_gamma: float = 7.0
    eval_every: int = 200
    eval_rows: int = 16
    init: str = "random"  # "random" or "target": start from the target's last layers (see init_from_target)
    init_from: str | None = None  # a drafter directory to start from (fine-tuning); excludes init="target"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.init not in ("random", "target"):
            raise ConfigError(f"init must be 'random' or 'target', got {self.init!r}")
        if self.init_from is not None and self.init == "target":
            raise ConfigError("init_from (a drafter to fine-tune) and init='target' exclude each other; pick one")
        for name in ("num_layers", "intermediate_size", "rows_per_step", "anchors_per_row", "max_steps",
                     "warmup_steps", "eval_every", "eval_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_target_inputs is not None and self.num_target_inputs < 1:
            raise ConfigError(f"num_target_inputs must be >= 1 or None, got {self.num_target_inputs}")
        if not self.lr > 0 or not self.loss_decay_gamma > 0:
            raise ConfigError(f"lr ({self.lr}) and loss_decay_gamma ({self.loss_decay_gamma}) must be > 0")
        if self.calibration_steps < 2 or self.calibration_steps > self.warmup_steps:
            raise ConfigError(
                f"calibration_steps ({self.calibration_steps}) must be in [2, warmup_steps={self.warmup_steps}]"
            )

    def drafter_config(self, target: TargetModel, mask_token_id: int) -> DrafterConfig:
        """The z-lab config of a drafter for ``target``: its hidden size, heads, RoPE and vocabulary."""
        t = target.config
        inputs = self.num_target_inputs or self.num_layers
        return DrafterConfig(
            hidden_size=t.hidden_size,
            num_layers=self.num_layers,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=t.vocab_size,
            block_size=self.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=default_target_layer_ids(t.num_layers, inputs),
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta,
            rope_scaling=t.rope_scaling,
            max_position_embeddings=t.max_position_embeddings,
            layer_types=("full_attention",) * self.num_layers,
            num_target_layers=t.num_layers,
        )


DRAFTER_PRESETS: dict[str, DrafterTrainConfig] = {
    "demo": DrafterTrainConfig(),
    "smoke": DrafterTrainConfig(num_layers=2, intermediate_size=64, rows_per_step=4, anchors_per_row=8,
                                max_steps=40, warmup_steps=5, calibration_steps=2, lr=3e-3, eval_every=20,
                                eval_rows=4),
}


def preset(name: str, **overrides: Any) -> DrafterTrainConfig:
    """A named preset with some fields replaced (``None`` values are ignored)."""
    if name not in DRAFTER_PRESETS:
        raise ConfigError(f"unknown drafter preset {name!r}; choose one of {', '.join(DRAFTER_PRESETS)}")
    return replace(DRAFTER_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def sample_anchors(rows: int, prompt_len: int, seq_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct sorted anchors per row from ``prompt_len - 1 .. seq_len - 2``.  # -> [rows, count]

    The last prompt token is a valid anchor (its block's labels are all generated); ``seq_len - 1`` is not (no
    label after it). Fewer candidates than ``count`` is a configuration error."""
    candidates = seq_len - prompt_len
    if candidates < count:
        raise ConfigError(
            f"rows have {candidates} anchor positions but anchors_per_row is {count}; lower anchors_per_row or "
            "generate longer continuations"
        )
    keys = torch.rand(rows, candidates, generator=generator)
    picked = keys.argsort(dim=1)[:, :count]
    return (picked + prompt_len - 1).sort(dim=1).values


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity for depths 1 .. block_size - 1 of each block.

    input_ids [B, T]; anchors [B, A] -> labels [B, A, block_size - 1] (``input_ids[b, anchor + k]``, 0 where
    that is past the row end) and valid [B, A, block_size - 1] bool."""
    seq_len = input_ids.shape[1]
    index = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)  # [B, A, bs - 1]
    valid = index < seq_len
    labels = torch.gather(input_ids, 1, index.clamp(max=seq_len - 1).flatten(1)).view_as(index)
    return torch.where(valid, labels, torch.zeros_like(labels)), valid


def depth_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``exp(-(k - 1) / gamma)`` for depths k = 1 .. block_size - 1.  # -> [block_size - 1]"""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def drafter_loss(
    logits: torch.Tensor,  # [B, A, L, V] drafter logits for depths 1..L
    labels: torch.Tensor,  # [B, A, L]
    valid: torch.Tensor,  # [B, A, L] bool
    weights: torch.Tensor,  # [L] per-depth weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean cross-entropy and the per-depth top-1 accuracy [L] over valid positions."""
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    w = weights[None, None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels) & valid
        accuracy = correct.sum(dim=(0, 1)).float() / valid.sum(dim=(0, 1)).clamp_min(1)
    return loss, accuracy


def target_features(target: TargetModel, drafter: DFlashDrafter, input_ids: torch.Tensor) -> torch.Tensor:
    """The frozen target's context features for ``input_ids`` [B, T] -> [B, T, n * H]."""
    with torch.no_grad():
        return target.forward_train(input_ids, drafter.config.target_layer_ids, with_logits=False).hidden


def replay_chain(leading: list[int], prompt_len: int, seq_len: int) -> int:
    """Verify rounds the greedy DFlash chain needs to produce positions ``prompt_len .. seq_len - 1``.

    ``leading[i]`` is the drafter's matched depth count for the block anchored at ``prompt_len - 1 + i``. Prefill
    commits position ``prompt_len``; each round anchored at ``a`` commits ``1 + leading`` tokens (the bonus
    included), never past the row end."""
    anchor, rounds = prompt_len, 0
    while anchor < seq_len - 1:
        anchor += min(leading[anchor - (prompt_len - 1)] + 1, seq_len - 1 - anchor)
        rounds += 1
    return rounds


@torch.no_grad()
def block_acceptance(
    drafter: DFlashDrafter,
    target: TargetModel,
    data: Continuations,
    *,
    rows: int | None = None,
    anchors_per_pass: int = 64,
    device: torch.device,
) -> dict[str, Any]:
    """Replay the greedy DFlash chain over held-out continuations (see the module docstring).

    Returns ``accept_length`` (generated tokens / replayed rounds, summed over rows, like the engine's
    aggregate), its per-row mean, ``anchor_mean_accept``, ``depth_accuracy`` [L] over all fully labelled anchors
    and the counts."""
    bs = drafter.config.block_size
    ids_all = data.tokens if rows is None else data.tokens[:rows]
    if data.seq_len - data.prompt_len < bs:
        raise ConfigError(f"continuations of {data.seq_len - data.prompt_len} tokens are shorter than a block ({bs})")
    anchors_all = torch.arange(data.prompt_len - 1, data.seq_len - 1)  # every anchor with at least one label
    full = anchors_all <= data.seq_len - bs  # anchors whose depths are all labelled
    tokens_total, rounds_total, per_row = 0, 0, []
    leading_full_sum = 0.0
    depth_hits = torch.zeros(bs - 1, dtype=torch.float64)
    for row in ids_all:
        ids = row[None].to(device)
        feats = target_features(target, drafter, ids)
        leading: list[int] = []
        for chunk in anchors_all.split(anchors_per_pass):
            anchors = chunk[None].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = drafter.forward_train(target, ids, feats, anchors)
            labels, valid = block_labels(ids, anchors, bs)
            hits = (logits.argmax(dim=-1) == labels) | ~valid  # [1, A, L]; past the row end never stops a run
            lead = hits.int().cumprod(dim=-1).sum(dim=-1)[0].cpu()  # [A]
            keep = full[chunk - (data.prompt_len - 1)]
            leading_full_sum += float(lead[keep].sum())
            depth_hits += (hits[0].cpu() & valid[0].cpu())[keep].sum(dim=0).double()
            leading += lead.tolist()
        rounds = replay_chain(leading, data.prompt_len, data.seq_len)
        generated = data.seq_len - data.prompt_len
        tokens_total += generated
        rounds_total += rounds
        per_row.append(generated / rounds)
    count = int(full.sum()) * len(per_row)
    return {
        "accept_length": round(tokens_total / rounds_total, 4),
        "accept_length_per_row_mean": round(sum(per_row) / len(per_row), 4),
        "anchor_mean_accept": round(1.0 + leading_full_sum / count, 4),
        "depth_accuracy": [round(float(x), 4) for x in depth_hits / count],
        "anchors": count,
        "rows": len(per_row),
        "prompt_len": data.prompt_len,
        "new_tokens": data.seq_len - data.prompt_len,
    }


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target: TargetModel) -> None:
    """Start the drafter from the target's weights instead of random ones.

    Drafter layer ``i`` copies target layer ``L - n + i`` (the shapes are equal: the drafter takes the target's
    hidden size, heads and head_dim; the MLP width must match too), ``norm`` copies the target's final norm, and
    ``fc`` starts as the identity on the last target layer's features (zeros elsewhere) with ``hidden_norm``
    copying the input norm of the first copied layer: its context K/V are then exactly that target layer's K/V
    over the residual stream after layer ``target_layer_ids[-1]`` (the target's own K/V when that id is
    ``L - n - 1``). Why: a drafter that starts as "the top of the target" already maps
    embeddings and context to next-token logits, where a random one must learn it from the DFlash loss alone."""
    t, c = target.config, drafter.config
    if c.intermediate_size != t.intermediate_size or c.num_layers > t.num_layers:
        raise ConfigError(
            f"init 'target' needs the drafter's intermediate_size ({c.intermediate_size}) to equal the target's "
            f"({t.intermediate_size}) and at most {t.num_layers} layers (got {c.num_layers})"
        )
    first = t.num_layers - c.num_layers
    for i, layer in enumerate(drafter.layers):
        layer.load_state_dict(target.layers[first + i].state_dict())
    drafter.norm.load_state_dict(target.norm.state_dict())
    width = t.hidden_size
    drafter.fc.weight.zero_()
    column = (len(c.target_layer_ids) - 1) * width
    drafter.fc.weight[:, column:column + width] = torch.eye(width)
    drafter.hidden_norm.weight.copy_(target.layers[first].input_layernorm.weight)


@torch.no_grad()
def init_from_drafter(drafter: DFlashDrafter, source: str | Path) -> None:
    """Start from a trained drafter's weights (fine-tuning, e.g. on new context lengths).

    Why its own step rather than loading the source as the model: the run's shape comes from the training config,
    so a source of another shape (layers, MLP width, block size, target inputs) is refused here, naming the
    difference, instead of training something other than what the config says."""
    src = load_drafter(source, dtype=torch.float32, device="cpu")
    mine, theirs = drafter.config.to_hf_dict(), src.config.to_hf_dict()
    differ = sorted(k for k in set(mine) | set(theirs) if k != "torch_dtype" and mine.get(k) != theirs.get(k))
    if differ:
        raise ConfigError(
            f"the drafter in {str(source)!r} differs from this run's config in {', '.join(differ)}; "
            "train with matching settings or start from random"
        )
    drafter.load_state_dict(src.state_dict())


def _mask_token_id(target_dir: Path) -> int:
    tokenizer = load_raw_tokenizer(target_dir)
    mask = tokenizer.token_to_id(MASK_TOKEN)
    if mask is None:
        raise ConfigError(f"the tokenizer in {str(target_dir)!r} has no {MASK_TOKEN} token; train it with ddtree")
    return mask


def train_drafter(
    target_dir: str | Path,
    data_paths: Sequence[str | Path],
    out_dir: str | Path,
    config: DrafterTrainConfig,
    *,
    eval_paths: Sequence[str | Path] = (),
    device: str = "auto",
    log_path: str | Path | None = None,
) -> dict[str, Any]:
    """Train a drafter for the target in ``target_dir`` on continuation files; save it (bf16, z-lab format).

    ``eval_paths``: held-out greedy continuations; the block acceptance on the first is tracked during training
    (the best weights are kept) and on all of them at the end."""
    if not data_paths:
        raise ConfigError("no continuation files given; pass --data FILE (from `ddtree train data`)")
    dev = resolve_device(device)
    generator = seed_everything(config.seed)
    target_dir = Path(target_dir)
    target = load_target(target_dir, dtype=torch.float32, device=dev)
    target.requires_grad_(False)
    drafter = DFlashDrafter(config.drafter_config(target, _mask_token_id(target_dir))).to(dev)
    drafter.rotary.reset(dev)
    drafter.check_target(target)
    if config.init == "target":
        init_from_target(drafter, target)
    if config.init_from is not None:
        init_from_drafter(drafter, config.init_from)
    drafter.train()
    datasets = [load_continuations(p) for p in data_paths]
    evals = [load_continuations(p) for p in eval_paths]
    log = RunLog(Path(log_path) if log_path else None, "drafter", {
        "config": asdict(config), "target": str(target_dir), "data": [str(p) for p in data_paths],
        "eval": [str(p) for p in eval_paths], "drafter_config": drafter.config.to_hf_dict(),
    })
    generated = torch.tensor([float(d.tokens.shape[0] * (d.seq_len - d.prompt_len)) for d in datasets])
    log.results["parameters"] = sum(p.numel() for p in drafter.parameters())
    log.results["generated_tokens"] = int(generated.sum())

    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2), fused=dev.type == "cuda",
    )
    weights = depth_weights(config.block_size, config.loss_decay_gamma, dev)
    plan = StepPlan(config.max_steps, config.time_budget_s, config.calibration_steps, overhead=1.1)
    best: tuple[float, int, dict | None] = (-math.inf, -1, None)
    train_start = time.perf_counter()
    step = 0
    while step < plan.total:
        t0 = time.perf_counter()
        lr = lr_at(step, peak=config.lr, warmup=config.warmup_steps, total=plan.total,
                   final_fraction=config.final_lr_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Files are drawn in proportion to their generated tokens, rows uniformly within the file.
        data = datasets[int(torch.multinomial(generated, 1, generator=generator))]
        pick = torch.randint(0, data.tokens.shape[0], (config.rows_per_step,), generator=generator)
        ids = data.tokens[pick].to(dev, non_blocking=True)
        anchors = sample_anchors(config.rows_per_step, data.prompt_len, data.seq_len, config.anchors_per_row,
                                 generator).to(dev)
        feats = target_features(target, drafter, ids)
        labels, valid = block_labels(ids, anchors, config.block_size)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = drafter.forward_train(target, ids, feats, anchors)
        loss, accuracy = drafter_loss(logits, labels, valid, weights)
        step += 1
        grad_norm = finish_step(drafter.parameters(), optimizer, loss, grad_clip=config.grad_clip, plan=plan, log=log,
                                step=step, step_start=t0, train_start=train_start, device=dev)
        if step % config.eval_every == 0 or step == plan.total:
            record: dict[str, Any] = dict(
                step=step, blocks_seen=step * config.rows_per_step * config.anchors_per_row,
                loss=round(float(loss.detach()), 4), acc_depth1=round(float(accuracy[0]), 4),
                acc_last=round(float(accuracy[-1]), 4), lr=lr, grad_norm=round(float(grad_norm), 3),
            )
            if evals:
                drafter.eval()
                tau = block_acceptance(drafter, target, evals[0], rows=config.eval_rows, device=dev)["accept_length"]
                drafter.train()
                record["held_out_accept_length"] = tau
                if tau > best[0]:
                    best = (tau, step, copy.deepcopy(drafter.state_dict()))
            log.record(**record)
            log.write()
            print(" ".join(f"{k} {v}" for k, v in record.items() if k != "lr") + f" {log.elapsed():.0f}s", flush=True)
    train_s = time.perf_counter() - train_start
    if best[2] is not None:
        drafter.load_state_dict(best[2])
    drafter.eval()
    log.results.update(steps=step, blocks_seen=step * config.rows_per_step * config.anchors_per_row,
                       train_s=round(train_s, 1), best_step=best[1])
    log.results["eval"] = {
        str(path): block_acceptance(drafter, target, data, device=dev) for path, data in zip(eval_paths, evals, strict=True)
    }
    save_drafter(drafter, out_dir, dtype=torch.bfloat16)
    log.results["saved_to"] = str(out_dir)
    log.write()
    return log.to_dict()
