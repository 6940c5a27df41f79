"""Tokenizers and chat templates come from transformers' ``AutoTokenizer``; we only resolve the checkpoint the
same way the models do and turn failures into a ``CheckpointError`` that names the directory. transformers is
imported on first use because it costs about a second, which every ``import ddtree.models`` would otherwise pay."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddtree.errors import CheckpointError
from ddtree.models.loading import resolve_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path_or_id: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template, when the checkpoint has one) of a local directory or hub id."""
    from transformers import AutoTokenizer

    directory = resolve_checkpoint(path_or_id)
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{directory}: no usable tokenizer ({type(exc).__name__}: {exc}); the directory needs "
            "tokenizer.json or tokenizer_config.json with its vocabulary files"
        ) from None
