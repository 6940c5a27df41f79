"""Registers and spills of exact mode's attention kernel for sm_90a, compiled here without a GPU.

Why: a kernel change that adds live tensors (a second dot's accumulators, a running state) can push the kernel past
255 registers a thread into local-memory spills, which a device call then pays for in time without saying why. This
compiles ``batch_invariant.attention_kernels._attention_kernel`` with Triton's own compiler for an H100/H200 target (no driver needed)
and runs the ``ptxas`` Triton ships on the PTX, so a change can be checked before it meets a GPU. The integer
arguments are given as the engine's launches specialise them (pointers and strides divisible by 16): without that
hint Triton cannot prove the loads' alignment and the same kernels spill kilobytes.

    python benchmarks/exact_attention_registers.py                 # the launches the engine's rules pick
    python benchmarks/exact_attention_registers.py --file OTHER.py # a single-file batch_invariant.py (before the package)

Each line: launch (fused / split), rows a program (``BLOCK_M``), small last tiles compiled in or not, warps and
pipeline stages, then registers a thread, spill stores and loads (bytes), the shared memory Triton asked for, and
the dot lowering (``wgmma`` for 64-row programs and up, ``mma`` below). The numbers are those of the Triton this
runs under: for the GPU image's, run it from a virtual environment with ``pip install triton==3.6.0`` beside torch.
On 2026-12-06 with Triton 3.6: every launch at 220-255 registers, 0-116 bytes of spill stores (the fused launch's
64-row programs the most); 64 + 16-row programs (extra rows, tried and removed that day) spilled 996 bytes fused.
Triton 3.9 (a fresh install that day) gives the same launches 0-180 bytes of spill stores.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import tempfile
from types import ModuleType

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "slots_ptr": "*i64", "start_ptr": "*i64",
            "pos_ptr": "*i64", "anc_ptr": "*i32", "chain_ptr": "*i32", "tail_ptr": "*i32", "out_ptr": "*bf16",
            "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "state_ptr": "*fp32"}
# (fused, BLOCK_M, QT, small last tiles): the Qwen3-8B stand-in's launches (G = 4, head dim 128)
LAUNCHES = ((True, 32, 8, False), (False, 32, 8, False), (True, 32, 8, True), (False, 32, 8, True),
            (True, 64, 16, False), (False, 64, 16, False), (True, 64, 16, True), (False, 64, 16, True))


def load(path: str | None) -> tuple[ModuleType, ModuleType]:
    """(the module holding ``_attention_kernel``, the one holding the ``ATTN_*`` constants): this tree's
    ``attention_kernels`` and ``attention_rules``, or a single-file ``batch_invariant.py`` from before the package
    (``git show C:src/ddtree/models/batch_invariant.py``), which holds both."""
    if path is None:
        from ddtree.models.batch_invariant import attention_kernels, attention_rules

        return attention_kernels, attention_rules
    spec = importlib.util.spec_from_file_location("batch_invariant_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, mod


def _ptxas(ptx: str) -> str:
    """ptxas' verbose report on one PTX file, from the first ptxas Triton ships that takes its PTX version (newer
    Tritons emit PTX their plain ``ptxas`` is too old for and ship ``ptxas-blackwell`` beside it)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    errors = []
    for name in ("ptxas", "ptxas-blackwell"):
        done = subprocess.run([os.path.join(bin_dir, name), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return done.stderr
        errors.append(f"{name}: {done.stderr.strip()[:200]}")
    raise SystemExit("no ptxas took the PTX: " + "; ".join(errors))


def usage(kernels: ModuleType, rules: ModuleType, fused: bool, block_m: int, qt: int, small: bool, warps: int = 4,
          stages: int = 2) -> dict:
    """Compile one launch of ``kernels._attention_kernel`` (constants from ``rules``) for sm_90a and read ptxas'
    report."""
    fn = kernels._attention_kernel
    names = fn.arg_names
    const = dict(HEAD_DIM=128, BLOCK_M=block_m, QT=qt, BLOCK_N=rules.ATTN_BLOCK_N,
                 TILES_PER_SPLIT=rules.ATTN_SPLIT_KEYS // rules.ATTN_BLOCK_N, SUM_COLS=rules.ATTN_SUM_COLS, TAIL_ROWS=16,
                 CHUNK=4, SMALL_M=16, SMALL=small, FUSED=fused, EMULATE=False, PRECISION="tf32")
    const = {k: v for k, v in const.items() if k in names}
    missing = [n for n in names if n not in const and n not in POINTERS and fn.params[names.index(n)].is_constexpr]
    if missing:
        raise SystemExit(f"constexprs this tool does not set: {missing} (update LAUNCHES / usage for the kernel)")
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "fp32" if n == "scale_log2" else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in POINTERS or n.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        report = _ptxas(f.name)
    finally:
        os.unlink(f.name)

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        return int(found.group(1)) if found else -1

    return {"fused": fused, "block_m": block_m, "small": small, "warps": warps, "stages": stages,
            "registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared": kernel.metadata.shared,
            "dot": "wgmma" if "warp_group_dot" in kernel.asm["ttgir"] else "mma"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default=None, help="a single-file batch_invariant.py (before the package) to compile instead")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    args = ap.parse_args()
    kernels, rules = load(args.file)
    for fused, block_m, qt, small in LAUNCHES:
        u = usage(kernels, rules, fused, block_m, qt, small, args.warps, args.stages)
        print(f"{'fused' if fused else 'split':5} {block_m:3} rows, small {'on ' if small else 'off'}, "
              f"{u['warps']} warps, {u['stages']} stages: {u['registers']} registers, spills {u['spill_stores']} / "
              f"{u['spill_loads']} B, shared {u['shared']} B, {u['dot']}", flush=True)


if __name__ == "__main__":
    main()
