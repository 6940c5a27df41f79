"""The OpenAI wire format: request bodies, their translation into engine requests, and response bodies.

Request bodies are pydantic models so FastAPI parses and type-checks them; everything a type cannot express
(batched prompts, features we do not implement, the ``ddtree`` extension) is checked here and raised as
:class:`~ddtree.errors.InvalidRequestError` with ``param`` set, which the app turns into an OpenAI error body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}

Unknown top-level fields are ignored (OpenAI clients send ``user``, ``metadata`` and friends, and benchmark tools
add their own), but fields of features we do not implement are rejected when they ask for something, so a client
never silently gets less than it asked for. Inside the ``ddtree`` object unknown keys are an error: a typo there
would otherwise quietly benchmark the server's defaults.

Speculative statistics travel twice, because two kinds of tools read them:

- ``"ddtree": {...}``: our own :class:`~ddtree.engine.api.RequestStats` (acceptance histogram, stage times, the
  resolved tree settings).
- ``"meta_info": {"spec_verify_ct", "spec_accept_length", ...}``: SGLang's names. SGLang attaches ``meta_info`` to
  each choice of an OpenAI response (``return_meta_info``) and to the top level of its native ``/generate``
  answer; we put the same object in both places (n is always 1), and on the last content chunk of a stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

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

from ddtree.engine.api import GenerationRequest, RequestStats, SamplingParams, TreeSettings
from ddtree.errors import InvalidRequestError

# Completions default to 16 new tokens like OpenAI, vLLM and SGLang; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
TREE_FIELDS: frozenset[str] = frozenset(TreeSettings.__dataclass_fields__)
# Engine finish reasons as OpenAI clients see them; "cancelled" and "error" never reach a 200 response.
FINISH_REASONS: dict[str, str] = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


# ----------------------------------------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    """OpenAI's ``include_usage`` plus vLLM's and SGLang's ``continuous_usage_stats`` (cumulative usage on every
    chunk, which is how a client counts tokens per chunk exactly when one chunk carries several tokens)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingBody(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat = 1.0  # OpenAI's default; send 0 for greedy
    top_p: StrictFloat = 1.0
    top_k: StrictInt = -1  # vLLM/SGLang spell "no filter" -1; 0 means the same
    seed: StrictInt | None = None
    stop: Any = None  # a string or a list of strings; checked below for a clearer message than a union's
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ddtree: dict[str, Any] | None = None
    # Accepted only at their neutral values: we do not implement them and must not pretend to.
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    repetition_penalty: StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: StrictInt | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk; like vLLM, only together with ``include_usage``."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError(
                f"n must be 1, got {self.n}: ddtree serves one completion per request; send {self.n} requests",
                param="n",
            )
        if self.best_of not in (None, 1):
            raise InvalidRequestError(f"best_of must be 1, got {self.best_of}: not supported", param="best_of")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise InvalidRequestError(f"{name} is not supported; leave it at 0", param=name)
        if self.repetition_penalty not in (None, 1.0):
            raise InvalidRequestError("repetition_penalty is not supported; leave it at 1", param="repetition_penalty")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be >= -1 (-1 or 0: no filter), got {self.top_k}", param="top_k")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ValueError(f"stop must be a string or a list of strings, got {value!r:.80}")

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )

    def tree(self, defaults: TreeSettings) -> TreeSettings | None:
        """The request's tree settings: the ``ddtree`` overrides merged onto the server's current defaults."""
        if not self.ddtree:
            return None
        return defaults.merged(self.ddtree)


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``. ``prompt`` is one string or one list of token ids."""

    prompt: Any  # one string or one list of token ids; checked below for a clearer message than a union's
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON can carry lone surrogates ("\ud800"); text cannot
                raise ValueError(f"prompt is not valid Unicode text ({exc.reason} at index {exc.start})") from None
            return value
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            raise ValueError(
                f"batched prompts ({len(value)} prompts in a list) are not supported; "
                "send one prompt (a string or a list of token ids) per request"
            )
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
        raise ValueError(f"prompt must be a string or a list of token ids, got {value!r:.80}")

    def to_generation_request(self, prompt_token_ids: Sequence[int], defaults: TreeSettings,
                              request_id: str) -> GenerationRequest:
        """``prompt_token_ids``: the prompt as given, or the text prompt tokenized (the server needs its length
        for streamed usage before the engine reports it)."""
        self._check_unsupported()
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return GenerationRequest(
            prompt_token_ids=list(prompt_token_ids),
            tree=self.tree(defaults),
            sampling=self.sampling(max_tokens),
            request_id=request_id,
        )


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

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def to_generation_request(
        self, prompt_token_ids: Sequence[int], defaults: TreeSettings, request_id: str, max_len: int
    ) -> GenerationRequest:
        """``prompt_token_ids`` is the rendered chat; without a token limit the answer may fill the context."""
        self._check_unsupported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(
                f"response_format {self.response_format.get('type')!r} is not supported; only 'text' is",
                param="response_format",
            )
        if self.max_completion_tokens is not None:
            max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        elif self.max_tokens is not None:
            max_tokens, param = self.max_tokens, "max_tokens"
        else:
            max_tokens, param = max(1, max_len - len(prompt_token_ids)), None
        if param is not None and max_tokens < 1:
            raise InvalidRequestError(f"{param} must be >= 1, got {max_tokens}", param=param)
        return GenerationRequest(
            prompt_token_ids=list(prompt_token_ids),
            tree=self.tree(defaults),
            sampling=self.sampling(max_tokens),
            request_id=request_id,
        )


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


def usage(stats: RequestStats) -> dict[str, int]:
    return token_usage(stats.prompt_tokens, stats.completion_tokens)


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def meta_info(request_id: str, stats: RequestStats) -> dict[str, Any]:
    """SGLang's per-request ``meta_info`` keys, so tools written for SGLang read our acceptance unchanged."""
    reason = stats.finish_reason or "stop"
    return {
        "id": request_id,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "spec_verify_ct": stats.verify_rounds,
        "spec_accept_length": stats.accept_length,
        "spec_accept_histogram": list(stats.accept_hist),
        "finish_reason": {"type": FINISH_REASONS.get(reason, reason)},
        "e2e_latency": stats.latency_s,
        "ttft": stats.ttft_s,
        "queue_time": stats.queue_s,
    }


class ResponseBuilder:
    """Builds the JSON objects of one request's response, streamed or not, for either endpoint.

    ``chat`` selects the chat shapes (``message``/``delta``, ``chat.completion[.chunk]``) over the completions
    shapes (``text``, ``text_completion``)."""

    def __init__(self, *, request_id: str, model: str, chat: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._sent_role = False

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, stats: RequestStats) -> dict[str, Any]:
        """The non-streaming answer."""
        meta = meta_info(self.request_id, stats)
        reason = FINISH_REASONS[stats.finish_reason or "stop"]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason, "meta_info": meta}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "meta_info": meta}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=usage(stats), meta_info=meta, ddtree=stats.to_dict())
        return body

    def chunk(self, text: str, stats: RequestStats | None, *, include_usage: bool,
              running_usage: dict[str, int] | None = None) -> dict[str, Any]:
        """One streamed chunk of new text; ``stats`` is given on the last one (it carries the finish reason).

        ``running_usage`` (continuous usage stats) is the cumulative usage so far; otherwise ``include_usage``
        puts OpenAI's ``"usage": null`` on the chunk."""
        reason = None if stats is None else FINISH_REASONS[stats.finish_reason or "stop"]
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if not self._sent_role:
                delta = {"role": "assistant", "content": text}
                self._sent_role = True
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._head("text_completion")
        if stats is not None:
            choice["meta_info"] = meta_info(self.request_id, stats)
            body["ddtree"] = stats.to_dict()
        body["choices"] = [choice]
        if running_usage is not None:
            body["usage"] = running_usage
        elif include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        return body

    def usage_chunk(self, stats: RequestStats) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the request's token counts."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(stats))
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
