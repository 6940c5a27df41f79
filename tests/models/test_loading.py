"""Checkpoint formats: z-lab drafter round trips, block-size override, broken checkpoints, tokenizer, hub ids."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from model_helpers import random_drafter, random_target
from safetensors.torch import load_file, save_file

from ddtree.errors import CheckpointError
from ddtree.models import (
    DrafterConfig,
    TargetConfig,
    default_target_layer_ids,
    load_drafter,
    load_target,
    load_tokenizer,
    save_drafter,
    save_target,
)


def draft_once(drafter, target, block_size=None):
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    features = target.forward_train(ids, drafter.config.target_layer_ids).hidden
    cache = drafter.allocate_cache(1, 24)
    pos = torch.arange(8)[None]
    drafter.append_context(features[:, :8], pos, cache, torch.tensor([0]), pos)
    bs = block_size or drafter.config.block_size
    return drafter.draft_logits(target, ids[:, 8], torch.tensor([8]), cache, torch.tensor([0]), bs)


def edit_config(directory, change):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("overrides", [
    {},
    dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3, input_embedding_scale=2.0,
         output_multiplier=0.25, final_logit_softcapping=30.0, num_target_layers=4),
])
def test_drafter_zlab_round_trip(tmp_path, overrides):
    target, drafter = random_target(), random_drafter(**overrides)
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4 and config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == 96
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert set(load_file(tmp_path / "model.safetensors")) == set(drafter.state_dict())
    back = load_drafter(tmp_path)
    assert back.config == drafter.config
    assert torch.equal(draft_once(back, target), draft_once(drafter, target))


@pytest.mark.parametrize("where", ["top", "inner"])
def test_block_size_read_from_either_place(tmp_path, where):
    save_drafter(random_drafter(block_size=6), tmp_path)

    def keep_one(c):
        if where == "top":
            del c["dflash_config"]["block_size"]
        else:
            del c["block_size"]
    edit_config(tmp_path, keep_one)
    assert load_drafter(tmp_path).config.block_size == 6


def test_newer_inner_block_size_wins(tmp_path):
    save_drafter(random_drafter(block_size=6), tmp_path)
    edit_config(tmp_path, lambda c: c.update(block_size=99))
    assert load_drafter(tmp_path).config.block_size == 6


def test_block_size_override_warns_only_past_trained_depth(tmp_path):
    target, drafter = random_target(), random_drafter(block_size=4)
    save_drafter(drafter, tmp_path)
    with pytest.warns(UserWarning, match="untrained"):
        big = load_drafter(tmp_path, block_size=8)
    assert big.config.block_size == 8 and big.trained_block_size == 4
    assert draft_once(big, target).shape == (1, 7, 97)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = load_drafter(tmp_path, block_size=3)
    assert small.config.block_size == 3
    save_drafter(big, tmp_path / "again")  # an override is not a retraining
    assert json.loads((tmp_path / "again" / "config.json").read_text())["block_size"] == 4


def test_drafter_config_from_older_zlab_dict_derives_layer_ids():
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 5,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 40,
         "vocab_size": 97, "rope_theta": 1e6, "block_size": 16, "num_target_layers": 36,
         "dflash_config": {"mask_token_id": 95}, "sliding_window": None, "use_sliding_window": False}
    config = DrafterConfig.from_hf_dict(d)
    assert config.target_layer_ids == (1, 9, 17, 25, 33)  # the z-lab default for Qwen3-8B
    assert config.block_size == 16 and config.layer_types == ("full_attention",) * 5


def test_target_config_reads_classic_and_v5_rope_spellings():
    base = random_target().config.to_hf_dict()
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    classic = TargetConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}})
    v5 = TargetConfig.from_hf_dict({
        **{k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")},
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3},
    })
    assert classic == v5
    assert classic.rope_theta == 5e5 and classic.rope_scaling == {"rope_type": "llama3", **llama3}
    plain = TargetConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "default"}})
    assert plain.rope_scaling is None
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        TargetConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.5}, "rope_scaling": None})


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(28, 1) == (14,)
    assert default_target_layer_ids(4, 2) == (1, 1)


# --- broken checkpoints -------------------------------------------------------------------------------------


@pytest.fixture
def target_dir(tmp_path):
    save_target(random_target(), tmp_path / "t")
    return tmp_path / "t"


@pytest.fixture
def drafter_dir(tmp_path):
    save_drafter(random_drafter(), tmp_path / "d")
    return tmp_path / "d"


def rewrite_tensors(directory, change):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(target_dir):
    rewrite_tensors(target_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) layers\.1\.mlp\.up_proj\.weight \[48, 32\]"):
        load_target(target_dir)


def test_wrong_shape_names_tensor_and_both_shapes(drafter_dir):
    rewrite_tensors(drafter_dir, lambda t: t.update({"fc.weight": torch.zeros(32, 48)}))
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \[32, 48\], the config expects \[32, 64\]"):
        load_drafter(drafter_dir)


def test_unexpected_tensor_is_named_but_inv_freq_is_harmless(target_dir):
    rewrite_tensors(target_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    load_target(target_dir)
    rewrite_tensors(target_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['model\.layers\.0\.self_attn\.q_proj\.bias'\]"):
        load_target(target_dir)


def test_unknown_architecture_is_named(target_dir, drafter_dir):
    edit_config(target_dir, lambda c: c.update(architectures=["MistralForCausalLM"]))
    with pytest.raises(CheckpointError, match="MistralForCausalLM"):
        load_target(target_dir)
    edit_config(drafter_dir, lambda c: c.update(architectures=["DFlash2DraftModel"]))
    with pytest.raises(CheckpointError, match="DFlash2DraftModel"):
        load_drafter(drafter_dir)


def test_mask_id_outside_vocab(drafter_dir):
    edit_config(drafter_dir, lambda c: c["dflash_config"].update(mask_token_id=97))
    with pytest.raises(CheckpointError, match=r"mask_token_id 97 must be in \[0, vocab_size=97\)"):
        load_drafter(drafter_dir)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling type 'yarn'"),
    ("num_attention_heads", None, "'num_attention_heads' is missing"),
])
def test_unsupported_target_fields(target_dir, field, value, message):
    edit_config(target_dir, lambda c: c.update({field: value}))
    with pytest.raises(CheckpointError, match=message):
        load_target(target_dir)


def test_sharded_index_with_missing_shard(tmp_path):
    save_target(random_target(), tmp_path, max_shard_bytes=20_000)
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(CheckpointError, match="missing from"):
        load_target(tmp_path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(random_target().config.to_hf_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist locally"):
        load_target(tmp_path / "nope")


def test_hub_id_offline_fails_with_checkpoint_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="could not be fetched from the Hugging Face Hub"):
        load_target("ddtree-test/surely-not-cached")


# --- tokenizer ------------------------------------------------------------------------------------------------


def test_load_tokenizer_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3, "user": 4, ":": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello world") == [2, 3]
    assert loaded.eos_token_id == 1
    text = loaded.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert loaded.encode(text) == [4, 5, 2]


def test_load_tokenizer_without_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)


def test_the_demo_pair_loads_without_torch_dynamo_or_transformers_generation():
    """Building a model on the meta device must not run a Python reference op (Embedding's normal_, RoPE's inverse
    frequencies): each such op imports torch._dynamo, seconds of every cold start. The demo tokenizer must not go
    through AutoTokenizer, whose AutoConfig imports transformers.generation (seconds more; module docstring of
    ddtree.models.tokenizer). In a fresh interpreter (another test may have imported either already)."""
    import subprocess
    import sys

    script = ("import sys, torch\n"
              "from ddtree.assets import demo_drafter_path, demo_target_path\n"
              "from ddtree.models import load_drafter, load_target, load_tokenizer\n"
              "load_target(demo_target_path()); load_drafter(demo_drafter_path()); load_tokenizer(demo_target_path())\n"
              "print('torch._dynamo' in sys.modules, 'transformers.generation' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False False"


def test_the_demo_tokenizer_is_the_one_autotokenizer_loads():
    # load_tokenizer takes the demo's tokenizer through PreTrainedTokenizerFast; sound only while AutoTokenizer picks
    # that class with the same settings, vocabulary, special tokens and chat template
    from transformers import AutoTokenizer

    from ddtree.assets import demo_target_path

    ours = load_tokenizer(demo_target_path())
    auto = AutoTokenizer.from_pretrained(str(demo_target_path()))
    assert type(ours) is type(auto)
    assert ours.init_kwargs == auto.init_kwargs
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    text = "def f(x):\n    return x  # caf\u00e9 <|im_end|> done<|endoftext|>"
    ids = auto(text)["input_ids"]
    assert ours(text)["input_ids"] == ids
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort a list"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
