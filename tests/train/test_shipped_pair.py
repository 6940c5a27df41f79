"""The embedded demo pair: shapes the stand-in relies on, size limits, loading through transformers and ours,
and greedy losslessness through the engine."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.assets import demo_drafter_path, demo_target_path
from ddtree.models import default_target_layer_ids, load_drafter, load_target

MB = 1_000_000


def test_sizes_fit_the_package_limits() -> None:
    files = [p for d in (demo_target_path(), demo_drafter_path()) for p in d.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 24 * MB
    for p in files:
        assert p.stat().st_size <= 15 * MB, p.name
    names = {p.name for p in demo_target_path().iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in demo_drafter_path().iterdir()}


def test_target_has_the_fixed_demo_shapes() -> None:
    c = json.loads((demo_target_path() / "config.json").read_text())
    assert c["architectures"] == ["Qwen3ForCausalLM"]
    shape = {k: c[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads",
                               "num_hidden_layers", "intermediate_size", "vocab_size", "tie_word_embeddings",
                               "max_position_embeddings")}
    assert shape == {"hidden_size": 256, "num_attention_heads": 2, "head_dim": 128, "num_key_value_heads": 1,
                     "num_hidden_layers": 8, "intermediate_size": 768, "vocab_size": 8192,
                     "tie_word_embeddings": True, "max_position_embeddings": 16384}


def test_drafter_is_z_lab_format_for_this_target() -> None:
    c = json.loads((demo_drafter_path() / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(demo_target_path()))
    assert c["architectures"] == ["DFlashDraftModel"]
    assert c["dflash_config"]["block_size"] == 16 and c["block_size"] == 16
    assert (c["hidden_size"], c["head_dim"]) == (256, 128)
    assert c["num_hidden_layers"] in (2, 3)
    assert tuple(c["dflash_config"]["target_layer_ids"]) == default_target_layer_ids(8, c["num_hidden_layers"])
    assert c["dflash_config"]["mask_token_id"] == tok.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")


def test_target_loads_through_transformers_and_ours_identically() -> None:
    hf = AutoModelForCausalLM.from_pretrained(str(demo_target_path()), dtype=torch.float32).eval()
    ours = load_target(demo_target_path())
    tok = AutoTokenizer.from_pretrained(str(demo_target_path()))
    ids = torch.tensor([tok.encode("import os\n\ndef main(argv):\n    for name in argv:\n")])
    with torch.no_grad():
        a = hf(input_ids=ids).logits
        b = ours.forward_train(ids).logits
    assert ((a - b).norm() / a.norm()) < 1e-4
    load_drafter(demo_drafter_path()).check_target(ours)


def test_target_continues_code_with_code() -> None:
    """A trained model, not noise: after a ``for`` header the greedy continuation is an indented body line."""
    tok = AutoTokenizer.from_pretrained(str(demo_target_path()))
    model = AutoModelForCausalLM.from_pretrained(str(demo_target_path()), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("def total(items):\n    result = 0\n    for item in items:")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:])
    assert text.startswith("\n        "), text


@pytest.mark.slow
def test_greedy_speculative_outputs_equal_plain_decoding() -> None:
    from ddtree.engine import Engine
    from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
    from ddtree.engine.config import EngineConfig

    engine = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=512, max_budget=32))
    engine.start()
    try:
        prompts = ["import json\n\n\ndef load(path):\n", "class Stack:\n    def __init__(self):\n",
                   "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
        sampling = SamplingParams(max_tokens=48, ignore_eos=True)
        outputs = {}
        for name, tree in [("ar", TreeSettings(method="ar")), ("dflash", TreeSettings(method="dflash")),
                           ("ddtree", TreeSettings(method="ddtree", budget=32))]:
            outs = engine.generate([GenerationRequest(prompt=p, tree=tree, sampling=sampling) for p in prompts])
            outputs[name] = [o.token_ids for o in outs]
            assert all(len(o.token_ids) == 48 for o in outs)
        assert outputs["dflash"] == outputs["ar"]
        assert outputs["ddtree"] == outputs["ar"]
    finally:
        engine.shutdown()
