"""The benchmark matrix and its prompts: exact token lengths, a unique prefix per request, seeded.

Prompt construction
-------------------
Each prompt starts with a tag unique to the request (a hash of seed, phase, index, context and concurrency, then
``<phase><index>``: warm-up, every repeat and every cell get different tags), so the very first tokens differ and no prefix cache
(SGLang's radix cache, vLLM's automatic prefix caching) can reuse anything across requests -- reuse inflates
results by up to 2x. Seeded filler words follow, different per request. The prompt is tokenized with the served
model's tokenizer, cut to the requested length and decoded; because a cut can change how the text re-tokenizes,
the cut is then moved until ``tokenizer(text)`` has *exactly* the requested number of tokens (the tokenizer's own
special tokens, e.g. a BOS, included), and the token ids sent are that re-encoding, so text and ids agree.

What is sent: on ``/v1/completions`` the token ids (OpenAI's API, vLLM, SGLang and ddtree accept a list of ints
as ``prompt``), which is exact whatever the server's tokenizer settings; on ``/v1/chat/completions`` the text as
the user message, so the chat template adds its own tokens (the request records keep the server's
``usage.prompt_tokens``).
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError

TEXT_SOURCES = ("words", "code")
MIN_REQUESTS = 8  # requests per run when num_requests is not given: max(2 x concurrency, MIN_REQUESTS)

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river garden bridge engine signal "
    "market window paper simple quiet green bright early final local major basic clear happy strong light dark "
    "build carry follow create speak read allow grow open walk offer remember consider appear buy wait serve die "
    "send expect stay fall cut reach kill remain suggest raise pass sell require report decide pull return explain"
).split()


@dataclass(frozen=True)
class Workload:
    """The matrix of a benchmark: every (context, concurrency) pair is one cell."""

    contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    output_tokens: int
    num_requests: int | None = None  # per run; None: max(2 x concurrency, MIN_REQUESTS)
    repeats: int = 1
    seed: int = 0
    warmup: bool = True
    text: str = "words"  # filler: "words" (English) or "code" (held-out stdlib Python source)

    def validated(self) -> Workload:
        if self.text not in TEXT_SOURCES:
            raise ConfigError(f"text must be one of {', '.join(TEXT_SOURCES)}, got {self.text!r}")
        if not self.contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.contexts):
            raise ConfigError(f"contexts must be positive token counts, got {self.contexts!r}")
        if not self.concurrency or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                       for c in self.concurrency):
            raise ConfigError(f"concurrency levels must be positive integers, got {self.concurrency!r}")
        for name, value, lo in (("output_tokens", self.output_tokens, 1), ("repeats", self.repeats, 1),
                                ("seed", self.seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
        if self.num_requests is not None and (isinstance(self.num_requests, bool)
                                              or not isinstance(self.num_requests, int) or self.num_requests < 1):
            raise ConfigError(f"num_requests must be a positive integer or None, got {self.num_requests!r}")
        return self

    def requests_for(self, concurrency: int) -> int:
        return self.num_requests if self.num_requests is not None else max(2 * concurrency, MIN_REQUESTS)

    def cells(self) -> list[tuple[int, int]]:
        return [(context, conc) for context in self.contexts for conc in self.concurrency]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # exactly the requested length; equal to tokenizer(text)
    text: str


def default_tokenizer_path() -> Path:
    """The embedded demo target's tokenizer directory (what ``ddtree serve`` serves by default)."""
    return Path(str(resources.files("ddtree") / "assets" / "demo" / "target"))


def load_tokenizer(name: str | None) -> tuple[Any, str]:
    """``(tokenizer, name)``: ``name`` (a directory or hub id) or, when ``None``, the demo target's."""
    from transformers import AutoTokenizer

    if name is None:
        path = default_tokenizer_path()
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise ConfigError(
                f"no tokenizer given and the demo tokenizer is missing at {path}; pass --tokenizer with the "
                "served model's tokenizer (a local directory or hub id)"
            )
        name = str(path)
    try:
        return AutoTokenizer.from_pretrained(name), name
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load tokenizer {name!r}: {exc}; pass --tokenizer with a directory or hub id") from exc


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=1)
def held_out_code() -> str:
    """The held-out split of the stdlib corpus (the demo pair never trained on it), concatenated once."""
    from ddtree.train.corpus import load_corpus

    return "\n\n".join(f.text for f in load_corpus().held_out)


def build_prompt(tokenizer: Any, length: int, tag: str, rng: random.Random, text_source: str = "words") -> Prompt:
    """A prompt of exactly ``length`` tokens starting with ``tag`` (see the module doc)."""
    # Code rarely fails to re-encode at exactly `length` (runs of spaces merge differently after a cut); another
    # window of the held-out source then usually works.
    for _ in range(16 if text_source == "code" else 1):
        ids = _filler_ids(tokenizer, length, tag, rng, text_source)
        prompt = _exact_cut(tokenizer, ids, length)
        if prompt is not None:
            return prompt
    raise ConfigError(
        f"could not build a prompt of exactly {length} tokens with this tokenizer (re-encoding keeps changing "
        "the length); try another context length"
    )


def _filler_ids(tokenizer: Any, length: int, tag: str, rng: random.Random, text_source: str) -> list[int]:
    """Token ids of ``tag`` plus filler, at least ``length + 8`` long (when the source allows)."""
    if text_source == "code":
        source = held_out_code()
        start = rng.randrange(max(1, len(source) - 8 * (length + 64)))
        span = 4 * (length + 8)
        while True:  # grow the window until it tokenizes long enough (or the source runs out)
            ids = _encode(tokenizer, f"# {tag}\n" + source[start : start + span])
            if len(ids) >= length + 8 or start + span >= len(source):
                return ids
            span *= 2
    words: list[str] = []
    ids = _encode(tokenizer, tag + ":")
    while len(ids) < length + 8:  # enough filler to cut from; grows geometrically
        need = max(16, 2 * (length + 8 - len(ids)))
        words.extend(rng.choice(_WORDS) for _ in range(need))
        ids = _encode(tokenizer, tag + ": " + " ".join(words) + ".")
    return ids


def _exact_cut(tokenizer: Any, ids: list[int], length: int) -> Prompt | None:
    """Cut ``ids`` so that the decoded text re-encodes to exactly ``length`` tokens; None when no cut does."""
    cut = length
    for _ in range(64):
        candidate = _decode(tokenizer, ids[:cut])
        encoded = _encode(tokenizer, candidate)
        if len(encoded) == length:
            return Prompt(ids=encoded, text=candidate)
        cut += length - len(encoded)
        cut = max(1, min(cut, len(ids)))
    return None


def request_tag(seed: int, phase: str, index: int, context: int, concurrency: int) -> str:
    """The unique opening of one request's prompt: a hash first, so even the first token differs between
    requests (a radix cache then shares nothing), then the readable identity."""
    digest = hashlib.sha1(f"{seed}/{phase}/{index}/{context}/{concurrency}".encode()).hexdigest()[:10]
    return f"{digest} {phase}{index}"


def build_prompts(tokenizer: Any, length: int, count: int, *, phase: str, seed: int, context: int,
                  concurrency: int, text: str = "words") -> list[Prompt]:
    """``count`` prompts of ``length`` tokens with unique tags ``phase`` + index (deterministic given ``seed``)."""
    rng = random.Random(f"{seed}/{context}/{concurrency}/{phase}")
    prompts = [build_prompt(tokenizer, length, request_tag(seed, phase, i, context, concurrency), rng, text)
               for i in range(count)]
    if len({tuple(p.ids) for p in prompts}) != len(prompts):
        raise ConfigError(
            f"context {length} is too short for {count} distinct prompts with unique prefixes; use a longer context"
        )
    return prompts


# ---- held-out token prompts (benchmarks/gpu.py's matrix and the scripts that share its prompts) -------------------
def held_out_token_stream(tokenizer: Any, min_tokens: int) -> list[int]:
    """Held-out stdlib source (never trained on), tokenized file by file and concatenated to at least
    ``min_tokens`` tokens (the small held-out split wraps around; prompts still differ by offset)."""
    from ddtree.train.corpus import load_corpus

    ids: list[int] = []
    for f in load_corpus().held_out:
        ids.extend(tokenizer.encode(f.text, add_special_tokens=False))
        if len(ids) >= min_tokens:
            break
    while len(ids) < min_tokens:
        ids = ids + ids
    return ids


def prompts_for(stream: list[int], context: int, count: int, salt: int) -> list[list[int]]:
    """``count`` prompts of exactly ``context`` token ids, each from its own offset of the held-out ``stream``
    (offsets ``(salt * 7919 + i * step) mod (len - context)``, so another ``salt`` gives other windows)."""
    step = max(1, (len(stream) - context) // max(count, 1))
    out = []
    for i in range(count):
        off = (salt * 7919 + i * step) % max(1, len(stream) - context)
        out.append(stream[off : off + context])
    return out
