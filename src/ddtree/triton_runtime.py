"""The one place that imports Triton and decides whether a Triton kernel can run on a given tensor.

Why: ddtree's kernels (:mod:`ddtree.models.fused_ops`, :mod:`ddtree.models.tree_attention`,
:mod:`ddtree.speculative.vocab_topk`) are optional speed-ups with torch fallbacks. Whether to *use* them is the caller's
explicit choice (the engine's ``KernelSet``, :mod:`ddtree.engine.kernels`, passed down: a forward's ``kernels=``,
a target forward given a ``TreeVisibility``, ``build_trees(..., fast_topk=)``); this module only answers whether they
*can* run, the same way for all three, so no kernel module reads settings of its own. How they launch on a given
device (tile and split tables measured on the H200) is :mod:`ddtree.tuning`.

Usage::

    from ddtree.triton_runtime import can_run, tl, triton

    if triton is not None:          # define kernels only where Triton imports
        @triton.jit
        def _kernel(...): ...

    if use_kernel and can_run(x):   # the caller's choice, and the kernel can run on x
        ...

Triton's CPU interpreter (``TRITON_INTERPRET=1``, Triton's own setting) replaces every kernel defined while it is
on by a numpy emulation; it is read once, when this module is imported, into :data:`INTERPRETED`. Under the
interpreter no kernel runs on CUDA tensors (emulated kernels would be far too slow to serve), and CPU tensors run
them only inside :func:`cpu_interpreter` - how the tests check on a CPU machine the code a GPU runs. Without the
interpreter kernels run on CUDA tensors only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: every kernel has a torch path
    triton = None
    tl = None
try:  # host-side TMA descriptors (Triton 3.4 and later); a kernel that loads through them needs a fallback
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

__all__ = ["FP_FUSION", "INTERPRETED", "TensorDescriptor", "can_run", "cpu_interpreter", "masked_if", "tl",
           "triton"]

FP_FUSION: bool = True
"""``enable_fp_fusion=`` of every launch of ddtree's kernels: they compile as they were timed and checked.

Why explicit: with fusion on, LLVM may contract ``a * b + c`` into one FMA, which rounds once instead of twice.
The tile tables of :mod:`ddtree.tuning` were timed, and the exact-mode bit tests run on the GPU, with fusion on:
Triton's default through 3.9, which warns that the default turns off in 3.10. A launch that names the option
keeps the kernels' speed and rounding whatever Triton's default; ``TRITON_FORCE_DISABLE_FP_FUSION=1`` (Triton's
own setting) still turns fusion off for a debugging run."""


def _interpreter_on() -> bool:
    """Whether ``triton.jit`` defines interpreted kernels (what it checks itself; knobs exist from Triton 3.4)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETED: bool = _interpreter_on()

# cpu_interpreter() pushes onto this stack: a list (not a rebound global) so nested contexts restore correctly.
_CPU_INTERPRETER: list[bool] = []


@contextmanager
def cpu_interpreter(active: bool = True) -> Iterator[None]:
    """Within this context (tests only), :func:`can_run` accepts CPU tensors when :data:`INTERPRETED`, so kernels
    run on them through Triton's interpreter; ``active=False`` turns that off again inside an outer context.
    Without the interpreter it changes nothing (compiled kernels never take CPU tensors)."""
    _CPU_INTERPRETER.append(active)
    try:
        yield
    finally:
        _CPU_INTERPRETER.pop()


def can_run(t: Tensor) -> bool:
    """Whether a Triton kernel can run on tensors like ``t``: Triton imported, and ``t`` is a CUDA tensor with
    compiled kernels, or a CPU tensor with interpreted kernels inside :func:`cpu_interpreter`."""
    if triton is None:
        return False
    if t.is_cuda:
        return not INTERPRETED
    return t.device.type == "cpu" and INTERPRETED and bool(_CPU_INTERPRETER) and _CPU_INTERPRETER[-1]


if triton is not None:

    @triton.jit
    def masked_if(cond, mask):
        """``mask & cond`` for a scalar ``cond`` (a per-program condition) and a block ``mask`` [BLOCK] of int1.

        Why a select instead of ``&``: Triton's interpreter (3.9 at least) keeps a scalar comparison's data in its
        operands' integer type, so ``scalar_cmp & block_mask`` splats int32 data and every load or store then
        refuses it ("mask has unsupported dtype"). ``tl.where`` broadcasts the condition without that, and
        compiles to the same predicate, so kernels that use it read the same on every Triton from 3.2 on."""
        return tl.where(cond, mask, False)

else:  # no Triton: kernels are not defined, but modules that name the helper still import
    masked_if = None
