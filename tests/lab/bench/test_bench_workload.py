"""Workload validation and prompts of exact token length with unique prefixes (real tokenizers, re-encoded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.errors import ConfigError
from ddtree.lab.bench.workload import (
    MIN_REQUESTS,
    Workload,
    build_prompts,
    default_tokenizer_path,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """A WordPiece-free BPE tokenizer whose post-processor adds a BOS, like Llama's: lengths must count it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([Path(pytest.__file__).read_text() * 3], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    directory = tmp_path_factory.mktemp("bos_tokenizer")
    fast.save_pretrained(str(directory))
    loaded = AutoTokenizer.from_pretrained(str(directory))
    assert loaded("hello")["input_ids"][0] == 1
    return loaded


@pytest.mark.parametrize("length", [6, 60, 333, 1024])
def test_prompts_have_exact_length_after_re_encoding(tiny_tokenizer, bos_tokenizer, length):
    for tokenizer in (tiny_tokenizer, bos_tokenizer):
        prompts = build_prompts(tokenizer, length, 6, phase="r0-", seed=3, context=length, concurrency=2)
        for p in prompts:
            assert len(p.ids) == length
            assert list(tokenizer(p.text)["input_ids"]) == p.ids  # the text and the ids sent agree exactly


def test_bos_is_counted(bos_tokenizer):
    p = build_prompts(bos_tokenizer, 40, 1, phase="r0-", seed=0, context=40, concurrency=1)[0]
    assert p.ids[0] == bos_tokenizer.bos_token_id and len(p.ids) == 40


def test_prefixes_differ_within_the_first_tokens(tiny_tokenizer):
    prompts = build_prompts(tiny_tokenizer, 256, 40, phase="r0-", seed=0, context=256, concurrency=8)
    longest_shared = 0
    for i, a in enumerate(prompts):
        for b in prompts[i + 1:]:
            shared = next((k for k, (x, y) in enumerate(zip(a.ids, b.ids, strict=True)) if x != y), len(a.ids))
            longest_shared = max(longest_shared, shared)
    # a prefix cache (radix or 16-token blocks) can reuse at most a couple of leading tokens
    assert longest_shared <= 3


def test_phases_seeds_and_cells_never_share_prompts(tiny_tokenizer):
    def ids(**kw):
        args = {"phase": "r0-", "seed": 0, "context": 64, "concurrency": 4} | kw
        return {tuple(p.ids) for p in build_prompts(tiny_tokenizer, 64, 8, **args)}

    base = ids()
    assert base == ids()  # deterministic
    for other in (ids(phase="w"), ids(phase="r1-"), ids(seed=1), ids(concurrency=8)):
        assert not base & other


def test_too_short_for_unique_prompts_is_a_config_error(tiny_tokenizer):
    with pytest.raises(ConfigError, match="too short"):
        build_prompts(tiny_tokenizer, 1, 300, phase="r0-", seed=0, context=1, concurrency=1)


def test_workload_defaults_and_validation():
    w = Workload(contexts=(60, 1024), concurrency=(1, 8, 64), output_tokens=32).validated()
    assert [w.requests_for(c) for c in (1, 8, 64)] == [MIN_REQUESTS, 16, 128]
    assert w.cells() == [(60, 1), (60, 8), (60, 64), (1024, 1), (1024, 8), (1024, 64)]
    assert Workload(contexts=(8,), concurrency=(4,), output_tokens=1, num_requests=3).requests_for(4) == 3
    for bad in (dict(contexts=()), dict(contexts=(0,)), dict(concurrency=(1, -2)), dict(output_tokens=0),
                dict(repeats=0), dict(num_requests=0), dict(seed=-1), dict(contexts=(True,))):
        kwargs = {"contexts": (8,), "concurrency": (1,), "output_tokens": 4} | bad
        with pytest.raises(ConfigError):
            Workload(**kwargs).validated()


def test_load_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_load_tokenizer_from_directory(tiny_tokenizer_dir):
    tokenizer, name = load_tokenizer(str(tiny_tokenizer_dir))
    assert name == str(tiny_tokenizer_dir) and tokenizer("def")["input_ids"]


def test_missing_default_tokenizer_says_what_to_pass(monkeypatch, tmp_path):
    from ddtree.lab.bench import workload

    monkeypatch.setattr(workload, "default_tokenizer_path", lambda: tmp_path)
    with pytest.raises(ConfigError, match="pass --tokenizer"):
        load_tokenizer(None)


@pytest.mark.skipif(not (default_tokenizer_path() / "tokenizer.json").exists(),
                    reason="the embedded demo tokenizer is not in this checkout yet")
def test_default_is_the_demo_tokenizer_and_prompts_are_exact():
    tokenizer, name = load_tokenizer(None)
    assert name == str(default_tokenizer_path())
    for p in build_prompts(tokenizer, 100, 4, phase="r0-", seed=0, context=100, concurrency=2):
        assert len(tokenizer(p.text)["input_ids"]) == 100 == len(p.ids)


def test_code_prompts_are_exact_unique_and_come_from_the_held_out_split(tiny_tokenizer):
    from ddtree.lab.bench.workload import build_prompts, held_out_code
    from ddtree.train.corpus import load_corpus

    prompts = build_prompts(tiny_tokenizer, 200, 4, phase="r0-", seed=1, context=200, concurrency=4, text="code")
    assert all(len(p.ids) == 200 and tiny_tokenizer(p.text)["input_ids"] == p.ids for p in prompts)
    assert len({tuple(p.ids[:12]) for p in prompts}) == 4
    body = prompts[0].text.split("\n", 1)[1][:80]
    assert body in held_out_code()
    assert not any(body in f.text for f in load_corpus().train)


def test_unknown_text_source_is_rejected():
    with pytest.raises(ConfigError, match="text"):
        Workload(contexts=(8,), concurrency=(1,), output_tokens=4, text="poetry").validated()
