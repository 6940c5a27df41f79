"""``ddtree train target``: a small Qwen3 code model trained on the corpus, saved in Hugging Face format.

Why transformers' ``Qwen3ForCausalLM`` rather than our own ``TargetModel.forward_train``: it is the reference
implementation every loader (ours included) is tested against, so a checkpoint it writes is Hugging Face format by
construction, and training it needs nothing from the rest of ddtree. Our loader reading this checkpoint is then a
real interoperability test, not a round trip through our own code.

The demo shapes are fixed (the GPU benchmark's Qwen3-8B stand-in embeds this model in Qwen3-8B's shapes): hidden
256, 2 query heads and 1 KV head of head_dim 128, 8 layers, intermediate 768, vocab 8192, tied embeddings,
max_position_embeddings 16384. Training: bf16 autocast on CUDA (fp32 master weights), AdamW, warm-up + cosine,
packed 8192-token windows; the held-out loss is measured every ``eval_every`` steps and the best weights are kept
(the corpus is small, ~10 M tokens, so a run of many epochs may start to overfit).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ddtree.devices import resolve_device
from ddtree.errors import ConfigError
from ddtree.train.corpus import Corpus
from ddtree.train.data import encode_documents, fixed_windows, sample_windows
from ddtree.train.runtime import RunLog, StepPlan, finish_step, lr_at, seed_everything
from ddtree.train.tokenizer import EOS_TOKEN, load_raw_tokenizer

# Safetensors shards stay below the 15 MB per-file limit of the shipped package.
MAX_SHARD_SIZE = "14MB"


@dataclass(frozen=True)
class TargetShape:
    """Architecture of the target (Qwen3)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 128
    intermediate_size: int = 768
    max_position_embeddings: int = 16384
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"target {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def hf_config(self, *, eos_token_id: int):
        """The transformers ``Qwen3Config`` of this shape (tied embeddings, no BOS)."""
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=True,
            attention_bias=False,
            bos_token_id=None,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )


@dataclass(frozen=True)
class TargetTrainConfig:
    """Everything that determines a target training run (with the corpus and the tokenizer)."""

    shape: TargetShape = field(default_factory=TargetShape)
    seq_len: int = 8192
    batch_size: int = 8
    max_steps: int = 2000
    max_epochs: float | None = 12.0  # caps the steps at this many passes over the train tokens
    time_budget_s: float | None = None  # calibrate the step count from the first steps to fit this
    calibration_steps: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    eval_batch_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "max_steps", "warmup_steps", "eval_every", "eval_windows",
                     "eval_batch_size", "calibration_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len > self.shape.max_position_embeddings:
            raise ConfigError(
                f"seq_len {self.seq_len} exceeds max_position_embeddings {self.shape.max_position_embeddings}"
            )
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.max_epochs is not None and self.max_epochs <= 0:
            raise ConfigError(f"max_epochs must be > 0 or None, got {self.max_epochs}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"time_budget_s must be > 0 or None, got {self.time_budget_s}")
        if self.calibration_steps < 2 or self.calibration_steps > self.warmup_steps:
            raise ConfigError(
                f"calibration_steps ({self.calibration_steps}) must be in [2, warmup_steps={self.warmup_steps}] "
                "so the step count is fixed before the cosine decay starts"
            )


TARGET_PRESETS: dict[str, TargetTrainConfig] = {
    # The shipped demo target (the real run on the H200).
    "demo": TargetTrainConfig(),
    # Seconds on a CPU: the same code path at toy shapes (CI and the pipeline's dry run).
    "smoke": TargetTrainConfig(
        shape=TargetShape(vocab_size=320, hidden_size=32, num_layers=6, num_heads=2, num_kv_heads=1,
                          head_dim=16, intermediate_size=64, max_position_embeddings=512),
        seq_len=128, batch_size=4, max_steps=30, max_epochs=None, warmup_steps=5, lr=3e-3,
        eval_every=10, eval_windows=4, eval_batch_size=4, calibration_steps=2,
    ),
}


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, windows: torch.Tensor, *, batch_size: int, device: torch.device) -> float:
    """Mean next-token cross-entropy (nats) over all predicted positions of ``windows``.  # windows [W, T]"""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        ids = chunk.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(nll)
        count += ids[:, 1:].numel()
    model.train(was_training)
    return total / count


def train_target(
    corpus: Corpus,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    config: TargetTrainConfig,
    *,
    device: str = "auto",
    log_path: str | Path | None = None,
    perplexity_lengths: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Train the target and save it (bf16, sharded, with the tokenizer) into ``out_dir``; returns the results.

    ``perplexity_lengths``: extra held-out context lengths at which the final perplexity is reported."""
    from transformers import Qwen3ForCausalLM

    dev = resolve_device(device)
    tokenizer = load_raw_tokenizer(tokenizer_dir)
    if tokenizer.get_vocab_size() != config.shape.vocab_size:
        raise ConfigError(
            f"tokenizer in {str(tokenizer_dir)!r} has {tokenizer.get_vocab_size()} tokens but the target shape "
            f"expects vocab_size {config.shape.vocab_size}; retrain the tokenizer with --vocab-size "
            f"{config.shape.vocab_size} or pick the matching preset"
        )
    generator = seed_everything(config.seed)
    log = RunLog(Path(log_path) if log_path else None, "target", {"config": asdict(config), "corpus": corpus.describe()})

    train_stream = encode_documents(tokenizer, [f.text for f in corpus.train])
    held_stream = encode_documents(tokenizer, [f.text for f in corpus.held_out])
    eval_windows = fixed_windows(held_stream, config.seq_len, config.eval_windows)
    log.results["train_tokens"] = train_stream.numel()
    log.results["held_out_tokens"] = held_stream.numel()
    log.results["tokenize_s"] = round(log.elapsed(), 3)

    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = Qwen3ForCausalLM(config.shape.hf_config(eos_token_id=eos_id)).to(dev)
    model.train()
    log.results["parameters"] = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2), fused=dev.type == "cuda",
    )

    tokens_per_step = config.batch_size * config.seq_len
    max_steps = config.max_steps
    if config.max_epochs is not None:
        max_steps = min(max_steps, max(1, math.ceil(config.max_epochs * train_stream.numel() / tokens_per_step)))
    plan = StepPlan(max_steps, config.time_budget_s, config.calibration_steps)
    best_loss, best_step, best_state = math.inf, -1, None
    train_start = time.perf_counter()
    step = 0
    while step < plan.total:
        t0 = time.perf_counter()
        lr = lr_at(step, peak=config.lr, warmup=config.warmup_steps, total=plan.total,
                   final_fraction=config.final_lr_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_windows(train_stream, config.batch_size, config.seq_len, generator).to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        step += 1
        grad_norm = finish_step(model.parameters(), optimizer, loss, grad_clip=config.grad_clip, plan=plan, log=log,
                                step=step, step_start=t0, train_start=train_start, device=dev)
        if step % config.eval_every == 0 or step == plan.total:
            val = held_out_loss(model, eval_windows, batch_size=config.eval_batch_size, device=dev)
            if val < best_loss:
                best_loss, best_step = val, step
                best_state = copy.deepcopy(model.state_dict())
            log.record(step=step, tokens_seen=step * tokens_per_step, train_loss=round(float(loss.detach()), 4),
                       held_out_loss=round(val, 4), lr=lr, grad_norm=round(float(grad_norm), 3))
            log.write()
            print(f"step {step}/{plan.total} loss {float(loss.detach()):.4f} held-out {val:.4f} "
                  f"lr {lr:.2e} {log.elapsed():.0f}s", flush=True)
    train_s = time.perf_counter() - train_start
    assert best_state is not None  # the last step always evaluates
    model.load_state_dict(best_state)

    results = {
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "epochs": round(step * tokens_per_step / train_stream.numel(), 3),
        "train_s": round(train_s, 1),
        "best_step": best_step,
        "held_out_loss": round(best_loss, 4),
        "held_out_perplexity": round(math.exp(best_loss), 3),
    }
    for length in perplexity_lengths:
        windows = fixed_windows(held_stream, length, max(1, config.eval_windows * config.seq_len // length))
        val = held_out_loss(model, windows, batch_size=max(1, config.eval_batch_size * config.seq_len // length),
                            device=dev)
        results[f"held_out_perplexity_at_{length}"] = round(math.exp(val), 3)
    log.results.update(results)
    save_target_checkpoint(model, out_dir, tokenizer_dir=tokenizer_dir)
    log.results["saved_to"] = str(out_dir)
    log.write()
    return log.to_dict()


def save_target_checkpoint(model: torch.nn.Module, out_dir: str | Path, *, tokenizer_dir: str | Path) -> None:
    """Save bf16 sharded safetensors + config + generation config + tokenizer, readable by transformers 4.x/5.x.

    transformers 5 writes ``rope_parameters``; older readers (and ours) also look for the top-level
    ``rope_theta``/``rope_scaling``/``torch_dtype``, so both spellings are written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    bf16 = copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16)
    bf16.save_pretrained(str(out), max_shard_size=MAX_SHARD_SIZE, safe_serialization=True)
    config_path = out / "config.json"
    hf = json.loads(config_path.read_text())
    rope = hf.get("rope_parameters") or {}
    hf.setdefault("rope_theta", rope.get("rope_theta", model.config.to_dict().get("rope_theta")))
    hf.setdefault("rope_scaling", None)
    hf["torch_dtype"] = "bfloat16"
    hf["dtype"] = "bfloat16"
    hf["use_cache"] = True
    config_path.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    eos = hf["eos_token_id"]
    generation = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)


def preset(name: str, **overrides: Any) -> TargetTrainConfig:
    """A named preset with some fields replaced (``None`` values are ignored)."""
    if name not in TARGET_PRESETS:
        raise ConfigError(f"unknown target preset {name!r}; choose one of {', '.join(TARGET_PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(TARGET_PRESETS[name], **given)
