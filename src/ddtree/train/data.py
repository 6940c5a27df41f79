"""Token data for training: the packed corpus stream, window sampling, and target-generated continuations.

Documents are encoded with the raw ``tokenizers`` object (parallel Rust batch encoding) and packed into one 1-D
stream, each followed by ``<|endoftext|>``; training windows are random slices of that stream (documents may
share a window, as in standard LM pre-training). Held-out windows are fixed, evenly spaced slices of the held-out
stream, so every evaluation sees the same tokens.

Continuations are what the DFlash drafter learns from: prefixes of the train stream extended greedily (or by
sampling) by the trained target, so the drafter imitates what the target actually says, not what the corpus says.
They are saved as safetensors ``{"tokens": int32 [N, prompt_len + new_tokens]}`` with ``prompt_len`` in the
metadata; the drafter's loss covers the generated part only.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ddtree.devices import resolve_device
from ddtree.errors import ConfigError
from ddtree.train.corpus import Corpus
from ddtree.train.runtime import RunLog, seed_everything
from ddtree.train.tokenizer import EOS_TOKEN, load_raw_tokenizer


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """All documents packed into one stream, each followed by the EOS id.  # -> [total_tokens] int32"""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    pieces: list[torch.Tensor] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        pieces.append(torch.tensor(encoding.ids + [eos], dtype=torch.int32))
    if not pieces:
        raise ConfigError("no documents to encode; the corpus split is empty")
    return torch.cat(pieces)


def sample_windows(stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` random slices of ``length`` tokens.  # stream [N] -> [batch_size, length] int64"""
    if stream.numel() < length:
        raise ConfigError(
            f"the token stream has {stream.numel()} tokens, fewer than one window of {length}; "
            "use a shorter seq_len or more corpus files"
        )
    starts = torch.randint(0, stream.numel() - length + 1, (batch_size,), generator=generator)
    offsets = torch.arange(length)
    return stream[starts[:, None] + offsets[None, :]].long()


def fixed_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """Up to ``count`` evenly spaced, non-overlapping slices of ``length`` tokens.  # -> [W, length] int64"""
    available = stream.numel() // length
    if available < 1:
        raise ConfigError(
            f"the held-out stream has {stream.numel()} tokens, fewer than one window of {length}; "
            "use a shorter length or a larger held-out fraction"
        )
    count = min(count, available)
    stride = available // count
    starts = torch.arange(count) * stride * length
    return stream[starts[:, None] + torch.arange(length)[None, :]].long()


@dataclass(frozen=True)
class ContinuationSettings:
    """How many target continuations to generate, and how."""

    num_prompts: int = 2048
    prompt_len: int = 1024
    new_tokens: int = 1024
    batch_size: int = 1024
    temperature: float = 0.0
    seed: int = 1
    split: str = "train"  # "train": random prefixes; "held-out": evenly spaced held-out prefixes (evaluation)

    def __post_init__(self) -> None:
        if self.split not in ("train", "held-out"):
            raise ConfigError(f"split must be 'train' or 'held-out', got {self.split!r}")
        for name in ("num_prompts", "prompt_len", "new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")


@torch.inference_mode()
def generate_continuations(
    model: torch.nn.Module,
    prompts: torch.Tensor,  # [N, P] int64 token ids
    new_tokens: int,
    *,
    batch_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [N, P + new_tokens] int64, on the CPU
    """Extend every prompt by exactly ``new_tokens`` target tokens (EOS is a token like any other here).

    ``model`` is a Hugging Face causal LM (the target as saved by ``ddtree train target``); decoding uses its own
    KV cache. Written as a plain loop rather than ``model.generate`` because we want every row to run the full
    length with no stopping rule and no logits processors: the continuation is the target's raw argmax chain
    (or its raw temperature sample)."""
    device = next(model.parameters()).device
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x deprecates the old name; 5.17 has only it).
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outputs: list[torch.Tensor] = []
    for chunk in prompts.split(batch_size):
        ids = chunk.to(device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        generated = []
        for step in range(new_tokens):
            logits = out.logits[:, -1, :].float()  # [B, V]
            if temperature == 0.0:
                token = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            generated.append(token)
            if step + 1 < new_tokens:
                cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
                out = model(input_ids=token[:, None], use_cache=True, **{cache_arg: cache})
        outputs.append(torch.cat([ids, torch.stack(generated, dim=1)], dim=1).cpu())
        del out
    return torch.cat(outputs)


def save_continuations(path: str | Path, tokens: torch.Tensor, *, prompt_len: int, info: dict | None = None) -> None:
    """Write continuations for ``ddtree train drafter``.  # tokens [N, prompt_len + new] int"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"prompt_len": str(prompt_len), "info": json.dumps(info or {})}
    save_file({"tokens": tokens.to(torch.int32).contiguous()}, str(path), metadata=metadata)


@dataclass(frozen=True)
class Continuations:
    tokens: torch.Tensor  # [N, prompt_len + new_tokens] int64
    prompt_len: int

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


def load_continuations(path: str | Path) -> Continuations:
    """Read a file written by :func:`save_continuations`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"continuation file {str(path)!r} does not exist; run `ddtree train data` first")
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if "prompt_len" not in metadata:
        raise ConfigError(f"{str(path)!r} has no prompt_len metadata; it was not written by `ddtree train data`")
    tokens = load_file(str(path))["tokens"].long()
    prompt_len = int(metadata["prompt_len"])
    if not 0 < prompt_len < tokens.shape[1]:
        raise ConfigError(f"{str(path)!r}: prompt_len {prompt_len} must be inside the row length {tokens.shape[1]}")
    return Continuations(tokens=tokens, prompt_len=prompt_len)


def make_continuations(
    corpus: Corpus,
    target_dir: str | Path,
    out_path: str | Path,
    settings: ContinuationSettings,
    *,
    device: str = "auto",
    log_path: str | Path | None = None,
) -> dict:
    """``ddtree train data``: take corpus prefixes, extend them with the target, save the rows.

    Train-split prefixes feed the drafter's training; held-out prefixes (``split="held-out"``) make the
    evaluation set on which the drafter's acceptance is measured.

    The target runs in bf16 on CUDA (as it was trained) and fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    generator = seed_everything(settings.seed)
    log = RunLog(Path(log_path) if log_path else None, "data",
                 {"settings": settings.__dict__, "target": str(target_dir), "corpus": corpus.describe()})
    tokenizer = load_raw_tokenizer(target_dir)
    if settings.split == "train":
        stream = encode_documents(tokenizer, [f.text for f in corpus.train])
        prompts = sample_windows(stream, settings.num_prompts, settings.prompt_len, generator)
    else:
        stream = encode_documents(tokenizer, [f.text for f in corpus.held_out])
        prompts = fixed_windows(stream, settings.prompt_len, settings.num_prompts)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(dev).eval()
    started = log.elapsed()
    rows = generate_continuations(model, prompts, settings.new_tokens, batch_size=settings.batch_size,
                                  temperature=settings.temperature, generator=generator)
    generate_s = log.elapsed() - started
    save_continuations(out_path, rows, prompt_len=settings.prompt_len, info={"settings": settings.__dict__})
    generated = rows[:, settings.prompt_len:]
    log.results.update(
        rows=rows.shape[0],
        row_len=rows.shape[1],
        generated_tokens=generated.numel(),
        generate_s=round(generate_s, 2),
        generated_tokens_per_s=round(generated.numel() / max(generate_s, 1e-9), 1),
        eos_fraction=round(float((generated == tokenizer.token_to_id(EOS_TOKEN)).float().mean()), 5),
        distinct_token_fraction=round(float(torch.unique(generated).numel()) / tokenizer.get_vocab_size(), 4),
        saved_to=str(out_path),
    )
    log.write()
    return log.to_dict()
