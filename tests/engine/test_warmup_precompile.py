"""The warm-up's precompilation worker (ddtree.engine.precompile.compile_spec): a variant it compiles from Triton's
own specialisation data is what a later ``triton.compile`` of the same source finds in the on-disk cache, and
``on_disk`` tells before and after.

No GPU needed: Triton compiles for an explicit H100/H200 target (sm_90) without a device. The device-side half
(the binder's specialisation data, the warm-up's disk hits) is measured on the H200 (docs/benchmarks.md,
"Start-up warm-up")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

# Run in a fresh interpreter without TRITON_INTERPRET (the CPU suite interprets kernels; the worker compiles them)
SCRIPT = textwrap.dedent("""
    import inspect, sys
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import serialize_specialization_data

    from ddtree.engine.precompile import compile_spec
    from ddtree.models import tree_attention

    if "nvidia" not in triton.backends.backends:
        print("no CUDA backend"); sys.exit(3)
    fn = tree_attention._write_kv_kernel
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 1})
    sig = {n: ("*bf16" if n[0] in "kv" else "*i64") if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    sig["HEAD_DIM"] = "constexpr"
    head_dim = (fn.arg_names.index("HEAD_DIM"),)
    attrs = {(0,): [["tt.divisibility", 16]]}
    extra = {"target": target} if "target" in inspect.signature(serialize_specialization_data).parameters else {}
    data = serialize_specialization_data("ddtree.models.tree_attention._write_kv_kernel", sig, {head_dim: 128},
                                         attrs, options, "key", **extra)
    from ddtree.engine.precompile import on_disk

    spec = ("ddtree.models.tree_attention", "_write_kv_kernel", data)
    print("before", on_disk(*spec, target))
    compile_spec(*spec, target)
    print("after", on_disk(*spec, target))
    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    triton.compile(ASTSource(fn, sig, {head_dim: 128}, attrs), target=target, options=options.__dict__)
    # another constant is another variant: compiled, not found (the check can fail)
    triton.compile(ASTSource(fn, sig, {head_dim: 64}, attrs), target=target, options=options.__dict__)
    print("hits", hits)
""")


@pytest.mark.slow
def test_worker_compiles_into_the_disk_cache_under_the_jit_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 3:
        pytest.skip("Triton without its CUDA backend")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hits [True, False]" in proc.stdout, proc.stdout
    assert "before False" in proc.stdout and "after True" in proc.stdout, proc.stdout  # the disk lookup
    assert any(tmp_path.iterdir())  # the worker stored its variant on disk


def test_a_failing_precompilation_is_logged_and_never_raises(caplog):
    from ddtree.engine.precompile import precompile

    def broken() -> list:
        raise RuntimeError("binder refused")

    out = precompile(broken)
    assert out.compiled == out.variants == out.workers == 0
    assert "precompilation skipped (RuntimeError: binder refused)" in caplog.text
