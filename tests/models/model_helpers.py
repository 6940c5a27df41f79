"""Tiny random models and helpers shared by the models tests (fp32, CPU)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ddtree.models import DFlashDrafter, DrafterConfig, TargetConfig, TargetModel

VOCAB = 97
HIDDEN = 32


def _hf_config(family: str, tied: bool):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(head_dim=8, rope_theta=10000.0, **common)
    if family == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(rope_theta=10000.0, **common)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    return LlamaForCausalLM, LlamaConfig(head_dim=8, rope_parameters=scaling, **common)


def perturb_(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter random values (norm weights around 1) so no weight hides behind its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * (0.1 if "norm" in name else 0.2)
            p.copy_((1.0 if "norm" in name else 0.0) + noise)


def hf_target(family: str, tied: bool, seed: int = 0):
    """A random transformers model of ``family`` in eval mode."""
    cls, config = _hf_config(family, tied)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    perturb_(model, seed)
    return model


def tiny_target_config(**overrides) -> TargetConfig:
    fields = dict(family="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False, qk_norm=True)
    fields.update(overrides)
    return TargetConfig(**fields)


def tiny_drafter_config(**overrides) -> DrafterConfig:
    fields = dict(hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=40,
                  vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                  rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256)
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_target(seed: int = 0, **overrides) -> TargetModel:
    torch.manual_seed(seed)
    model = TargetModel(tiny_target_config(**overrides)).eval()
    perturb_(model, seed)
    return model


def random_drafter(seed: int = 1, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_drafter_config(**overrides)).eval()
    perturb_(model, seed)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
