"""Registers and stack a thread of tree attention's combine kernel needs per tile, compiled for a GPU on any
machine (no device: Triton's compiler and its bundled ptxas, read back with its cuobjdump). Not under
``TRITON_INTERPRET`` (the kernels are then interpreted functions, which do not compile).

Why: the combine keeps all its unrolled partials' tiles in flight, so a tile too large for the register file
spills to local memory, and the kernel's time follows the spill, not its bytes; ``tuning.choose_combine_tile`` is
the rule that keeps the tiles within registers, and this is how its budget was set.

    python benchmarks/combine_registers.py                      # sm_90 (H100/H200), head_dim 128
    python benchmarks/combine_registers.py --arch 90 --head-dim 128 --unroll 5,9,17 --rows 16,32,64 --cols 16,32,64
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ddtree import tuning
from ddtree.models import tree_attention as ta

SIGNATURE = {"out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "stride_or": "i32", "stride_oh": "i32", "stride_ot": "i32", "T": "i32", "G": "i32", "num_kv": "i32",
             "rows_padded": "i32", "num_parts": "i32",
             "UNROLL": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_M": "constexpr"}


def resource_usage(unroll: int, rows: int, cols: int, head_dim: int, arch: int) -> dict[str, int]:
    """REG, STACK (bytes a thread) and the rest of cuobjdump's resource line for one combine variant."""
    source = ASTSource(fn=ta._tree_attention_combine_kernel, signature=SIGNATURE,
                       constexprs={"UNROLL": unroll, "HEAD_DIM": head_dim, "BLOCK_D": cols, "BLOCK_M": rows})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": tuning.COMBINE_WARPS})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "combine.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def ints(text: str) -> list[int]:
    """A comma-separated list of ints."""
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--unroll", default="3,5,9,17", help="the combine's unrolled partials (2^k + 1)")
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--cols", default="16,32,64")
    ap.add_argument("--json", default="", help="also write every row here")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud to silence its notice

    print("| unroll | rows x cols | elements a thread x unroll | registers | stack bytes | the rule's tile |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows_out = []
    for unroll, rows, cols in itertools.product(ints(args.unroll), ints(args.rows), ints(args.cols)):
        usage = resource_usage(unroll, rows, cols, args.head_dim, args.arch)
        per_thread = rows * cols // (32 * tuning.COMBINE_WARPS) * unroll
        rule = tuning.choose_combine_tile(rows, unroll, args.head_dim) == (rows, cols)
        print(f"| {unroll} | {rows} x {cols} | {per_thread} | {usage.get('REG')} | {usage.get('STACK')} | "
              f"{'yes' if rule else ''} |", flush=True)
        rows_out.append({"unroll": unroll, "rows": rows, "cols": cols, **usage})
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "head_dim": args.head_dim,
                                               "triton": triton.__version__, "tiles": rows_out}, indent=1))


if __name__ == "__main__":
    main()
