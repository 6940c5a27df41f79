"""The OpenAI wire format: request bodies, their translation into engine requests, and response bodies.

Request bodies are pydantic models so FastAPI parses and type-checks them; everything a type cannot express
(batched prompts, features we do not implement, the ``ddtree`` extension) is checked here and raised as
:class:`~ddtree.errors.InvalidRequestError` with ``param`` set, which the app turns into an OpenAI error body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}

Unknown top-level fields are ignored (OpenAI clients send ``user``, ``metadata`` and friends, and benchmark tools
add their own), but fields of features we do not implement are rejected when they ask for something, so a client
never silently gets less than it asked for. Inside the ``ddtree`` object unknown keys are an error: a typo there
would otherwise quietly benchmark the server's defaults.

Batches and samples: a completions ``prompt`` may be a list of prompts and ``n`` asks for several samples of each;
every prompt-sample pair is one choice, in vLLM's order (:meth:`_SamplingBody.generation_requests`).

Speculative statistics travel three times, because three kinds of tools read them
(:mod:`ddtree.server.spec_stats` has the definitions):

- ``"ddtree": {...}``: our own :class:`~ddtree.engine.api.RequestStats` (acceptance histogram indexed by committed
  tokens, stage times, the resolved tree settings).
- ``"meta_info": {"spec_verify_ct", "spec_accept_length", "spec_accept_rate", ...}``: SGLang's names and
  conventions. SGLang attaches ``meta_info`` to each choice of an OpenAI response (``return_meta_info``) and to the
  top level of its native ``/generate`` answer; we put it on every choice (and at the top level for one choice),
  and on each choice's last content chunk of a stream.
- ``"metrics": {"speculative_decoding": {...}}``: vLLM's per-request object (AIPerf reads it), at the top level
  of a one-choice answer and on a stream's final chunks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from ddtree.engine.api import MAX_LOGPROBS, GenerationRequest, RequestStats, SamplingParams, TreeSettings
from ddtree.errors import InvalidRequestError
from ddtree.server.spec_stats import FINISH_REASONS, sglang_meta_info, vllm_speculative_decoding

# Completions default to 16 new tokens like OpenAI, vLLM and SGLang; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
TREE_FIELDS: frozenset[str] = frozenset(TreeSettings.__dataclass_fields__)


# ----------------------------------------------------------------------------------------------- request bodies

# Fields of OpenAI's, vLLM's and SGLang's request schemas that ask for something ddtree does not do: accepted only
# as null or at the listed neutral values, refused with a 400 naming them otherwise (never silently dropped).
# Fields not listed and not declared below (``user``, ``metadata``, a benchmark tool's own keys) are ignored.
_NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0), "typical_p": (1, 1.0), "length_penalty": (1, 1.0), "use_beam_search": (False,),
    "logit_bias": ({},), "bad_words": ([],), "allowed_token_ids": (), "logits_processors": ([],),
    "truncate_prompt_tokens": (), "prompt_logprobs": (), "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "regex": (), "json_schema": (), "ebnf": (),
    "priority": (0,), "suffix": ("",), "lora_path": (), "return_hidden_states": (False,),
}
_CHAT_NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (), "reasoning_effort": (),
    "chat_template": (), "documents": (), "continue_final_message": (False,), "add_generation_prompt": (True,),
    "echo": (False,),
}


class StreamOptions(BaseModel):
    """OpenAI's ``include_usage`` plus vLLM's and SGLang's ``continuous_usage_stats`` (cumulative usage on every
    chunk, which is how a client counts tokens per chunk exactly when one chunk carries several tokens)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _SamplingBody(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``. Every optional field of the OpenAI
    schema also takes an explicit ``null``, which means its default."""

    model_config = ConfigDict(extra="allow")  # extras are checked against _NEUTRAL_ONLY, then ignored

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # None: OpenAI's default 1.0; send 0 for greedy
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # vLLM/SGLang spell "no filter" -1; 0 means the same
    seed: StrictInt | None = None
    stop: Any = None  # a string or a list of strings; checked below for a clearer message than a union's
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    min_tokens: StrictInt | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    ddtree: dict[str, Any] | None = None
    user: str | None = None

    NEUTRAL_ONLY: ClassVar[dict[str, tuple[Any, ...]]] = _NEUTRAL_ONLY

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk; like vLLM, only together with ``include_usage``."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def keep_special_tokens(self) -> bool:
        return self.skip_special_tokens is False

    @property
    def include_stop(self) -> bool:
        return bool(self.include_stop_str_in_output)

    def _check_unsupported(self) -> None:
        if self.n is not None and self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed together with stream: true",
                                      param="stream_options")
        if self.min_tokens is not None:
            if self.min_tokens < 0:
                raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens")
        if self.top_k is not None and self.top_k < -1:
            raise InvalidRequestError(f"top_k must be >= -1 (-1 or 0: no filter), got {self.top_k}", param="top_k")
        if self.keep_special_tokens and self.stop:
            raise InvalidRequestError(
                "skip_special_tokens: false cannot be combined with stop strings (the engine matches stop strings "
                "on the text without special tokens); drop one of the two", param="skip_special_tokens")
        for name, neutral in self.NEUTRAL_ONLY.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not _is_neutral(value, neutral):
                shown = f"[{', '.join(repr(v) for v in neutral)}]" if neutral else "null"
                raise InvalidRequestError(f"{name} is not supported by ddtree serve; leave it out or send "
                                          f"{shown}", param=name)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ValueError(f"stop must be a string or a list of strings, got {value!r:.80}")

    def sampling(self, max_tokens: int, *, seed: int | None = None) -> SamplingParams:
        """The engine's sampling parameters; ``seed`` overrides the request's (one per sample of ``n``)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=max(self.top_k or 0, 0),
            seed=self.seed if seed is None else seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,  # the engine masks EOS and stop token ids until this many are out
            logprobs=self.logprobs_asked(),
            prompt_logprobs=self.prompt_logprobs_asked(),
        )

    def logprobs_asked(self) -> int | None:
        """Top log-probs per emitted token (None: none); each endpoint spells it its own way."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """Top log-probs per prompt token (completions' ``echo`` with ``logprobs``)."""
        return None

    def tree(self, defaults: TreeSettings) -> TreeSettings | None:
        """The request's tree settings: the ``ddtree`` overrides merged onto the server's current defaults."""
        if not self.ddtree:
            return None
        return defaults.merged(self.ddtree)

    def generation_requests(self, prompts: Sequence[Sequence[int]], defaults: TreeSettings, request_id: str,
                            max_tokens: int) -> list[tuple[GenerationRequest, list[int]]]:
        """The engine requests behind this body, each with the choice indices it answers (vLLM's order: prompt
        ``i``'s samples are choices ``i * n .. i * n + n - 1``). Greedy samples are identical, so each prompt runs
        once and its answer is copied to its ``n`` choices (what vLLM returns); sampled ones run ``n`` times with
        seeds ``seed + j`` (distinct, and reproducible when the request has a seed)."""
        n = self.num_samples
        base = self.sampling(max_tokens)
        tree = self.tree(defaults)
        out = []
        for i, ids in enumerate(prompts):
            if base.greedy or n == 1:
                runs = [(base, list(range(i * n, i * n + n)))]
            else:
                runs = [(self.sampling(max_tokens, seed=None if self.seed is None else (self.seed + j) % 2**63),
                         [i * n + j]) for j in range(n)]
            for sampling, indices in runs:
                rid = f"{request_id}-{indices[0]}" if len(prompts) * n > 1 else request_id
                out.append((GenerationRequest(prompt_token_ids=list(ids), tree=tree, sampling=sampling,
                                              request_id=rid), indices))
        return out


def _check_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", param=name)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral`` (numbers compare by value, ``True`` is not ``1``)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    return any((number(value) and number(v) and value == v) or (type(value) is type(v) and value == v)
               for v in neutral)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check_text(value: str, where: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON can carry lone surrogates ("\ud800"); text cannot
        raise ValueError(f"{where} is not valid Unicode text ({exc.reason} at index {exc.start})") from None
    return value


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id
    lists; a list is a batch, one choice (``n`` choices) per prompt, in order."""

    prompt: Any  # checked below for a clearer message than a union's
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _check_text(value, "prompt")
        if _is_ids(value):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [_check_text(v, f"prompt[{i}]") for i, v in enumerate(value)]
        if isinstance(value, list) and all(_is_ids(v) for v in value):
            return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                         f"lists, got {value!r:.80}")

    def prompt_list(self) -> list[str | list[int]]:
        """The batch: each prompt a string or a list of token ids (one prompt unless ``prompt`` lists several)."""
        p = self.prompt
        if isinstance(p, str) or _is_ids(p):
            return [p]
        return list(p)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None

    def check(self) -> int:
        """Refuse what this server cannot do; returns max_tokens."""
        self._check_unsupported()
        _check_logprobs("logprobs", self.logprobs)
        if not self.prompt_list() or any(len(p) == 0 for p in self.prompt_list()):
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. Extra fields (``name``, ``tool_calls``, ...) are passed to the chat template untouched."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"content part of type {part.type!r} is not supported; only text parts are",
                        param=f"messages[{index}].content[{j}]",
                    )
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``; the prompt is the tokenizer's chat template applied to ``messages``."""

    NEUTRAL_ONLY: ClassVar[dict[str, tuple[Any, ...]]] = {**_NEUTRAL_ONLY, **_CHAT_NEUTRAL_ONLY}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        """Refuse what this server cannot do (before the chat template is applied)."""
        self._check_unsupported()
        _check_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true (as in OpenAI's API); send both",
                                      param="top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(
                f"response_format {self.response_format.get('type')!r} is not supported; only 'text' is",
                param="response_format",
            )
        for param in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, param)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{param} must be >= 1, got {value}", param=param)

    def max_tokens_for(self, prompt_tokens: int, max_len: int) -> int:
        """The token limit asked for; without one the answer may fill the rest of the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return max(1, max_len - prompt_tokens)


class ServerConfigUpdate(BaseModel):
    """``POST /server_config``: ``{"ddtree": {...}}`` merged onto the current default tree settings."""

    model_config = ConfigDict(extra="forbid")

    ddtree: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _settings_nested(cls, value: Any) -> Any:
        if isinstance(value, dict) and "ddtree" not in value and set(value) & TREE_FIELDS:
            raise ValueError(f'put the tree settings under "ddtree": {{"ddtree": {json.dumps(value)}}}')
        return value


# ---------------------------------------------------------------------------------------------- response bodies


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def request_param(param: str | None) -> str | None:
    """Name a field as the client spelled it: tree settings live under ``ddtree``."""
    if param in TREE_FIELDS:
        return f"ddtree.{param}"
    return param


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ChoiceResult:
    """One finished choice: its index, the text the client sees, and the statistics of the engine request that
    produced it (choices copied from one greedy run share it)."""

    index: int
    text: str
    stats: RequestStats
    request_id: str
    logprobs: dict[str, Any] | None = None  # the endpoint's log-probs object (server.logprobs), when asked


class ResponseBuilder:
    """Builds the JSON objects of one request's response, streamed or not, for either endpoint.

    ``chat`` selects the chat shapes (``message``/``delta``, ``chat.completion[.chunk]``) over the completions
    shapes (``text``, ``text_completion``). Statistics: every choice carries SGLang's ``meta_info``; a response
    of one choice also carries them at the top level (``meta_info``, ``ddtree``, and vLLM's
    ``metrics.speculative_decoding``, which vLLM too sends only when there is one choice); with several choices
    each choice carries its own ``ddtree``."""

    def __init__(self, *, request_id: str, model: str, chat: bool, num_choices: int = 1) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.num_choices = num_choices
        self.created = int(time.time())
        self._sent_role: set[int] = set()

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _stats_on(self, body: dict[str, Any], choice: dict[str, Any], result_id: str, stats: RequestStats) -> None:
        meta = sglang_meta_info(result_id, stats)
        choice["meta_info"] = meta
        if self.num_choices == 1:
            body.update(meta_info=meta, ddtree=stats.to_dict(),
                        metrics={"speculative_decoding": vllm_speculative_decoding(stats)})
        else:
            choice["ddtree"] = stats.to_dict()

    def response(self, choices: list[ChoiceResult], prompt_tokens: int) -> dict[str, Any]:
        """The non-streaming answer; ``prompt_tokens`` counts each prompt once (not once per sample)."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            reason = FINISH_REASONS[c.stats.finish_reason or "stop"]
            if self.chat:
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                          "logprobs": c.logprobs, "finish_reason": reason}
            else:
                choice = {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": reason}
            self._stats_on(body, choice, c.request_id, c.stats)
            out.append(choice)
        body["choices"] = out
        body["usage"] = token_usage(prompt_tokens, sum(c.stats.completion_tokens for c in choices))
        return body

    def chunk(self, index: int, text: str, stats: RequestStats | None = None, *, result_id: str = "",
              include_usage: bool = False, running_usage: dict[str, int] | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streamed chunk of choice ``index``'s new text; ``stats`` is given on its last one (it carries the
        finish reason). ``running_usage`` (continuous usage stats) is the cumulative usage so far; otherwise
        ``include_usage`` puts OpenAI's ``"usage": null`` on the chunk."""
        reason = None if stats is None else FINISH_REASONS[stats.finish_reason or "stop"]
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if index not in self._sent_role:
                delta = {"role": "assistant", "content": text}
                self._sent_role.add(index)
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            body = self._head("text_completion")
        if stats is not None:
            self._stats_on(body, choice, result_id, stats)
            if include_usage:  # vLLM's object rides the usage chunk alone: AIPerf drops a request's stats
                body.pop("metrics", None)  # when two of its chunks carry them (it reads that as n > 1)
        body["choices"] = [choice]
        if running_usage is not None:
            body["usage"] = running_usage
        elif include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        return body

    def usage_chunk(self, usage: dict[str, int], stats: RequestStats | None) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the request's token counts (and, for
        one choice, vLLM's ``metrics.speculative_decoding``, where vLLM puts it in a stream)."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage)
        if stats is not None and self.num_choices == 1:
            body["metrics"] = {"speculative_decoding": vllm_speculative_decoding(stats)}
        return body


# ------------------------------------------------------------------------------------- validation errors


def describe_validation_errors(errors: Any) -> tuple[str, str | None, str]:
    """One readable message for pydantic's error list: the first problem, its field, and how many more."""
    errors = list(errors)
    first = errors[0]
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return f"malformed JSON body: {detail}", None, "invalid_json"
    param = _param_from_loc(first["loc"])
    if param is None:
        if first["type"] == "value_error":
            return str(first["msg"]).removeprefix("Value error, "), None, "invalid_value"
        if first["type"] == "missing":
            return "the request body is empty; send a JSON object", None, "invalid_json"
        return f"the request body must be a JSON object, got {first.get('input')!r:.80}", None, "invalid_json"
    if first["type"] == "missing":
        return f"missing required field {param!r}{more}", param, "missing_field"
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"unknown field {param!r}{more}", param, "unknown_field"
    if first["type"] != "value_error":
        message += f", got {first.get('input')!r:.80}"
    return f"{param}: {message}{more}", param, "invalid_type"


def _param_from_loc(loc: Any) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; union branch tags are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
