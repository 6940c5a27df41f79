"""``EngineConfig``: everything fixed when an engine is built (models, device, preallocated limits).

Per-request knobs live in :class:`~ddtree.engine.api.TreeSettings` / :class:`~ddtree.engine.api.SamplingParams`;
the limits here only bound them, because buffers are sized once at set-up and never grow while serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ddtree.engine.api import TreeSettings
from ddtree.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    target: str | None = None  # local HF directory or hub id; None = the embedded demo target
    draft: str | None = None  # z-lab DFlash directory or hub id; None = the demo drafter; "none" = AR only
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA), "float32", "bfloat16", "float16"
    max_batch: int = 16  # requests decoding at once (KV slots)
    max_len: int = 4096  # tokens per request: prompt + completion
    max_budget: int = 64  # largest tree budget a request may ask for
    max_block_size: int | None = None  # largest block size a request may ask for; None = drafter's trained size
    max_queue: int = 256  # requests waiting for a slot before new ones are refused
    # Prompt tokens one prompt writes per prefill step (long prompts are chunked); each slot keeps this many positions
    # of cache headroom (a chunk's padded width is written past the prompt's end).
    prefill_chunk: int = 512
    # A prefill step's size across its prompts: rows and widest row rounded up to powers of two multiply to at most
    # this (ddtree.engine.prefill_budget), so it bounds what a step computes with its padding. None = 2048 on CUDA,
    # prefill_chunk elsewhere (resolve_step_tokens, at build). Why separate from prefill_chunk: the loop runs one step
    # a round, so this sets the prefill rate; at 64 requests of 1k tokens one 512-token step a round let the batch
    # drain (the H200 stand-in: DDTree 1.04x AR); steps of 2048 gave b7 +27 % and auto +31 % on one H100, 1.36x AR
    # (docs/benchmarks.md, "Prefill steps sized apart from the chunk").
    prefill_step_tokens: int | None = None
    # Prompt tokens a decode round carries in its verify forward for requests still prefilling (a mixed round;
    # ddtree.engine.scheduler), padding included, at most prefill_chunk a prompt (a prefill step's rule,
    # ddtree.engine.prefill_budget, with this as the step's size): the bound on the extra forward a decoding
    # request waits for per round. 0 = prompts are prefilled only in prefill steps between rounds. Off by default, a
    # latency knob: on one H100 at 64 in flight (2026-12-07) 2048 kept every config's rounds within 1-6 % of their
    # device stages once its graphs were captured (DDTree 13-126 % past with the default prefill steps) at 0.90-0.98x
    # their tok/s; the warm-up cannot plan its graphs (each shape captures on first use, within a share of the
    # loop's time: PrefillSteps._may_ride; docs/benchmarks.md, "Prefill steps against mixed rounds at 64 in flight").
    mixed_chunk: int = 0
    # While requests decode, prompts of arriving requests start prefilling at most once every this many rounds, so
    # the arrivals of those rounds share one prefill step (a short prompt's step costs about a weight read, whatever
    # its rows) instead of one step each; a newcomer waits at most this many rounds for it. 1 = every round; vLLM's
    # scheduler_delay_factor plays this part there. None = PREFILL_EVERY_CUDA on CUDA, 1 elsewhere (resolved by
    # resolve_prefill_every when the engine is built): on one H100 at 64 in flight N = 3 gave DDTree auto +9-12 %
    # and b7 +2-5 % at 60-token prompts in three runs, AR -1 to -3 %, nothing beyond the spread at 1k
    # (docs/benchmarks.md, "Arrivals at 64 in flight"); on a CPU a round is tens of ms, so a newcomer would wait long.
    prefill_every: int | None = None
    kv_memory_fraction: float | None = None  # size max_batch from free device memory instead
    cuda_graphs: bool = True  # capture decode rounds as CUDA graphs (CUDA devices only)
    prefill_graphs: bool = True  # with cuda_graphs: also prefill chunks that start a prompt (up to 1024 tokens)
    gpu_kernels: bool = True  # Triton kernels on CUDA (fused layer ops, tree attention, vocab top-k); False = torch
    # The model forwards' matmuls through cuBLASLt at 32-192 token rows, cuBLAS otherwise (ddtree.models.gemm_backend,
    # measured on the H200); False = cuBLAS for every matmul, for an A/B of the rule (benchmarks/gpu.py --no-blas-rule).
    blas_rule: bool = True
    # Exact mode: the target's forward computes every token row the same way whatever the rows beside it, the tree
    # or the key-length bucket (ddtree.models.batch_invariant), so greedy speculative outputs are bit-identical to
    # plain decoding in bf16 too. Costs speed (docs/benchmarks.md, "Exact mode"); needs Triton on CUDA.
    exact: bool = False
    # The drafter's layer projections in fp8 (e4m3, ddtree.models.fp8): half the bytes a draft reads. Lossless still
    # (the target verifies every token); acceptance may move. Needs a GPU of compute capability >= 8.9 (or the CPU).
    draft_fp8: bool = False
    # Queue round n + 1 on the device (inputs advanced there from round n's result) before reading round n, while the
    # batch stays the same: the device never waits for the host between rounds. None = on for CUDA devices.
    overlap_rounds: bool | None = None
    # Intra-op threads torch uses on a CPU device (torch.set_num_threads, which is process-wide). None = torch's
    # default (one per core). 1 on a machine whose cores other processes keep busy: a round's ops are small, and an
    # OpenMP thread that waits at every op's barrier for a taken core costs more than it computes (docs/benchmarks.md).
    cpu_threads: int | None = None
    # What Engine.start() captures before the engine reports ready (ddtree.engine.warmup): "none" (every shape on
    # first use), "fast" (AR and the default tree, greedy, every batch and length bucket, prefill shapes), "full"
    # (also every DDTree budget bucket, the chain, sampled rounds), or DDTree budgets "4,15,31" added to fast.
    warmup: str = "fast"
    # The cost curve (round wall seconds by rows, budget and context; ddtree.engine.cost_curve) Engine.start() gets:
    # "off", "auto" (measured after the warm-up on a declared grid, cached per device and model under
    # ~/.cache/ddtree/cost_curves), or the path of a curve's JSON file. Engine.info()["cost_curve"] says which.
    cost_curve: str = "off"
    default_tree: TreeSettings = field(default_factory=TreeSettings)
    seed: int = 0

    def validated(self) -> EngineConfig:
        for name, lo in (("max_batch", 1), ("max_len", 16), ("max_budget", 1), ("max_queue", 0), ("prefill_chunk", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
        if isinstance(self.mixed_chunk, bool) or not isinstance(self.mixed_chunk, int) or self.mixed_chunk < 0:
            raise ConfigError(f"mixed_chunk must be an integer >= 0 (0: no prompt chunks in decode rounds), "
                              f"got {self.mixed_chunk!r}")
        if self.prefill_step_tokens is not None and (
                isinstance(self.prefill_step_tokens, bool) or not isinstance(self.prefill_step_tokens, int)
                or self.prefill_step_tokens < self.prefill_chunk):
            raise ConfigError(f"prefill_step_tokens must be an integer >= prefill_chunk ({self.prefill_chunk}) or left "
                              f"unset (None: 2048 on CUDA, prefill_chunk elsewhere), got {self.prefill_step_tokens!r}")
        if self.prefill_every is not None and (isinstance(self.prefill_every, bool)
                                               or not isinstance(self.prefill_every, int) or self.prefill_every < 1):
            raise ConfigError(f"prefill_every must be an integer >= 1 (1: a prefill step every round) or left unset "
                              f"(None: {PREFILL_EVERY_CUDA} on CUDA, 1 elsewhere), got {self.prefill_every!r}")
        if self.max_block_size is not None and (not isinstance(self.max_block_size, int) or self.max_block_size < 2):
            raise ConfigError(f"max_block_size must be an integer >= 2, got {self.max_block_size!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.blas_rule, bool):
            raise ConfigError(f"blas_rule must be true or false, got {self.blas_rule!r}")
        if not isinstance(self.exact, bool):
            raise ConfigError(f"exact must be true or false, got {self.exact!r}")
        if not isinstance(self.draft_fp8, bool):
            raise ConfigError(f"draft_fp8 must be true or false, got {self.draft_fp8!r}")
        if self.kv_memory_fraction is not None and not (0.0 < self.kv_memory_fraction < 1.0):
            raise ConfigError(f"kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction!r}")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                                             or self.cpu_threads < 1):
            raise ConfigError(f"cpu_threads must be an integer >= 1 or None (torch's default), got {self.cpu_threads!r}")
        if not isinstance(self.cost_curve, str) or not self.cost_curve:
            raise ConfigError(f"cost_curve must be off, auto or the path of a cost curve JSON file, got {self.cost_curve!r}")
        if self.cost_curve not in ("off", "auto") and not Path(self.cost_curve).is_file():
            raise ConfigError(f"cost_curve {self.cost_curve!r} is neither off, auto nor an existing file; give the path "
                              f"of a curve written by `ddtree replay curve` or an engine started with cost_curve auto")
        _, budgets = parse_warmup(self.warmup)
        if any(b > self.max_budget for b in budgets):
            raise ConfigError(f"warmup budgets {list(budgets)} exceed max_budget {self.max_budget}")
        return self


PREFILL_EVERY_CUDA = 3  # EngineConfig.prefill_every's default on CUDA (measured on one H100; benchmarks.md)


def resolve_prefill_every(value: int | None, device_type: str) -> int:
    """``EngineConfig.prefill_every`` for an engine on ``device_type`` ("cuda", "cpu"): the value given, or the
    device's default when None."""
    if value is not None:
        return value
    return PREFILL_EVERY_CUDA if device_type == "cuda" else 1


WARMUP_LEVELS = ("none", "fast", "full")


def parse_warmup(text: str) -> tuple[str, tuple[int, ...]]:
    """``EngineConfig.warmup`` -> (level, extra DDTree budgets): "none" / "fast" / "full", or comma-separated
    budgets (level "fast" plus those budgets' graphs)."""
    if not isinstance(text, str):
        raise ConfigError(f"warmup must be none, fast, full or comma-separated budgets, got {text!r}")
    if text in WARMUP_LEVELS:
        return text, ()
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        budgets = ()
    if not budgets or any(b < 1 for b in budgets):
        raise ConfigError(f"warmup must be none, fast, full or comma-separated DDTree budgets >= 1 (e.g. 4,15,31), "
                          f"got {text!r}")
    return "fast", budgets
