"""Files shipped inside the package: the embedded demo pair, the default target and drafter of every command.

``demo/target`` is a Hugging Face ``Qwen3ForCausalLM`` directory (config, sharded bf16 safetensors, tokenizer,
model card) and ``demo/drafter`` its DFlash drafter in z-lab format, both trained by ``ddtree train`` (see their
``README.md`` and ``scripts/train_demo.sh``). They exist so that a fresh, offline machine shows real speculative
speed-ups without downloading anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ddtree.errors import CheckpointError

__all__ = ["demo_drafter_path", "demo_target_path"]


def _demo_dir(name: str) -> Path:
    path = Path(str(resources.files("ddtree") / "assets" / "demo" / name))
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"the embedded demo {name} is missing from {path} (a broken install or a checkout without the assets); "
            "reinstall ddtree or pass --target/--draft explicitly"
        )
    return path


def demo_target_path() -> Path:
    """Directory of the embedded demo target (Hugging Face format, tokenizer included)."""
    return _demo_dir("target")


def demo_drafter_path() -> Path:
    """Directory of the embedded demo DFlash drafter (z-lab format)."""
    return _demo_dir("drafter")
