"""Tokenizers and chat templates come from transformers' ``AutoTokenizer``; we only resolve the checkpoint the
same way the models do and turn failures into a ``CheckpointError`` that names the directory. transformers is
imported on first use because it costs about a second, which every ``import ddtree.models`` would otherwise pay.

The demo pair's tokenizer is the one exception: it is ours (``ddtree train`` writes a plain ``tokenizers`` file and a
config naming ``PreTrainedTokenizerFast``), so it is loaded through that class, which is what ``AutoTokenizer``
returns for it (``tests/models/test_loading.py`` compares the two). ``AutoTokenizer`` reads the model's config
through ``AutoConfig``, whose import pulls in ``transformers.generation`` (and scikit-learn, where it is installed):
on the H200 image, which writes no bytecode, that was 9.3 s of a 36.7 s warm start of the stand-in engine (2026-12-02,
docs/benchmarks.md, "Start-up warm-up"); the class alone imports in about a second. Every other checkpoint keeps
``AutoTokenizer``, whose choice of class depends on the model type and the transformers version."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddtree.errors import CheckpointError
from ddtree.models.loading import resolve_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path_or_id: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template, when the checkpoint has one) of a local directory or hub id."""
    directory = resolve_checkpoint(path_or_id)
    try:
        if is_demo_tokenizer(directory):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(directory))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{directory}: no usable tokenizer ({type(exc).__name__}: {exc}); the directory needs "
            "tokenizer.json or tokenizer_config.json with its vocabulary files"
        ) from None


def is_demo_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` is the packaged demo target's (the only one loaded without ``AutoTokenizer``)."""
    from ddtree.assets import demo_target_path

    try:
        return Path(directory).resolve() == demo_target_path().resolve()
    except OSError:
        return False
