"""Shared fixtures: a tiny tokenizer, a tiny random target/drafter pair, engines over them, and an oracle drafter.

The random pair is deterministic (fixed seeds) and its target has peaky logits (large embeddings), so greedy argmax
never sits on a float near-tie: losslessness tests compare exact tokens. A random drafter accepts almost nothing,
so :class:`OracleDrafter` (a test double with the drafter interface) drafts from the target's own greedy rollout
plus noise: long accepted paths, accepted siblings and non-contiguous compaction all get exercised.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels (ddtree's fused CUDA paths) run on CPU tensors through Triton's interpreter when no GPU is present.
# The switch is read when a kernel is defined, so it must be set before any ddtree module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



@pytest.fixture
def triton_kernels_on_cpu(monkeypatch) -> Iterator[None]:
    """Let ddtree's Triton kernels run on CPU tensors through the interpreter for one test (a no-op with CUDA).

    Also works around triton-lang/triton#9171: Triton 3.6's interpreter turns a scalar tensor into a loop bound
    with ``int(array_of_shape_1)``, which numpy >= 2.4 refuses; data-dependent ``range`` bounds need it."""
    from ddtree import triton_runtime

    if triton_runtime.INTERPRETED:
        import triton.runtime.interpreter as interpreter

        original = interpreter._patch_lang_tensor

        def patched(tensor, scope) -> None:
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    with triton_runtime.cpu_interpreter():
        yield


_CORPUS_MODULES = ("textwrap", "string", "heapq", "bisect", "fnmatch", "glob", "shlex", "colorsys")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus_text() -> str:
    import importlib

    parts = []
    for name in _CORPUS_MODULES:
        mod = importlib.import_module(name)
        parts.append(Path(mod.__file__).read_text())
    return "\n".join(parts)


def build_tiny_tokenizer(directory: Path, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a few stdlib files, saved so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_corpus_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|mask|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return fast


def tiny_target_hf_config(vocab_size: int, eos: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def tiny_drafter_hf_config(vocab_size: int, mask_id: int, block_size: int = 8) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "block_size": block_size,
        "layer_types": ["full_attention", "sliding_attention"],
        "sliding_window": 32,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": [0, 2], "block_size": block_size},
    }


def _randomize(module: torch.nn.Module, seed: int, embed_std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def build_tiny_pair(tokenizer, *, seed: int = 0, block_size: int = 8):
    from ddtree.models import DFlashDrafter, DrafterConfig, TargetConfig, TargetModel

    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    mask = tokenizer.convert_tokens_to_ids("<|mask|>")
    target = TargetModel(TargetConfig.from_hf_dict(tiny_target_hf_config(vocab, eos)))
    drafter = DFlashDrafter(DrafterConfig.from_hf_dict(tiny_drafter_hf_config(vocab, mask, block_size)))
    _randomize(target, seed, embed_std=0.6)
    _randomize(drafter, seed + 1, embed_std=0.6)
    return target.eval(), drafter.eval()


class OracleDrafter(torch.nn.Module):
    """A test double with the drafter interface whose marginals come from the target's greedy rollout + noise.

    It rolls the target forward greedily from the root, writing scratch K/V at positions the round's verify pass
    overwrites anyway, and returns ``rollout_logits + noise``; so its top-1 chain is often right, sometimes a
    sibling is right, and deeper marginals after a wrong guess are (realistically) conditioned on the top-1 path.
    """

    def __init__(self, inner, target, noise: float = 2.0, seed: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.trained_block_size = inner.trained_block_size
        self.target_ref = [target]
        self.noise = noise
        self.seed = seed
        self.target_cache = None  # set by attach()

    def attach(self, engine) -> None:
        self.target_cache = engine.runner.target_cache

    def allocate_cache(self, *args, **kwargs):
        return self.inner.allocate_cache(*args, **kwargs)

    def append_context(self, *args, **kwargs) -> None:
        self.inner.append_context(*args, **kwargs)

    def supports_tree_attention(self) -> bool:
        return False  # its rollout attends through the target's dense path

    @torch.inference_mode()
    def draft_logits(self, target, root_tokens, ctx_len, cache, slots, block_size, *, block_len=None, window=None,
                     kv_len=None, kernels=None):
        from ddtree import speculative

        r = root_tokens.shape[0]
        tok = root_tokens.clone()
        out = []
        gen = torch.Generator().manual_seed(self.seed + int(ctx_len.sum()))
        for d in range(block_size - 1):
            pos = (ctx_len + d)[:, None]
            vis = torch.ones((r, 1, 1), dtype=torch.bool)
            mask = speculative.build_attention_mask(ctx_len + d, pos, vis, int((ctx_len + d).max()) + 1)
            # the rollout's own earlier tokens (positions ctx_len .. ctx_len + d - 1) are visible via prefix_len
            logits = target(tok[:, None], pos, self.target_cache, slots, pos, mask).logits[:, 0]
            noisy = logits + self.noise * torch.randn(logits.shape, generator=gen)
            out.append(noisy)
            tok = logits.argmax(-1)
        return torch.stack(out, dim=1)

    def draft_hidden(self, *args, **kwargs) -> torch.Tensor:
        """The engine's split of :meth:`draft_logits`: its "states" are the logits themselves, and :meth:`head`
        passes them through (the engine heads only the depths a round's trees reach, a prefix of these)."""
        return self.draft_logits(*args, **kwargs)

    def head(self, target, normed: torch.Tensor) -> torch.Tensor:
        return normed


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_pair(tiny_tokenizer):
    return build_tiny_pair(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_pair, tiny_tokenizer) -> tuple[Path, Path]:
    """The tiny pair saved as a Hugging Face target directory (with tokenizer) and a z-lab drafter directory."""
    from ddtree.models import save_drafter, save_target

    root = tmp_path_factory.mktemp("tiny_models")
    target, drafter = tiny_pair
    save_target(target, root / "target")
    tiny_tokenizer.save_pretrained(str(root / "target"))
    save_drafter(drafter, root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture
def tiny_engine_factory(tiny_pair, tiny_tokenizer) -> Iterator[Callable[..., object]]:
    """``make(oracle=False, drafter=True, **EngineConfig fields)`` -> a started Engine over the tiny pair."""
    from ddtree.engine import Engine, EngineConfig

    engines = []

    def make(*, oracle: bool = False, drafter: bool = True, noise: float = 2.0, **overrides):
        target, inner = tiny_pair
        draft = OracleDrafter(inner, target, noise=noise) if oracle else inner
        config = EngineConfig(**{"max_batch": 8, "max_len": 512, "max_budget": 32, "overlap_rounds": True, **overrides})
        engine = Engine.from_models(target, draft if drafter else None, tiny_tokenizer, config, model_name="tiny")
        if oracle:
            draft.attach(engine)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown(drain_timeout=0)


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


sys.path.insert(0, str(Path(__file__).parent))
