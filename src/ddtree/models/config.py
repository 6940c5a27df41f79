"""Frozen model configs, read from and written to Hugging Face / z-lab ``config.json`` dictionaries.

``TargetConfig`` covers the three dense target families we run (Qwen3, Qwen2, Llama); ``DrafterConfig`` covers a
z-lab DFlash drafter. Both are validated once when built (``ConfigError``); ``from_hf_dict`` turns a foreign
dictionary into one and raises ``CheckpointError`` naming the field when the dictionary describes something we
cannot run faithfully (an unknown architecture, an activation other than SiLU, an unsupported RoPE scaling), so a
model is never silently run with the wrong maths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddtree.errors import CheckpointError, ConfigError

FAMILIES: dict[str, str] = {  # HF ``architectures`` entry -> our family name
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPES = {"qwen3", "qwen2", "llama"}
DRAFTER_ARCHITECTURES: tuple[str, ...] = ("DFlashDraftModel",)
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_draft_inputs: int) -> tuple[int, ...]:
    """The z-lab default choice of target layers feeding a drafter: evenly spaced over ``1 .. L - 3``.

    A single input takes the middle layer. Matches the upstream rule ``round(1 + i * (L - 4) / (n - 1))``
    (Python's round), so drafters trained without explicit ids keep reading the same layers."""
    if num_draft_inputs < 1:
        raise ConfigError(f"num_draft_inputs must be >= 1, got {num_draft_inputs}")
    if num_draft_inputs == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_inputs - 1))) for i in range(num_draft_inputs))


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


# the sizes both model configs hold, each a positive integer (_check_shape)
_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
          "max_position_embeddings")


def _check_shape(config: Any) -> None:
    """A model config's sizes: each of :data:`_SIZES` a positive integer, whole query heads per KV head, an even
    head dim (RoPE rotates pairs). Shared by the target's and the drafter's configs."""
    for name in _SIZES:
        _positive(name, getattr(config, name))
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(
            f"num_heads ({config.num_heads}) must be a multiple of num_kv_heads ({config.num_kv_heads})"
        )
    if config.head_dim % 2:
        raise ConfigError(f"head_dim must be even for RoPE, got {config.head_dim}")


def _check_rope(theta: float, scaling: dict[str, Any] | None) -> None:
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES or kind == "default":
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES[1:])} (or none)"
        )
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")}[kind]
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ConfigError(f"rope_scaling of type {kind!r} lacks {missing}; got {scaling}")


def _rope_from_hf(d: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """Read RoPE from either the classic (``rope_theta`` + ``rope_scaling``) or the transformers-5
    (``rope_parameters``) spelling; returns (theta, scaling-or-None) with ``rope_type`` always set."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; all our layers share one RoPE
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        kind = scaling.pop("type", None)
        scaling.setdefault("rope_type", kind or "default")
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(
                f"{where}: partial_rotary_factor={scaling['partial_rotary_factor']} is not supported (only 1.0)"
            )
        scaling.pop("partial_rotary_factor", None)
        if scaling["rope_type"] == "default":
            scaling = None
        elif scaling["rope_type"] not in ROPE_TYPES:
            raise CheckpointError(
                f"{where}: rope_scaling type {scaling['rope_type']!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES[1:])} (or none)"
            )
    else:
        scaling = None
    return float(theta), scaling


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise CheckpointError(f"{where}: field {key!r} is missing")
    return d[key]


@dataclass(frozen=True)
class TargetConfig:
    """A dense decoder-only target. ``qk_norm`` is Qwen3's per-head RMSNorm on Q and K; ``attention_bias`` is
    the bias on the Q/K/V projections (and on O too for Llama/Qwen3; Qwen2 has none on O)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.family not in _MODEL_TYPES:
            raise ConfigError(f"family must be one of {sorted(_MODEL_TYPES)}, got {self.family!r}")
        _check_shape(self)
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _check_rope(self.rope_theta, self.rope_scaling)

    @property
    def o_bias(self) -> bool:
        """Whether ``o_proj`` has a bias (Qwen2 never has one; Llama/Qwen3 follow ``attention_bias``)."""
        return self.attention_bias and self.family != "qwen2"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else (self.eos_token_id,)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> TargetConfig:
        """Build from a Hugging Face ``config.json`` dictionary; unknown architectures or features raise
        ``CheckpointError`` naming the field and the value found."""
        where = "config.json"
        archs = d.get("architectures") or []
        family = None
        for arch in archs:
            family = FAMILIES.get(arch)
            if family:
                break
        if family is None:
            if archs:
                raise CheckpointError(
                    f"{where}: architectures {archs} is not a supported target; supported: {', '.join(FAMILIES)}"
                )
            if d.get("model_type") not in _MODEL_TYPES:
                raise CheckpointError(
                    f"{where}: model_type {d.get('model_type')!r} is not a supported target "
                    f"(no 'architectures' either); supported: {', '.join(FAMILIES)}"
                )
            family = d["model_type"]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise CheckpointError(f"{where}: mlp_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise CheckpointError(
                f"{where}: use_sliding_window=true (sliding-window attention in the target) is not supported"
            )
        num_heads = _require(d, "num_attention_heads", where)
        hidden = _require(d, "hidden_size", where)
        theta, scaling = _rope_from_hf(d, where)
        try:
            return cls(
                family=family,
                vocab_size=_require(d, "vocab_size", where),
                hidden_size=hidden,
                num_layers=_require(d, "num_hidden_layers", where),
                num_heads=num_heads,
                num_kv_heads=d.get("num_key_value_heads") or num_heads,
                head_dim=d.get("head_dim") or hidden // num_heads,
                intermediate_size=_require(d, "intermediate_size", where),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=d.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
            )
        except ConfigError as exc:
            raise CheckpointError(f"{where}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dictionary (classic RoPE spelling, read by transformers 4 and 5)."""
        arch = {v: k for k, v in FAMILIES.items()}[self.family]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            **_layer_stack_hf_fields(self),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        return d


def _layer_stack_hf_fields(config: TargetConfig | DrafterConfig) -> dict[str, Any]:
    """The ``config.json`` fields a target and a drafter share: vocabulary, the decoder-layer shapes and RoPE."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
    }


@dataclass(frozen=True)
class DrafterConfig:
    """A z-lab DFlash drafter: Qwen3-style layers without embedding or LM head (the target's are used).

    ``trained_block_size`` is the block size written in the checkpoint; ``block_size`` is the one used by
    default (it differs only after an override). ``target_hidden_size`` is the target's hidden size (the ``fc``
    input is ``len(target_layer_ids) * target_hidden_size``); ``None`` means equal to ``hidden_size`` as in every
    z-lab checkpoint. ``is_causal`` is z-lab's override: ``None`` makes sliding layers causal inside the block and
    full layers non-causal; ``True``/``False`` forces every layer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    is_causal: bool | None = None
    trained_block_size: int | None = None

    def __post_init__(self) -> None:
        _check_shape(self)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id!r} must be in [0, vocab_size={self.vocab_size}); "
                "the drafter's mask token must be a row of the target's embedding"
            )
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(f"target_layer_ids must be non-empty and >= 0, got {self.target_layer_ids}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ConfigError(
                f"target_layer_ids {self.target_layer_ids} reach past num_target_layers={self.num_target_layers}"
            )
        types = tuple(self.layer_types) or ("full_attention",) * self.num_layers
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(
                f"layer_types must list {self.num_layers} entries from {LAYER_TYPES}, got {list(types)}"
            )
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ConfigError(f"final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping}")
        if self.target_hidden_size is not None:
            _positive("target_hidden_size", self.target_hidden_size)
        if self.trained_block_size is None:
            object.__setattr__(self, "trained_block_size", self.block_size)
        _check_rope(self.rope_theta, self.rope_scaling)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features the drafter reads: n_target_layers * target hidden."""
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    def layer_is_causal(self, layer: int) -> bool:
        """Whether drafter layer ``layer`` is causal inside the block (z-lab: sliding layers are)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None = full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def with_block_size(self, block_size: int) -> DrafterConfig:
        return dataclasses.replace(self, block_size=block_size)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Build from a z-lab ``config.json`` (``block_size`` read from ``dflash_config`` first, then the top
        level); raises ``CheckpointError`` naming the field at fault."""
        where = "drafter config.json"
        archs = d.get("architectures") or []
        if archs and not any(a in DRAFTER_ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"{where}: architectures {archs} is not a supported drafter; supported: "
                f"{', '.join(DRAFTER_ARCHITECTURES)}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        dflash = d.get("dflash_config") or {}

        def pick(key: str, default: Any = None) -> Any:
            value = dflash.get(key)
            return d.get(key, default) if value is None else value

        num_layers = _require(d, "num_hidden_layers", where)
        num_heads = _require(d, "num_attention_heads", where)
        hidden = _require(d, "hidden_size", where)
        mask_id = pick("mask_token_id")
        if mask_id is None:
            raise CheckpointError(f"{where}: dflash_config.mask_token_id is missing")
        layer_ids = pick("target_layer_ids")
        num_target_layers = d.get("num_target_layers")
        if layer_ids is None:
            if num_target_layers is None:
                raise CheckpointError(
                    f"{where}: dflash_config.target_layer_ids is missing (and no num_target_layers to derive it)"
                )
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        sliding = d.get("sliding_window")
        if d.get("use_sliding_window") is False:
            sliding = None  # transformers' Qwen3Config drops the window when use_sliding_window is false
        theta, scaling = _rope_from_hf(d, where)
        softcap = pick("final_logit_softcapping")
        block = pick("block_size", 16)
        try:
            return cls(
                hidden_size=hidden,
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=d.get("num_key_value_heads") or num_heads,
                head_dim=d.get("head_dim") or hidden // num_heads,
                intermediate_size=_require(d, "intermediate_size", where),
                vocab_size=_require(d, "vocab_size", where),
                block_size=block,
                mask_token_id=mask_id,
                target_layer_ids=tuple(layer_ids),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=d.get("max_position_embeddings", 40960),
                layer_types=tuple(d.get("layer_types") or ()),
                sliding_window=sliding,
                input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
                output_multiplier=float(pick("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
                attention_bias=bool(d.get("attention_bias", False)),
                target_hidden_size=pick("target_hidden_size"),
                num_target_layers=num_target_layers,
                is_causal=d.get("is_causal"),
                trained_block_size=block,
            )
        except ConfigError as exc:
            raise CheckpointError(f"{where}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The z-lab ``config.json``: Qwen3-style fields plus ``dflash_config``; the trained block size is written
        both inside ``dflash_config`` and at the top level so older readers find it too."""
        dflash: dict[str, Any] = {
            "block_size": self.trained_block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.target_hidden_size is not None and self.target_hidden_size != self.hidden_size:
            dflash["target_hidden_size"] = self.target_hidden_size
        d: dict[str, Any] = {
            "architectures": list(DRAFTER_ARCHITECTURES),
            "model_type": "qwen3",
            **_layer_stack_hf_fields(self),
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "block_size": self.trained_block_size,
            "dflash_config": dflash,
            "tie_word_embeddings": False,
        }
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        return d
