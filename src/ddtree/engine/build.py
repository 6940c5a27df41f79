"""Building an engine: load the models, fuse and quantize them, size the KV caches and set up CUDA graphs.

Everything here runs once, before the engine thread starts; the product is one :class:`EngineParts` that the
scheduler (:mod:`ddtree.engine.scheduler`) runs and the facade (:mod:`ddtree.engine.engine`) exposes. Why a module
of its own: set-up (``/proc/meminfo``, fp8 calibration, fusing) changes for other reasons than scheduling does.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass, replace

import torch

from ddtree.devices import resolve_device, resolve_dtype
from ddtree.engine.api import TreeSettings
from ddtree.engine.config import EngineConfig, resolve_prefill_every
from ddtree.engine.cuda_graphs import AttentionDims
from ddtree.engine.exact_check import check_target
from ddtree.engine.kernels import KernelSet
from ddtree.engine.prefill_budget import resolve_step_tokens
from ddtree.engine.runner import ModelRunner
from ddtree.engine.warmup import GraphDims, Warmup, WarmupPlan, build_steps, plan_bytes, plan_warmup
from ddtree.errors import ConfigError
from ddtree.models import fuse_projections

log = logging.getLogger("ddtree.engine")

# Whole prompts up to this many tokens prefill through a CUDA graph (cuda_graphs.PrefillGraphs); longer ones eager.
PREFILL_GRAPH_MAX_WIDTH = 1024


@dataclass
class EngineParts:
    """What a built engine runs: the models, the resolved config (``max_batch`` and ``max_block_size`` filled in),
    the runner with its KV caches and, on CUDA, the graph sets."""

    target: torch.nn.Module
    drafter: torch.nn.Module | None
    tokenizer: object
    config: EngineConfig
    model_name: str
    trained_block_size: int
    cache_len: int  # KV positions per slot: max_len plus the headroom one step may write past it
    runner: ModelRunner
    kernels: KernelSet  # which ops run Triton kernels, resolved once here (the runner holds the same)
    graphs: object | None  # cuda_graphs.RoundGraphs
    prefill_graphs: object | None  # cuda_graphs.PrefillGraphs
    overlap: bool  # EngineConfig.overlap_rounds resolved for the device
    eos_ids: frozenset[int]
    warmup: Warmup  # EngineConfig.warmup's plan over these graph sets, run by Engine.start (empty without graphs)
    exact_blas: object | None = None  # models.exact_blas.BlasCheck: exact mode's start-up check on CUDA, else None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def exact_info(self) -> dict:
        """``Engine.info()["exact"]``: whether exact mode is on and, on CUDA, its start-up check's result."""
        return {"on": self.kernels.exact, "check": None if self.exact_blas is None else self.exact_blas.describe()}


def load_models(config: EngineConfig):
    """Load the configured target, drafter and tokenizer -> (target, drafter, tokenizer, config with the device and
    dtype resolved, served model name)."""
    from ddtree.models import load_drafter, load_target, load_tokenizer

    config = config.validated()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target_dir, draft_dir, name = _model_paths(config)
    target = load_target(target_dir, dtype=dtype, device=device)
    drafter = load_drafter(draft_dir, dtype=dtype, device=device) if draft_dir is not None else None
    tokenizer = load_tokenizer(target_dir)
    return target, drafter, tokenizer, replace(config, device=str(device), dtype=str(dtype).split(".")[-1]), name


def build(target, drafter, tokenizer, config: EngineConfig, *, model_name: str) -> EngineParts:
    """Prepare loaded models for serving: fuse (CUDA), fp8 (``draft_fp8``), KV slots (``kv_memory_fraction``), the
    runner and the CUDA graph sets. ``config``'s device and dtype are taken from the target's parameters."""
    param = next(target.parameters())
    config = config.validated()
    config = replace(config, device=str(param.device), dtype=str(param.dtype).split(".")[-1],
                     prefill_every=resolve_prefill_every(config.prefill_every, param.device.type),
                     prefill_step_tokens=resolve_step_tokens(config.prefill_step_tokens, config.prefill_chunk,
                                                             param.device.type))
    device = param.device
    trained_block_size = int(drafter.trained_block_size) if drafter is not None else 2
    max_block = config.max_block_size or trained_block_size
    if drafter is not None and max_block > trained_block_size:
        warnings.warn(
            f"max_block_size {max_block} exceeds the drafter's trained block size {trained_block_size}: "
            "draft positions past the trained depth are untrained and rarely accepted",
            stacklevel=4,
        )
    kernels = KernelSet.resolve(config, target, drafter)
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    if device.type == "cuda":
        # One matmul for q/k/v and one for gate/up per layer (the weights become views of a fused matrix); with
        # KernelSet.fused_ops the runner's forwards also take Triton kernels for the element-wise steps: the
        # graphs captured below launch ~10 kernels per decoder layer instead of ~50.
        fuse_projections(target)
        if drafter is not None:
            fuse_projections(drafter)
    _check_fp8_sharing(drafter, config.draft_fp8)
    if config.draft_fp8:
        _quantize_drafter(target, drafter, tokenizer)
    # an eager prefill chunk pads its width to a multiple of 16 (cuda_graphs.eager_chunk_dims); a mixed round's rider
    # takes at most prefill_chunk tokens too (PrefillSteps._ride_rows)
    headroom = max(-(-config.prefill_chunk // 16) * 16, config.max_budget + 1, max_block) + 1
    max_batch = config.max_batch
    graphed = bool(config.cuda_graphs and device.type == "cuda")
    prefill_width = min(PREFILL_GRAPH_MAX_WIDTH, config.prefill_chunk) if config.prefill_graphs else None
    block = (config.default_tree.block_size or trained_block_size) if drafter is not None else 1
    attention = AttentionDims.of(target, drafter, kernels) if graphed else None

    def plan_for(slots: int) -> WarmupPlan:
        if not graphed:
            return WarmupPlan(level=config.warmup)
        return plan_warmup(replace(config, max_batch=slots, max_block_size=max_block),
                           cache_len=config.max_len + headroom, drafts=drafter is not None, block_size=block,
                           prefill_max_width=prefill_width, attention=attention)

    dims = GraphDims.of(target, drafter)
    if config.kv_memory_fraction is not None:
        # Graph memory comes out of the KV share: size once without it, estimate the plan at that batch, resize.
        first = _slots_from_memory(target, drafter, config, headroom, device)
        max_batch = _slots_from_memory(target, drafter, config, headroom, device,
                                       reserved=plan_bytes(plan_for(first), dims))
    config = replace(config, max_batch=max_batch, max_block_size=max_block)
    cache_len = config.max_len + headroom
    exact_blas = None
    if kernels.exact and device.type == "cuda":  # exact mode: which projections cuBLAS already computes row-invariantly
        exact_blas = check_target(target, max_batch=max_batch, max_budget=config.max_budget, max_block=max_block,
                                  prefill_chunk=config.prefill_chunk, step_tokens=config.prefill_step_tokens,
                                  prefill_width=prefill_width,
                                  max_len=config.max_len)
        kernels = replace(kernels, exact_blas=exact_blas.trusted)
    plan = plan_for(max_batch)
    runner = ModelRunner(target, drafter, slots=max_batch, cache_len=cache_len, kernels=kernels)
    graphs = prefill_graphs = None
    if config.cuda_graphs and device.type == "cuda":
        from ddtree.engine.cuda_graphs import PrefillGraphs, RoundGraphs
        from ddtree.engine.graph_capture import Recorder

        # Room for the whole plan and as many lazy shapes again as before the plan (its LRU never drops planned ones
        # while misses stay below that).
        recorder = Recorder(device)  # one capture stream and one clock for both graph sets
        graphs = RoundGraphs(runner, max_rows=max_batch, cache_len=cache_len, max_graphs=96 + len(plan.rounds),
                             attention=attention, recorder=recorder,
                             max_chunk_width=-(-max(min(config.mixed_chunk, config.prefill_chunk), 16) // 16) * 16)
        if config.prefill_graphs:
            prefill_graphs = PrefillGraphs(runner, max_rows=max_batch, max_width=prefill_width,
                                           max_graphs=max(32, len(plan.prefills) + 8), recorder=recorder)
    warmup = Warmup(plan=plan, steps=build_steps(plan, graphs=graphs, prefill_graphs=prefill_graphs, runner=runner,
                                                 dims=dims),
                    graphs=graphs, prefill_graphs=prefill_graphs, dims=dims, device=device,
                    estimated_bytes=plan_bytes(plan, dims), precompile=_precompiler(plan, attention, runner, cache_len))
    overlap = config.overlap_rounds if config.overlap_rounds is not None else device.type == "cuda"
    log.info("engine: %s on %s/%s, %d slots x %d tokens, KV %.1f MiB", model_name, device, config.dtype, max_batch,
             cache_len, runner.kv_bytes / 2**20)
    return EngineParts(target=target, drafter=drafter, tokenizer=tokenizer, config=config, model_name=model_name,
                       trained_block_size=trained_block_size, cache_len=cache_len, runner=runner, kernels=kernels,
                       graphs=graphs, prefill_graphs=prefill_graphs, overlap=overlap, eos_ids=_eos_ids(target, tokenizer),
                       warmup=warmup, exact_blas=exact_blas)


def _precompiler(plan: WarmupPlan, attention: AttentionDims | None, runner: ModelRunner, cache_len: int):
    """The warm-up's tree-attention precompilation (:mod:`ddtree.engine.precompile`), where there is a plan that
    attends through the kernel; None elsewhere."""
    if attention is None or not (plan.rounds or plan.prefills or plan.eager_chunks):
        return None
    from ddtree.engine import precompile

    calls = precompile.planned_calls(plan, attention, cache_len)
    caches = {"target": runner.target_cache.k[0]}
    if runner.drafter_cache is not None:
        caches["draft"] = runner.drafter_cache.k[0]
    return lambda: precompile.precompile(lambda: precompile.collect(calls, caches, runner.dtype))


def default_tree(parts: EngineParts) -> TreeSettings:
    """The configured default tree, or AR for an engine without a drafter."""
    return parts.config.default_tree if parts.drafter is not None else TreeSettings(method="ar")


def _eos_ids(target, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(target.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _model_paths(config: EngineConfig) -> tuple[str, str | None, str]:
    """Target dir, drafter dir (None = no drafter) and the served model name; demo pair by default."""
    if config.target is None:
        from ddtree.assets import demo_drafter_path, demo_target_path

        target, name = str(demo_target_path()), "ddtree-demo"
        draft = str(demo_drafter_path()) if config.draft is None else config.draft
    else:
        target, name = config.target, str(config.target).rstrip("/").split("/")[-1]
        draft = config.draft
        if draft is None:
            raise ConfigError("--target was given without --draft; pass --draft DIR, or --draft none for AR only")
    if draft is not None and draft.lower() == "none":
        draft = None
    return target, draft, name


def _slots_from_memory(target, drafter, config: EngineConfig, headroom: int, device: torch.device, *,
                       reserved: int = 0) -> int:
    """KV slots that fit in ``kv_memory_fraction`` of the device's free memory, less ``reserved`` bytes (the
    warm-up plan's estimated graph memory, :func:`ddtree.engine.warmup.plan_bytes`); at least 1."""
    per_token = _kv_bytes_per_token(target) + (_kv_bytes_per_token(drafter) if drafter is not None else 0)
    per_slot = per_token * (config.max_len + headroom)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _host_available_bytes()
    slots = int((free * float(config.kv_memory_fraction) - reserved) // per_slot)
    if slots < 1:
        graphs = f" after {reserved / 2**30:.2f} GiB for the warm-up's graphs (lower --warmup)" if reserved else ""
        raise ConfigError(
            f"kv_memory_fraction {config.kv_memory_fraction} of {free / 2**30:.1f} GiB free holds no KV slot of "
            f"{per_slot / 2**20:.1f} MiB{graphs}; raise the fraction or lower max_len"
        )
    return slots


def _kv_bytes_per_token(model) -> int:
    cfg = model.config
    elem = next(model.parameters()).element_size()
    return 2 * int(cfg.num_layers) * int(cfg.num_kv_heads) * int(cfg.head_dim) * elem


def _host_available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * 2**30


# Drafters an engine without draft_fp8 serves: their layers must not get fp8 copies (weakly held, so a drafter that
# outlives its engines can be freed; a deep copy is a new drafter).
_DRAFTERS_WITHOUT_FP8: weakref.WeakSet = weakref.WeakSet()


def _check_fp8_sharing(drafter, draft_fp8: bool) -> None:
    """fp8 copies live on the drafter's modules, so two engines over one drafter object must agree on
    ``draft_fp8``: otherwise one engine's eager calls would silently take (or lose) the other's fp8 path."""
    if drafter is None:
        return
    from ddtree.models import fp8

    if draft_fp8 and drafter in _DRAFTERS_WITHOUT_FP8:
        raise ConfigError("draft_fp8=True on a drafter that also serves an engine with draft_fp8=False (fp8 copies "
                          "attach to the drafter's modules); give this engine its own copy.deepcopy(drafter)")
    if not draft_fp8:
        if any(fp8.projections(drafter)):
            raise ConfigError("this drafter carries fp8 copies from an engine with draft_fp8=True; pass "
                              "draft_fp8=True too, or a copy.deepcopy(drafter) made before that engine was built")
        _DRAFTERS_WITHOUT_FP8.add(drafter)


def _quantize_drafter(target, drafter, tokenizer) -> None:
    """``EngineConfig.draft_fp8``: fp8 copies of the drafter's layer projections, their input scales calibrated on
    :data:`ddtree.models.fp8.CALIBRATION_TEXT` (see :mod:`ddtree.models.fp8`). Runs before any graph is captured."""
    from ddtree.models import fp8

    if drafter is None:
        raise ConfigError("draft_fp8 needs a drafter; this engine has none (draft='none')")
    device = next(drafter.parameters()).device
    if not fp8.fp8_supported(device):
        found = (f"compute capability {torch.cuda.get_device_capability(device)}" if device.type == "cuda"
                 else "no CUDA")
        raise ConfigError(f"draft_fp8 needs fp8 matmuls (a CUDA device of compute capability 8.9 or newer, or the "
                          f"CPU); {device} has {found}")
    fuse_projections(drafter)  # idempotent; on the CPU the layers are fused only for fp8
    fp8.quantize_drafter(drafter)
    if not all(p.calibrated for p in fp8.projections(drafter)):
        ids = tokenizer.encode(fp8.CALIBRATION_TEXT, add_special_tokens=False)[:512]
        fp8.calibrate(drafter, target, torch.tensor([ids], device=device))
