"""Every launch of a ddtree Triton kernel names ``enable_fp_fusion=FP_FUSION`` (``ddtree.triton_runtime``).

Why a source check: the option changes what the compiler emits on a GPU (FMA contraction), which Triton's CPU
interpreter does not model, so no CPU run can tell a launch that forgets it. The kernels' tile tables were timed and
their bits checked with fusion on; Triton 3.10 turns the default off, so a launch that leaves it to the default
would silently change speed and rounding there.

The scan: every function under src/ddtree decorated with ``triton.jit`` is a kernel; a launch is ``kernel[grid](...)``
or ``_launcher(kernel, grid, ...)(...)`` (tree attention's launch-or-compile helper).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ddtree

ROOT = Path(ddtree.__file__).parent


def _is_jit(decorator: ast.expr) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)``."""
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit"


def _kernels(tree: ast.Module) -> set[str]:
    """Names of the ``triton.jit`` functions ``tree`` defines."""
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list)}


def _launches(tree: ast.Module, kernels: set[str]) -> list[tuple[str, ast.Call]]:
    """(kernel name, the launch call) for every launch in ``tree`` of a kernel named in ``kernels`` (those of the
    whole package: a module may launch kernels another defines, as exact mode's matmul and attention do)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name) and func.value.id in kernels:
            found.append((func.value.id, node))
        elif (isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "_launcher"
              and func.args and isinstance(func.args[0], ast.Name) and func.args[0].id in kernels):
            found.append((func.args[0].id, node))
    return found


def test_every_kernel_launch_names_fp_fusion():
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.rglob("*.py"))}
    kernels = set().union(*(_kernels(tree) for tree in trees.values()))
    launches = []
    for path, tree in trees.items():
        for name, call in _launches(tree, kernels):
            launches.append((f"{path.relative_to(ROOT)}:{call.lineno} {name}", call))
    # The scan must find the package's launches (fused ops, matmul, attention, tree attention, the tree kernels),
    # or a change in how kernels are launched would make this test pass on nothing.
    assert len(launches) >= 19, [where for where, _ in launches]
    missing = [where for where, call in launches
               if not any(k.arg == "enable_fp_fusion" and isinstance(k.value, ast.Name) and k.value.id == "FP_FUSION"
                          for k in call.keywords)]
    assert not missing, f"launches without enable_fp_fusion=FP_FUSION: {missing}"
