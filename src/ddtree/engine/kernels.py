"""The one kernel switch: which op of a round runs a Triton kernel, resolved once per engine and passed down.

``EngineConfig.gpu_kernels`` is the setting; :meth:`KernelSet.resolve` turns it, with the models (their device,
head dims and layer kinds), into one frozen per-op choice that :func:`ddtree.engine.build.build` hands to
:func:`~ddtree.models.fuse_projections` and :class:`~ddtree.engine.runner.ModelRunner`; the runner passes each
field to the call it governs (``build_trees(fast_topk=, fast_select=)``, ``walk_trees(kernel=)``, ``compact_cache(kernel=)``,
``draft_logits(tree_kernel=)``, and the dense mask built or not for the verify). Nothing below reads a setting of
its own; whether a chosen kernel *can* run on a given tensor stays :func:`ddtree.triton_runtime.can_run`'s answer
(so the CPU tests run the same choice through Triton's interpreter).

Why one record: the choice used to fan out into five differently named booleans, and a reader could not see in one
place which ops of a round run which code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelSet:
    """Per op: True = the Triton kernel (where it can run), False = the torch reference."""

    fused_ops: bool  # RMSNorm, residual + RMSNorm, q/k norm + RoPE, SiLU x up in fused layers (models.fused_ops)
    tree_attention: bool  # the verify's and prefill's attention through models.tree_attention (no dense mask)
    draft_attention: bool  # the drafter's block attention through the same kernel
    vocab_topk: bool  # tree building's vocabulary pass: top-k + logsumexp (speculative.vocab_topk)
    tree_select: bool  # tree building's node selection (speculative.tree_select)
    walk: bool  # the verification walk (speculative.walk)
    compaction: bool  # the accepted K/V compaction (speculative.compaction)

    @classmethod
    def torch(cls) -> KernelSet:
        """Every op on its torch reference."""
        return cls(**{f.name: False for f in fields(cls)})

    @classmethod
    def resolve(cls, gpu_kernels: bool, target, drafter) -> KernelSet:
        """The set an engine runs: ``gpu_kernels`` (``EngineConfig.gpu_kernels``) narrowed to what the models take
        (the tree-attention kernel's head dims and, for the drafter, layers that see their whole block)."""
        if not gpu_kernels:
            return cls.torch()
        return cls(
            fused_ops=True,
            tree_attention=target.supports_tree_attention(),
            draft_attention=drafter is not None and drafter.supports_tree_attention(),
            vocab_topk=True,
            tree_select=True,
            walk=True,
            compaction=True,
        )

    def describe(self) -> dict[str, bool]:
        """The choice per op (``Engine.info()``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
