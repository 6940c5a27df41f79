"""The demo pair's tokenizer: byte-level BPE trained with Hugging Face ``tokenizers`` on the corpus' train split.

Byte-level, so every string (any Unicode, any whitespace) round-trips; BPE merges learnt from Python code, so
indentation runs and common identifiers are single tokens. Saved as ``tokenizer.json`` plus a hand-written
``tokenizer_config.json`` (``PreTrainedTokenizerFast`` with the chat template inline) so
``transformers.AutoTokenizer`` loads it in both transformers 4.x and 5.x.

Special tokens take the first ids, in this order:

    0 <|endoftext|>  end of a document; the target's EOS and the pad token
    1 <|mask|>       the DFlash drafter's mask token (block positions 1..block_size-1)
    2 <|im_start|>   chat template: opens a message
    3 <|im_end|>     chat template: closes a message
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ddtree.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, MASK_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# A minimal ChatML template: enough for the server's chat endpoint to render messages; the demo target is a code
# completion model and was not trained on chat data.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_BYTE_ALPHABET = 256


@dataclass(frozen=True)
class TokenizerTrainConfig:
    """BPE training settings. ``vocab_size`` counts the special tokens and the 256 byte symbols."""

    vocab_size: int = 8192
    min_frequency: int = 2

    def __post_init__(self) -> None:
        smallest = _BYTE_ALPHABET + len(SPECIAL_TOKENS) + 1
        if self.vocab_size < smallest:
            raise ConfigError(f"vocab_size must be at least {smallest} (bytes + special tokens + one merge), got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ConfigError(f"min_frequency must be >= 1, got {self.min_frequency}")


def train_tokenizer(texts: Iterable[str], config: TokenizerTrainConfig = TokenizerTrainConfig()) -> Tokenizer:
    """Learn a byte-level BPE over ``texts`` (in the given order) with the special tokens at ids 0..3."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise ConfigError(f"special token {token!r} got id {tokenizer.token_to_id(token)}, expected {expected_id}")
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens by role (``eos``, ``mask``, ``im_start``, ``im_end``)."""
    roles = ("eos", "mask", "im_start", "im_end")
    return {role: tokenizer.token_to_id(token) for role, token in zip(roles, SPECIAL_TOKENS, strict=True)}


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path, *, model_max_length: int = 16384) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_raw_tokenizer(directory: str | Path) -> Tokenizer:
    """The ``tokenizers`` object saved by :func:`save_tokenizer` (fast batch encoding for training data)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"no tokenizer.json in {str(directory)!r}; run `ddtree train tokenizer --out DIR` first")
    return Tokenizer.from_file(str(path))
