"""Cost-faithful stand-ins: a big-bodied target/drafter pair that computes exactly a small pair's functions.

We cannot download Qwen3-8B here, but a speed benchmark needs its *cost*: the same GEMM shapes, KV-cache bytes,
layer count and attention heads. :func:`build_standin` embeds a small trained pair (the demo: hidden 256, 8 layers)
into a body of any larger :class:`StandinShape` so that the big pair's logits, draft logits, greedy outputs and
acceptance are the small pair's, and every FLOP and byte is the big one's.

How the small function survives the padding (``h`` / ``H`` small / big hidden, ``c = sqrt(H / h)``):

hidden dims
    The residual stream carries the small model's state in dims ``0 .. h-1`` and exact zeros in ``h .. H-1``:
    everything that *writes* the stream (embedding columns, ``o_proj`` and ``down_proj`` rows, the drafter's
    ``fc`` rows) is zero past ``h``. Everything that *reads* it sees zeros there, so those input columns hold
    random values (they cannot reach the output).
RMSNorm
    Zero padding divides the mean square by ``c**2`` (the RMS is ``c`` times smaller, the normalized vector ``c``
    times larger): the norm weights are scaled by ``1 / c`` and ``eps`` by ``1 / c**2`` (one ``rms_norm_eps`` per
    config). For 256 -> 4096, ``c = 4`` and the
    eps is divided by 16, both exact in binary floating point. Qwen3's per-head ``q_norm``/``k_norm`` (head_dim
    unchanged) share that config eps, so the real heads' Q/K projection rows are scaled by ``1 / c`` too, which
    makes ``q_norm(q / c)`` with ``eps / c**2`` equal ``q_norm(q)`` with ``eps``.
heads
    Small q head ``i`` of KV group ``j`` goes to a big q head of a big KV head that carries small KV head ``j``,
    so GQA grouping is preserved; when a small group is wider than a big one, small KV head ``j`` is replicated
    into ``ceil(g / G)`` big KV heads. Other heads get random Q/K/V and zero ``o_proj`` columns.
MLP channels
    The small channels are the first ``intermediate`` ones; extra channels get random gate/up rows and zero
    ``down_proj`` columns.
layers
    Extra layers are identities on the residual stream (``o_proj`` and ``down_proj`` zero, the rest random); they
    still compute attention and an MLP and fill their KV cache, so they cost what a real layer costs.
drafter features
    The big drafter reads the default z-lab layer ids of the big target (``[1, 9, 17, 25, 33]`` for 36 layers and
    5 inputs). The small layers the small drafter reads land exactly on those ids (see :func:`plan_standin`);
    ``fc`` input blocks the small drafter has no counterpart for are zero. A small drafter that reads the small
    target's *last* layer (whose feature is final-normed) gets the big target's last layer in that slot.

Numerics: in fp32 the pair matches to rounding (~1e-6 relative; the test asserts 1e-5 and identical greedy
outputs and acceptance). In bf16 on a GPU it is not bit-identical: reductions over ``H`` instead of ``h`` (RMS
means, GEMM accumulations split differently) round differently, so a logit near-tie can flip a greedy token;
benchmarks report that divergence rate rather than assume it is zero. Activations are zero in ``h .. H-1``, so
FLOPs and bytes are the big model's but GPU power draw (and so clocks under a power cap) may differ slightly.

Stand-ins are built on the device in the target dtype in seconds (no fp32 CPU copy of the big weights) and are
never shipped: ``ddtree standin`` writes them where the benchmark wants them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ddtree.errors import ConfigError
from ddtree.models.config import DrafterConfig, TargetConfig, default_target_layer_ids
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.target import TargetModel


@dataclass(frozen=True)
class StandinShape:
    """The big body: target dims, and the drafter's (its hidden equals the target's, as z-lab drafters' do).

    ``draft_num_inputs`` is how many target layers the drafter reads (``fc`` takes ``inputs * hidden``)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_num_layers: int
    draft_num_heads: int
    draft_num_kv_heads: int
    draft_intermediate_size: int
    draft_num_inputs: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"stand-in shape {self.name!r}: {f.name} must be a positive integer, got {value!r}")
        for heads, kv, what in ((self.num_heads, self.num_kv_heads, "target"),
                                (self.draft_num_heads, self.draft_num_kv_heads, "drafter")):
            if heads % kv:
                raise ConfigError(
                    f"stand-in shape {self.name!r}: {what} num_heads ({heads}) must be a multiple of "
                    f"num_kv_heads ({kv})"
                )


SHAPES: dict[str, StandinShape] = {
    # Qwen/Qwen3-8B's body; drafter = z-lab/Qwen3-8B-DFlash-b16's config.json (5 full-attention layers,
    # hidden 4096, 32 / 8 heads of 128, intermediate 12288, target_layer_ids [1, 9, 17, 25, 33]).
    "qwen3-8b": StandinShape(
        name="qwen3-8b", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=12288, draft_num_layers=5, draft_num_heads=32, draft_num_kv_heads=8,
        draft_intermediate_size=12288, draft_num_inputs=5,
    ),
    # A Qwen3-0.6B-sized body for quick GPU runs of the same code paths (hidden 4x the demo's: exact scaling).
    "small": StandinShape(
        name="small", hidden_size=1024, num_layers=12, num_heads=8, num_kv_heads=4, head_dim=128,
        intermediate_size=3072, draft_num_layers=4, draft_num_heads=8, draft_num_kv_heads=4,
        draft_intermediate_size=3072, draft_num_inputs=5,
    ),
}


def standin_shape(name: str) -> StandinShape:
    """The preset called ``name`` (ConfigError listing the presets otherwise)."""
    if name not in SHAPES:
        raise ConfigError(f"unknown stand-in shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


@dataclass(frozen=True)
class StandinPlan:
    """Where each small piece lands in the big body.

    target_layers[k]: big layer index of small target layer k; feature_ids: the big drafter's
    ``target_layer_ids``; feature_slots[j]: the big ``fc`` input block that small drafter input j feeds;
    drafter_layers[k]: big drafter layer of small drafter layer k."""

    target_layers: tuple[int, ...]
    feature_ids: tuple[int, ...]
    feature_slots: tuple[int, ...]
    drafter_layers: tuple[int, ...]


def _spread(small: int, big: int) -> tuple[int, ...]:
    """``small`` indices spread evenly over ``0 .. big - 1`` (first on 0, last on big - 1), strictly increasing."""
    if small == 1:
        return (0,)
    return tuple((2 * k * (big - 1) + (small - 1)) // (2 * (small - 1)) for k in range(small))


def plan_standin(target: TargetConfig, drafter: DrafterConfig, shape: StandinShape) -> StandinPlan:
    """Place the small pair's layers in the big body so the big drafter reads the same features.

    The big drafter reads ``default_target_layer_ids(shape.num_layers, shape.draft_num_inputs)`` (z-lab's rule).
    The distinct small feature layers, in order, take evenly spread slots of those ids (first and last slots
    included); if the small drafter reads the small target's last layer, that slot's id becomes the big target's
    last layer (both features are final-normed). Each small feature layer sits exactly on its big id; every other
    small layer directly follows the small layer before it (small layer 0, when not a feature layer, sits on big
    layer 0). Example, demo 8 layers with features (1, 5) -> qwen3-8b: slots 0 and 4, ids (1, 9, 17, 25, 33),
    small layers at big (0, 1, 2, 3, 4, 33, 34, 35), fc blocks 1..3 zero. Drafter layers are spread evenly."""
    small_layers, big_layers = target.num_layers, shape.num_layers
    feats = sorted(set(drafter.target_layer_ids))
    n_in = shape.draft_num_inputs
    if len(feats) > n_in:
        raise ConfigError(
            f"the small drafter reads {len(feats)} distinct target layers {tuple(feats)}; stand-in shape "
            f"{shape.name!r} has draft_num_inputs={n_in}; use a shape with at least {len(feats)} drafter inputs"
        )
    if big_layers < small_layers:
        raise ConfigError(
            f"stand-in shape {shape.name!r} has {big_layers} target layers, fewer than the small target's "
            f"{small_layers}"
        )
    if shape.draft_num_layers < drafter.num_layers:
        raise ConfigError(
            f"stand-in shape {shape.name!r} has {shape.draft_num_layers} drafter layers, fewer than the small "
            f"drafter's {drafter.num_layers}"
        )
    ids = list(default_target_layer_ids(big_layers, n_in))
    if len(feats) == 1:
        slots = (n_in - 1,) if feats[0] == small_layers - 1 else (n_in // 2,)
    else:
        slots = _spread(len(feats), n_in)
    big_of = {}
    for u, slot in zip(feats, slots, strict=True):
        if u == small_layers - 1:
            ids[slot] = big_layers - 1
        big_of[u] = ids[slot]
    place: list[int] = []
    for k in range(small_layers):
        place.append(big_of[k] if k in big_of else (place[-1] + 1 if place else 0))
    plan = StandinPlan(
        target_layers=tuple(place),
        feature_ids=tuple(ids),
        feature_slots=tuple(slots[feats.index(u)] for u in drafter.target_layer_ids),
        drafter_layers=_spread(drafter.num_layers, shape.draft_num_layers),
    )
    _check_plan(plan, drafter.target_layer_ids, small_layers, big_layers, shape.name)
    return plan


def _check_plan(plan: StandinPlan, small_features: tuple[int, ...], small_layers: int, big_layers: int,
                shape_name: str) -> None:
    """Every small layer fits, in order, and each big feature the drafter uses carries its small feature: the
    state after big layer ``b`` is the one after the last small layer placed at or before ``b``, and only the
    last layer's feature is final-normed, in both models."""
    place = plan.target_layers
    hint = "use a shape with more target layers"
    if any(b <= a for a, b in zip(place, place[1:], strict=False)) or place[0] < 0 or place[-1] > big_layers - 1:
        raise ConfigError(
            f"stand-in shape {shape_name!r}: the small target's {small_layers} layers do not fit in order in "
            f"{big_layers} layers with its drafter features on the big drafter's ids (placement {place}); {hint}"
        )
    for u, slot in zip(small_features, plan.feature_slots, strict=True):
        big = plan.feature_ids[slot]
        carried = max((k for k, b in enumerate(place) if b <= big), default=-1)
        if carried != u or (big == big_layers - 1) != (u == small_layers - 1):
            raise ConfigError(
                f"stand-in shape {shape_name!r}: big layer {big} would carry small layer {carried}'s output, not "
                f"small feature layer {u}'s (placement {place}); {hint}"
            )


def _head_placement(heads: int, kv: int, big_heads: int, big_kv: int, what: str) -> tuple[Tensor, int]:
    """Big q head of each small q head [heads], and how many big KV heads replicate each small KV head."""
    group, big_group = heads // kv, big_heads // big_kv
    reps = -(-group // big_group)
    if kv * reps > big_kv:
        raise ConfigError(
            f"the small {what}'s {heads} heads / {kv} KV heads do not fit in {big_heads} heads / {big_kv} KV heads "
            f"with GQA groups preserved (needs >= {kv * reps} KV heads); use a shape with more KV heads"
        )
    i = torch.arange(heads)
    j, m = i // group, i % group
    return (j * reps + m // big_group) * big_group + m % big_group, reps


class _Builder:
    """Writes big tensors in ``dtype`` on ``device``: random by default, the small weights where they matter."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int, small_hidden: int,
                 big_hidden: int) -> None:
        self.device, self.dtype = device, dtype
        # the meta device (a dry run: shapes and parameter counts without memory) has no generator
        self.gen = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None
        self.h, self.H = small_hidden, big_hidden
        self.norm_scale = math.sqrt(small_hidden / big_hidden)  # 1 / c

    def small(self, t: Tensor, scale: float = 1.0) -> Tensor:
        """A small weight on the big device/dtype, scaled in fp32 (exact for powers of two)."""
        t = t.detach().to(self.device)
        return (t.float() * scale).to(self.dtype) if scale != 1.0 else t.to(self.dtype)

    def fill(self, state: dict[str, Tensor], shapes: dict[str, torch.Size]) -> None:
        """Random values for every tensor: norms around 1, biases small, matrices ~ 1/sqrt(fan_in).

        Kept modest so no unreachable head or channel overflows bf16 (0 * inf would reach the output)."""
        for name, shape in shapes.items():
            noise = torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype)
            if len(shape) == 1:
                state[name] = noise.mul_(0.02).add_(1.0) if name.endswith("norm.weight") else noise.mul_(0.02)
            else:
                state[name] = noise.mul_(1.0 / math.sqrt(shape[-1]))

    def norm(self, big: Tensor, small: Tensor) -> None:
        big[: self.h] = self.small(small, self.norm_scale)

    def identity_layer(self, state: dict[str, Tensor], prefix: str) -> None:
        """A layer that adds nothing to the residual stream: its outputs projections are zero."""
        for name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
            if f"{prefix}{name}" in state:
                state[f"{prefix}{name}"].zero_()

    def layer(self, state: dict[str, Tensor], prefix: str, small: dict[str, Tensor], head_dim: int,
              qmap: Tensor, reps: int, qk_scale: float) -> None:
        """Embed one small decoder layer (its state dict, names relative to the layer) at ``prefix``.

        qmap [small heads] big q head of each small q head; ``reps`` big KV heads carry each small KV head;
        ``qk_scale`` multiplies the real heads' Q/K rows (and biases): ``1 / c`` under q_norm/k_norm, else 1."""
        h, H, d = self.h, self.H, head_dim
        self.identity_layer(state, prefix)  # output projections start at zero; the small ones are written below
        self.norm(state[f"{prefix}input_layernorm.weight"], small["input_layernorm.weight"])
        self.norm(state[f"{prefix}post_attention_layernorm.weight"], small["post_attention_layernorm.weight"])
        attn = f"{prefix}self_attn."
        n_kv = small["self_attn.k_proj.weight"].shape[0] // d
        qmap = qmap.to(self.device)
        kv_big = torch.arange(n_kv * reps, device=self.device)  # big KV heads in use
        kv_src = kv_big // reps  # the small KV head each one carries
        q_rows = state[f"{attn}q_proj.weight"].view(-1, d, H)  # [big heads, d, H]
        q_rows[qmap, :, :h] = self.small(small["self_attn.q_proj.weight"], qk_scale).view(-1, d, h)
        if "self_attn.q_proj.bias" in small:
            state[f"{attn}q_proj.bias"].view(-1, d)[qmap] = self.small(
                small["self_attn.q_proj.bias"], qk_scale).view(-1, d)
        for name, scale in (("k_proj", qk_scale), ("v_proj", 1.0)):
            rows = state[f"{attn}{name}.weight"].view(-1, d, H)  # [big KV heads, d, H]
            rows[kv_big, :, :h] = self.small(small[f"self_attn.{name}.weight"], scale).view(-1, d, h)[kv_src]
            if f"self_attn.{name}.bias" in small:
                bias = state[f"{attn}{name}.bias"].view(-1, d)
                bias[kv_big] = self.small(small[f"self_attn.{name}.bias"], scale).view(-1, d)[kv_src]
        o_cols = state[f"{attn}o_proj.weight"].view(H, -1, d)  # [H, big heads, d]
        o_cols[:h, qmap, :] = self.small(small["self_attn.o_proj.weight"]).view(h, -1, d)
        if "self_attn.o_proj.bias" in small:
            state[f"{attn}o_proj.bias"][:h] = self.small(small["self_attn.o_proj.bias"])
        for name in ("q_norm", "k_norm"):
            if f"self_attn.{name}.weight" in small:
                state[f"{attn}{name}.weight"].copy_(self.small(small[f"self_attn.{name}.weight"]))
        inter = small["mlp.gate_proj.weight"].shape[0]
        for name in ("gate_proj", "up_proj"):
            state[f"{prefix}mlp.{name}.weight"][:inter, :h] = self.small(small[f"mlp.{name}.weight"])
        state[f"{prefix}mlp.down_proj.weight"][:h, :inter] = self.small(small["mlp.down_proj.weight"])


def _layer_state(state: dict[str, Tensor], index: int) -> dict[str, Tensor]:
    """Layer ``index``'s entries of a model state dict, names relative to the layer."""
    prefix = f"layers.{index}."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _check_fits(target: TargetConfig, drafter: DrafterConfig, shape: StandinShape) -> None:
    if target.head_dim != shape.head_dim or drafter.head_dim != shape.head_dim:
        raise ConfigError(
            f"stand-in shape {shape.name!r} has head_dim {shape.head_dim}, the small pair has "
            f"{target.head_dim} (target) / {drafter.head_dim} (drafter); head_dim must stay the small pair's"
        )
    if shape.hidden_size < target.hidden_size:
        raise ConfigError(
            f"stand-in shape {shape.name!r} has hidden_size {shape.hidden_size}, smaller than the small pair's "
            f"{target.hidden_size}"
        )
    for big, small, what in ((shape.intermediate_size, target.intermediate_size, "target"),
                             (shape.draft_intermediate_size, drafter.intermediate_size, "drafter")):
        if big < small:
            raise ConfigError(
                f"stand-in shape {shape.name!r} has {what} intermediate_size {big}, smaller than the small "
                f"{what}'s {small}"
            )


def standin_configs(target: TargetConfig, drafter: DrafterConfig, shape: StandinShape,
                    plan: StandinPlan) -> tuple[TargetConfig, DrafterConfig]:
    """The big pair's configs: the shape's dims, the small pair's vocabulary, RoPE, tokens and drafting setup,
    and ``rms_norm_eps`` scaled by ``h / H`` (see the module docstring)."""
    ratio = target.hidden_size / shape.hidden_size
    big_target = dataclasses.replace(
        target, hidden_size=shape.hidden_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
        rms_norm_eps=target.rms_norm_eps * ratio,
    )
    types = ["full_attention"] * shape.draft_num_layers  # identity layers: z-lab Qwen3-8B-DFlash's type
    for k, b in enumerate(plan.drafter_layers):
        types[b] = drafter.layer_types[k]
    big_drafter = dataclasses.replace(
        drafter, hidden_size=shape.hidden_size, num_layers=shape.draft_num_layers, num_heads=shape.draft_num_heads,
        num_kv_heads=shape.draft_num_kv_heads, intermediate_size=shape.draft_intermediate_size,
        target_layer_ids=plan.feature_ids, rms_norm_eps=drafter.rms_norm_eps * ratio, layer_types=tuple(types),
        target_hidden_size=None, num_target_layers=shape.num_layers,
    )
    return big_target, big_drafter


def _meta_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {name: t.shape for name, t in model.state_dict().items()}


@torch.no_grad()
def build_standin(target: TargetModel, drafter: DFlashDrafter, shape: StandinShape, *, seed: int = 0,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> tuple[TargetModel, DFlashDrafter]:
    """A big-bodied (target, drafter) computing the small pair's functions; see the module docstring.

    Built on ``device`` in ``dtype`` (default: the small target's), tensor by tensor, so the big weights exist
    once and only there; ``device="meta"`` is a dry run (checks the shape against the pair, counts parameters).
    ``seed`` drives the values that cannot reach the output."""
    drafter.check_target(target)
    tc, dc = target.config, drafter.config
    _check_fits(tc, dc, shape)
    plan = plan_standin(tc, dc, shape)
    big_tc, big_dc = standin_configs(tc, dc, shape, plan)
    qmap_t, reps_t = _head_placement(tc.num_heads, tc.num_kv_heads, shape.num_heads, shape.num_kv_heads, "target")
    qmap_d, reps_d = _head_placement(dc.num_heads, dc.num_kv_heads, shape.draft_num_heads,
                                     shape.draft_num_kv_heads, "drafter")
    device = torch.device(device) if device is not None else target.device
    dtype = dtype or target.dtype
    b = _Builder(device, dtype, seed, tc.hidden_size, shape.hidden_size)
    h, H = tc.hidden_size, shape.hidden_size
    qk_scale_t = b.norm_scale if tc.qk_norm else 1.0

    small_target, small_drafter = target.state_dict(), drafter.state_dict()
    with torch.device("meta"):
        big_target, big_drafter = TargetModel(big_tc), DFlashDrafter(big_dc)

    state: dict[str, Tensor] = {}
    b.fill(state, _meta_shapes(big_target))
    state["embed_tokens.weight"].zero_()
    state["embed_tokens.weight"][:, :h] = b.small(target.embed_tokens.weight)
    if target.lm_head is not None:
        state["lm_head.weight"][:, :h] = b.small(target.lm_head.weight)
    b.norm(state["norm.weight"], target.norm.weight)
    placed = {big: k for k, big in enumerate(plan.target_layers)}
    for big in range(shape.num_layers):
        prefix = f"layers.{big}."
        if big in placed:
            b.layer(state, prefix, _layer_state(small_target, placed[big]), tc.head_dim, qmap_t, reps_t,
                    qk_scale_t)
        else:
            b.identity_layer(state, prefix)
    big_target.load_state_dict(state, strict=True, assign=True)
    big_target.rotary.reset(device)

    state = {}
    b.fill(state, _meta_shapes(big_drafter))
    fc = state["fc.weight"]  # [H, n_in * H]
    for block in range(shape.draft_num_inputs):
        fc[:, block * H: block * H + h] = 0  # real feature dims of every block: only the small fc may read them
    small_fc = b.small(drafter.fc.weight)  # [h, n * h]
    for j, slot in enumerate(plan.feature_slots):
        fc[:h, slot * H: slot * H + h] += small_fc[:, j * h:(j + 1) * h]
    b.norm(state["hidden_norm.weight"], drafter.hidden_norm.weight)
    b.norm(state["norm.weight"], drafter.norm.weight)
    placed = {big: k for k, big in enumerate(plan.drafter_layers)}
    for big in range(shape.draft_num_layers):
        prefix = f"layers.{big}."
        if big in placed:
            b.layer(state, prefix, _layer_state(small_drafter, placed[big]), dc.head_dim, qmap_d, reps_d,
                    b.norm_scale)
        else:
            b.identity_layer(state, prefix)
    big_drafter.load_state_dict(state, strict=True, assign=True)
    big_drafter.rotary.reset(device)
    big_drafter.check_target(big_target)
    return big_target.eval(), big_drafter.eval()


class SmallPair(NamedTuple):
    target: TargetModel
    drafter: DFlashDrafter
    target_dir: Path  # its tokenizer is the stand-in's
    drafter_dir: Path


def load_small_pair(target: str | Path | None = None, draft: str | Path | None = None, *,
                    device: torch.device | str = "cpu") -> SmallPair:
    """The small pair a stand-in is built from (default: the demo pair), in fp32 on ``device``: it is small, and
    fp32 lets each big weight be scaled once and rounded once."""
    from ddtree.models.loading import load_drafter, load_target, resolve_checkpoint

    if (target is None) != (draft is None):
        raise ConfigError("pass both a small target and a small drafter, or neither for the demo pair")
    if target is None:
        from ddtree.assets import demo_drafter_path, demo_target_path

        target, draft = demo_target_path(), demo_drafter_path()
    target_dir, drafter_dir = resolve_checkpoint(target), resolve_checkpoint(draft)
    return SmallPair(load_target(target_dir, dtype=torch.float32, device=device),
                     load_drafter(drafter_dir, dtype=torch.float32, device=device), target_dir, drafter_dir)


def load_standin(shape: StandinShape | str, target: str | Path | None = None, draft: str | Path | None = None, *,
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> tuple[TargetModel, DFlashDrafter, Path]:
    """Build the stand-in of a small pair's checkpoints (default: the demo pair) in memory, for benchmarks.

    Returns the big target, the big drafter and the small target's directory (its tokenizer is the stand-in's)."""
    if isinstance(shape, str):
        shape = standin_shape(shape)
    small = load_small_pair(target, draft, device=device)
    big_target, big_drafter = build_standin(small.target, small.drafter, shape, seed=seed, device=device,
                                            dtype=dtype)
    return big_target, big_drafter, small.target_dir


def load_demo_benchmark_pair(shape: str, device: torch.device, dtype: torch.dtype
                             ) -> tuple[TargetModel, DFlashDrafter, Path]:
    """The pair the GPU benchmark scripts measure: the demo pair loaded in ``dtype`` on ``device`` and, unless
    ``shape`` is ``"none"``, the stand-in of that shape built from it (:func:`build_standin` from the loaded
    weights, as ``benchmarks/gpu.py`` has always built it; :func:`load_standin` builds from fp32 instead).

    Returns (target, drafter, the demo target's directory: its tokenizer is the pair's)."""
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.models.loading import load_drafter, load_target

    target = load_target(demo_target_path(), dtype=dtype, device=device)
    drafter = load_drafter(demo_drafter_path(), dtype=dtype, device=device)
    if shape != "none":
        target, drafter = build_standin(target, drafter, standin_shape(shape))
    return target, drafter, Path(demo_target_path())


def load_benchmark_models(shape: str, device: torch.device) -> tuple[TargetModel, DFlashDrafter, Any, torch.dtype]:
    """:func:`load_demo_benchmark_pair` in the benchmarks' dtype (bf16 on CUDA, fp32 elsewhere) with the pair's
    tokenizer: (target, drafter, tokenizer, dtype)."""
    from ddtree.models.tokenizer import load_tokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter, tokenizer_dir = load_demo_benchmark_pair(shape, device, dtype)
    return target, drafter, load_tokenizer(tokenizer_dir), dtype


@torch.inference_mode()
def logit_agreement(small: TargetModel, big: TargetModel, input_ids: Tensor) -> dict[str, float]:
    """How closely ``big`` reproduces ``small`` on input_ids [B, T]: the largest logit difference relative to the
    largest small logit, and the fraction of positions whose argmax agrees (1.0 in fp32; bf16 may flip near-ties)."""
    a = small.forward_train(input_ids.to(small.device)).logits.float()
    b = big.forward_train(input_ids.to(big.device)).logits.float().to(a.device)
    return {
        "max_rel_logit_diff": float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }
