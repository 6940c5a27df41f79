"""Training data: packing, window sampling, continuation generation against a no-cache greedy loop."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ddtree.errors import ConfigError
from ddtree.train.data import (
    ContinuationSettings,
    encode_documents,
    fixed_windows,
    generate_continuations,
    load_continuations,
    sample_windows,
    save_continuations,
)
from ddtree.train.tokenizer import TokenizerTrainConfig, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["import os\nprint(os.sep)\n", "x = [i for i in range(3)]\n"] * 10,
                           TokenizerTrainConfig(vocab_size=280))


def test_documents_are_packed_each_followed_by_eos(tokenizer) -> None:
    docs = ["a = 1\n", "print(a)\n", "z"]
    stream = encode_documents(tokenizer, docs)
    expected: list[int] = []
    for doc in docs:
        expected += tokenizer.encode(doc, add_special_tokens=False).ids + [0]
    assert stream.dtype == torch.int32
    assert stream.tolist() == expected


def test_sampled_windows_are_slices_of_the_stream_and_seeded() -> None:
    stream = torch.arange(1000, dtype=torch.int32) * 7
    a = sample_windows(stream, 16, 50, torch.Generator().manual_seed(3))
    b = sample_windows(stream, 16, 50, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    for row in a:
        start = int(row[0]) // 7
        assert torch.equal(row, stream[start:start + 50].long())
    with pytest.raises(ConfigError, match="fewer than one window"):
        sample_windows(stream, 1, 2000, torch.Generator())


def test_fixed_windows_are_disjoint_and_evenly_spaced() -> None:
    stream = torch.arange(1000, dtype=torch.int32)
    w = fixed_windows(stream, 100, 4)
    assert w[:, 0].tolist() == [0, 200, 400, 600]
    assert torch.equal(w[1], torch.arange(200, 300))
    assert fixed_windows(stream, 100, 50).shape == (10, 100)  # capped by what fits


def _tiny_lm(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # peaky logits: no float near-ties between the cached and uncached paths
        model.model.embed_tokens.weight.mul_(40)
    return model


def test_greedy_continuations_equal_a_no_cache_argmax_loop() -> None:
    model = _tiny_lm()
    prompts = torch.randint(0, 97, (5, 9), generator=torch.Generator().manual_seed(1))
    out = generate_continuations(model, prompts, 12, batch_size=2)
    assert out.shape == (5, 21)
    assert torch.equal(out[:, :9], prompts)
    with torch.no_grad():
        for row in range(5):
            ids = prompts[row:row + 1]
            for _ in range(12):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            assert torch.equal(out[row], ids[0])


def test_sampled_continuations_follow_the_generator() -> None:
    model = _tiny_lm()
    prompts = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(2))
    a = generate_continuations(model, prompts, 6, batch_size=3, temperature=1.0,
                               generator=torch.Generator().manual_seed(5))
    b = generate_continuations(model, prompts, 6, batch_size=3, temperature=1.0,
                               generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_continuation_files_round_trip(tmp_path) -> None:
    rows = torch.randint(0, 8192, (3, 20))
    save_continuations(tmp_path / "c.safetensors", rows, prompt_len=8)
    loaded = load_continuations(tmp_path / "c.safetensors")
    assert loaded.prompt_len == 8 and loaded.seq_len == 20
    assert torch.equal(loaded.tokens, rows)
    save_continuations(tmp_path / "bad.safetensors", rows, prompt_len=20)
    with pytest.raises(ConfigError, match="prompt_len 20"):
        load_continuations(tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError, match="does not exist"):
        load_continuations(tmp_path / "missing.safetensors")


def test_continuation_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="new_tokens"):
        ContinuationSettings(new_tokens=0)
    with pytest.raises(ConfigError, match="split"):
        ContinuationSettings(split="test")
