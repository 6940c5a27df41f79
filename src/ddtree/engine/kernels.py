"""The one kernel switch: which op of a round runs a Triton kernel, resolved once per engine and passed down.

``EngineConfig.gpu_kernels`` and ``EngineConfig.blas_rule`` are the settings; :meth:`KernelSet.resolve` turns them,
with the models (their device, head dims and layer kinds), into one frozen per-op choice that
:func:`ddtree.engine.build.build` hands to :class:`~ddtree.engine.runner.ModelRunner`. The runner passes it down
explicitly to every call it governs:

- the model forwards take the whole set (``TargetModel.forward(..., kernels=)``, ``DFlashDrafter.draft_hidden`` and
  ``append_context``), read ``fused_ops``, ``draft_attention`` and ``blas_rule`` and hand each layer its
  ``kernels=`` bool (:mod:`ddtree.models.layers`: fusing changes only the weights' layout, no module remembers a
  choice);
- the verify's and prefill's attention is chosen by what the runner passes the target: a ``TreeVisibility`` (the
  tree-attention kernel) when ``tree_attention``, else the dense mask;
- the core's functions get one bool each (``build_trees(fast_topk=, fast_select=)``, ``walk_trees(kernel=)``,
  ``compact_cache(kernel=)``).

Nothing below reads a setting of its own and no module global is flipped; whether a chosen kernel *can* run on a
given tensor stays :func:`ddtree.triton_runtime.can_run`'s answer (so the CPU tests run the same choice through
Triton's interpreter). This module imports nothing from ddtree at run time, so the models may name the type.

Why one record: the choice used to fan out into five differently named booleans, module state and a global, and a
reader could not see in one place which ops of a round run which code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddtree.engine.config import EngineConfig


@dataclass(frozen=True)
class KernelSet:
    """Per op: True = the Triton kernel (where it can run), False = the torch reference."""

    fused_ops: bool  # RMSNorm, residual + RMSNorm, q/k norm + RoPE, SiLU x up, fp8 input quantisation (models.fused_ops)
    tree_attention: bool  # the verify's and prefill's attention through models.tree_attention (no dense mask)
    draft_attention: bool  # the drafter's block attention through the same kernel
    vocab_topk: bool  # tree building's vocabulary pass: top-k + logsumexp (speculative.vocab_topk)
    tree_select: bool  # tree building's node selection (speculative.tree_select)
    walk: bool  # the verification walk (speculative.walk)
    compaction: bool  # the accepted K/V compaction (speculative.compaction)
    # Not a Triton kernel: the model forwards' matmuls through cuBLASLt at the row counts where the H200 ran them
    # faster (models.gemm_backend); False = torch's default cuBLAS for every matmul (an A/B of the rule).
    blas_rule: bool = True
    # Exact mode (EngineConfig.exact): the target's forward runs models.exact_forward (fixed-order matmuls and
    # attention, models.batch_invariant) from the tree visibility, so tree_attention is on too (no dense mask); Triton
    # kernels where they can run, else the one-row-at-a-time torch path. The drafter is unaffected.
    exact: bool = False
    # Exact mode's weights (N, K, pad) that torch's cuBLAS computed row-invariantly at every row count this engine
    # runs, calls of fewer rows padded to pad (1: none), measured at build (models.exact_blas; CUDA only): those go
    # to cuBLAS, every other matmul to the Triton kernel.
    exact_blas: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def torch(cls, *, blas_rule: bool = True) -> KernelSet:
        """Every op on its torch reference (``blas_rule`` picks between torch's own cuBLAS front ends)."""
        return cls(**{f.name: False for f in fields(cls) if f.type in (bool, "bool") and f.name != "blas_rule"},
                   blas_rule=blas_rule)

    @classmethod
    def resolve(cls, config: EngineConfig, target, drafter) -> KernelSet:
        """The set an engine runs: ``config.gpu_kernels`` narrowed to what the models take (the tree-attention
        kernel's head dims and, for the drafter, layers that see their whole block), and ``config.blas_rule``."""
        if config.exact:
            return replace(cls._resolve(config, target, drafter), tree_attention=True, exact=True)
        return cls._resolve(config, target, drafter)

    @classmethod
    def _resolve(cls, config: EngineConfig, target, drafter) -> KernelSet:
        if not config.gpu_kernels:
            return cls.torch(blas_rule=config.blas_rule)
        return cls(
            fused_ops=True,
            tree_attention=target.supports_tree_attention(),
            draft_attention=drafter is not None and drafter.supports_tree_attention(),
            vocab_topk=True,
            tree_select=True,
            walk=True,
            compaction=True,
            blas_rule=config.blas_rule,
        )

    def describe(self) -> dict[str, bool | list]:
        """The choice per op (``Engine.info()``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
