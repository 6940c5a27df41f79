"""The tokenizer: special ids fixed, byte-level round trip, loadable by transformers with its chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ddtree.errors import ConfigError
from ddtree.train.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerTrainConfig,
    load_raw_tokenizer,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)

_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
] * 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    tokenizer = train_tokenizer(_TEXTS, TokenizerTrainConfig(vocab_size=300))
    save_tokenizer(tokenizer, directory, model_max_length=2048)
    return tokenizer, directory


def test_special_tokens_take_the_first_ids(saved) -> None:
    tokenizer, _ = saved
    assert [tokenizer.id_to_token(i) for i in range(4)] == list(SPECIAL_TOKENS)
    assert special_token_ids(tokenizer) == {"eos": 0, "mask": 1, "im_start": 2, "im_end": 3}
    assert tokenizer.get_vocab_size() == 300


def test_merges_learn_the_corpus(saved) -> None:
    tokenizer, _ = saved
    text = "    return a + b\n"
    assert len(tokenizer.encode(text).ids) < len(text.encode("utf-8")) / 2


def test_transformers_loads_it_and_round_trips_any_text(saved) -> None:
    _, directory = saved
    tok = AutoTokenizer.from_pretrained(str(directory))
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 0, 1)
    assert tok.bos_token is None
    assert tok.model_max_length == 2048
    for text in ["x = 1\n\tif y:  pass", "naïve ünïcödé → ∑ 🐍", "<|mask|> stays special"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode("a<|mask|>b", add_special_tokens=False)[1] == 1
    # the raw tokenizer (used for training data) and transformers agree token for token
    raw = load_raw_tokenizer(directory)
    sample = "def f(x):\n    return x ** 2  # square\n"
    assert raw.encode(sample, add_special_tokens=False).ids == tok.encode(sample, add_special_tokens=False)


def test_chat_template_renders_chatml(saved) -> None:
    _, directory = saved
    tok = AutoTokenizer.from_pretrained(str(directory))
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_rejects_a_vocabulary_too_small_for_bytes_and_specials(tmp_path) -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        TokenizerTrainConfig(vocab_size=200)
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_raw_tokenizer(tmp_path)
