"""The whole training pipeline at toy sizes on the CPU: tokenizer -> target -> continuations -> drafter."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.models import load_drafter, load_target
from ddtree.train.corpus import load_corpus
from ddtree.train.data import ContinuationSettings, load_continuations, make_continuations
from ddtree.train.drafter import preset as drafter_preset
from ddtree.train.drafter import train_drafter
from ddtree.train.target import preset as target_preset
from ddtree.train.target import train_target
from ddtree.train.tokenizer import TokenizerTrainConfig, save_tokenizer, train_tokenizer


@pytest.mark.slow
def test_smoke_pipeline_trains_and_saves_a_loadable_pair(tmp_path) -> None:
    corpus = load_corpus(max_files=40, held_out_fraction=0.15)
    save_tokenizer(train_tokenizer((f.text for f in corpus.train), TokenizerTrainConfig(vocab_size=320)),
                   tmp_path / "tok")

    config = target_preset("smoke", max_steps=24, seq_len=96, eval_every=8)
    result = train_target(corpus, tmp_path / "tok", tmp_path / "target", config, device="cpu",
                          log_path=tmp_path / "target.json")
    records = result["records"]
    assert [r["step"] for r in records] == [8, 16, 24]
    assert records[-1]["held_out_loss"] < records[0]["held_out_loss"]
    assert result["results"]["steps"] == 24
    assert json.loads((tmp_path / "target.json").read_text())["results"]["held_out_perplexity"] > 1

    # The saved target reads back identically through transformers and through our loader.
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "target"), dtype=torch.float32).eval()
    ours = load_target(tmp_path / "target")
    ids = torch.randint(4, 320, (1, 20))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, ours.forward_train(ids).logits, atol=1e-4, rtol=1e-4)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "target")).mask_token_id == 1

    settings = ContinuationSettings(num_prompts=12, prompt_len=24, new_tokens=24, batch_size=6)
    make_continuations(corpus, tmp_path / "target", tmp_path / "data.safetensors", settings, device="cpu")
    held = ContinuationSettings(num_prompts=2, prompt_len=24, new_tokens=20, batch_size=2, split="held-out")
    make_continuations(corpus, tmp_path / "target", tmp_path / "eval.safetensors", held, device="cpu")
    data = load_continuations(tmp_path / "data.safetensors")
    assert data.tokens.shape == (12, 48) and data.prompt_len == 24

    dconfig = drafter_preset("smoke", max_steps=30, eval_every=10, anchors_per_row=8, rows_per_step=4)
    out = train_drafter(tmp_path / "target", [tmp_path / "data.safetensors"], tmp_path / "drafter", dconfig,
                        eval_paths=[tmp_path / "eval.safetensors"], device="cpu", log_path=tmp_path / "d.json")
    losses = [r["loss"] for r in out["records"]]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert out["results"]["eval"][str(tmp_path / "eval.safetensors")]["accept_length"] >= 1.0
    drafter = load_drafter(tmp_path / "drafter")
    assert drafter.config.block_size == 16
    assert drafter.config.target_layer_ids == (1, 3)
    drafter.check_target(ours)
