"""An OpenAI-compatible client that measures: per-chunk arrival times, usage, speculative stats, reasoning text.

One code path for ddtree, SGLang, vLLM and any other OpenAI-compatible server. Streaming requests ask for
``stream_options = {"include_usage": true, "continuous_usage_stats": true}``: with continuous usage (vLLM, SGLang,
ddtree) every chunk carries the cumulative ``completion_tokens``, so the number of tokens in each chunk is exact --
speculative decoding sends several tokens per chunk, and counting chunks as tokens is the classic benchmark error.
Where a server sends usage only at the end, :mod:`ddtree.lab.bench.metrics` attributes tokens to chunks with the
tokenizer and says so (``itl_source``).

Speculative statistics are read wherever a server puts them (:func:`ddtree.lab.engines.spec_stats`): ddtree's
``ddtree`` object, SGLang's ``meta_info`` / ``sglext.spec_tokens_details``, at the response or the choice level.
The probes (:meth:`OpenAIClient.detect_engine`, ``scrape``, ``flush_cache``, ``server_info``) live here too, so
the client depends on :mod:`ddtree.lab.engines` and never the other way round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from ddtree.errors import ConfigError
from ddtree.lab.engines import ENGINES, parse_metrics, spec_details, spec_stats

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class BenchTarget:
    """Where to send requests and how. ``extra_body`` is merged into every request body (e.g. ``{"ddtree":
    {"budget": 8}}`` or ``{"chat_template_kwargs": {"enable_thinking": false}}``)."""

    url: str
    engine: str = "auto"  # auto | ddtree | sglang | vllm | openai (no acceptance reader)
    model: str | None = None  # None: the first model of /v1/models
    endpoint: Endpoint = "completions"
    extra_body: dict = field(default_factory=dict)
    tokenizer: str | None = None  # the served model's tokenizer (directory or hub id) when not the default
    api_key: str | None = None
    timeout_s: float = 600

    def validated(self) -> BenchTarget:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://, got {self.url!r}")
        if self.engine not in ("auto", *ENGINES):
            raise ConfigError(f"engine must be auto or one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ConfigError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if not isinstance(self.extra_body, dict):
            raise ConfigError(f"extra_body must be a JSON object, got {self.extra_body!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        return self

    @property
    def base_url(self) -> str:
        """The server root: ``url`` without a trailing ``/`` or ``/v1``."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Completion:
    """One request's outcome as observed by the client. Times are seconds after the request was sent."""

    text: str = ""
    reasoning: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None
    # Streamed chunks that carried output text or usage: arrival time, the text (content + reasoning) and the
    # cumulative completion_tokens the chunk reported (None when it had no usage). Turning these into per-token
    # timings is :func:`ddtree.lab.bench.metrics.token_events`' job.
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    chunk_usage: list[int | None] = field(default_factory=list)
    spec_verify_ct: int | None = None
    accept_length: float | None = None
    # [n] = rounds that accepted exactly n draft tokens (bonus not counted), whatever the engine's field names
    accept_hist: list[int] | None = None
    correct_drafts: int | None = None
    proposed_drafts: int | None = None
    spec_source: str | None = None  # where the per-request stats came from: ddtree, meta_info or sglext
    # Log-probs, when the body asked for them (``logprobs`` on completions, ``logprobs`` + ``top_logprobs`` on
    # chat): one entry per emitted token, as the server returned them. ``token_ids`` only where the engine gives
    # ids (vLLM's ``return_tokens_as_token_ids`` spells tokens ``token_id:N``); ``top_logprobs`` the N most
    # probable ``(token, log-prob, id or None)`` per position (completions also list the chosen token).
    tokens: list[str] | None = None
    token_ids: list[int] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[str, float, int | None]] | None] | None = None
    status_code: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class OpenAIClient:
    """Async client for one target; use as ``async with OpenAIClient(target) as client``."""

    def __init__(self, target: BenchTarget, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.target = target.validated()
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        # trust_env=False: a benchmark must talk to the server directly, never through an HTTP proxy from the env.
        self.http = httpx.AsyncClient(
            base_url=self.target.base_url, headers=headers, transport=transport, trust_env=False,
            timeout=httpx.Timeout(self.target.timeout_s, connect=min(30.0, self.target.timeout_s)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._model: str | None = target.model

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()

    async def get_json(self, path: str) -> Any | None:
        """GET ``path`` as JSON; ``None`` when the server has no such route or answers non-JSON."""
        try:
            response = await self.http.get(path)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    async def get_text(self, path: str) -> str | None:
        try:
            response = await self.http.get(path)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def model(self) -> str:
        """The model name to send: the target's, else the first one the server lists."""
        if self._model is None:
            where = f"{self.target.base_url}/v1/models"
            try:
                response = await self.http.get("/v1/models")
            except httpx.HTTPError as exc:
                raise ConfigError(f"cannot reach {where}: {type(exc).__name__}: {exc}; is the server up?") from exc
            if response.status_code != 200:
                raise ConfigError(f"{where} answered HTTP {response.status_code} (not ready?); wait for /health "
                                  "or pass --model")
            try:
                data = response.json().get("data") or []
            except (ValueError, AttributeError):
                data = []
            if not data or not isinstance(data[0], dict) or "id" not in data[0]:
                raise ConfigError(f"{where} lists no model; pass --model")
            self._model = data[0]["id"]
        return self._model

    # Probes: what the server says about itself (engine, acceptance sources, configuration), each one request or
    # a few; where each engine reports what is described in :mod:`ddtree.lab.engines`.

    async def flush_cache(self) -> bool:
        """SGLang's ``/flush_cache`` (resets the cumulative ``/server_info`` acceptance); True when it succeeded."""
        for method in ("POST", "GET"):  # POST on current SGLang, GET on older builds
            try:
                response = await self.http.request(method, "/flush_cache")
            except httpx.HTTPError:
                return False
            if response.status_code == 200:
                return True
            if response.status_code not in (404, 405):
                return False
        return False

    async def server_info_accept_length(self) -> float | None:
        """The mean ``avg_spec_accept_length`` over ``/server_info``'s ``internal_states`` (data-parallel ranks)."""
        info = await self.get_json("/server_info") or await self.get_json("/get_server_info")
        states = info.get("internal_states") if isinstance(info, Mapping) else None
        values = [float(s["avg_spec_accept_length"]) for s in states or [] if isinstance(s, Mapping)
                  and isinstance(s.get("avg_spec_accept_length"), (int, float)) and s["avg_spec_accept_length"] > 0]
        return sum(values) / len(values) if values else None

    async def scrape(self) -> dict[str, float] | None:
        """The server's ``/metrics`` summed by sample name; ``None`` when it has none (or it does not parse)."""
        text = await self.get_text("/metrics")
        if not text:
            return None
        try:
            return parse_metrics(text)
        except ValueError:
            return None

    async def detect_engine(self) -> str:
        """``ddtree``, ``sglang`` or ``vllm`` from what the server says about itself; ``openai`` when unknown.

        Order: ``/v1/models`` ``owned_by`` (each of the three names itself there), then metric-name prefixes on
        ``/metrics``, then ``/server_info`` keys."""
        listing = await self.get_json("/v1/models")
        for card in (listing or {}).get("data") or []:
            owner = str(card.get("owned_by", "")).lower() if isinstance(card, Mapping) else ""
            for engine in ("ddtree", "sglang", "vllm"):
                if engine in owner:
                    return engine
        text = await self.get_text("/metrics") or ""
        for engine in ("ddtree", "sglang", "vllm"):
            if f"\n{engine}:" in "\n" + text:
                return engine
        info = await self.get_json("/server_info")
        if isinstance(info, Mapping):
            if "ddtree_version" in (info.get("server") or {}):
                return "ddtree"
            if "internal_states" in info:
                return "sglang"
        return "openai"

    async def server_info(self, engine: str) -> dict[str, Any]:
        """What the server says about its configuration and versions, for the record (``{}`` when nothing)."""
        paths = {"ddtree": ("/server_info",), "sglang": ("/server_info", "/get_server_info"),
                 "vllm": ("/version",), "openai": ()}[engine]
        for path in paths:
            info = await self.get_json(path)
            if isinstance(info, dict):
                return info
        return {}

    async def body(self, *, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                   max_tokens: int, stream: bool, ignore_eos: bool = False, temperature: float = 0.0,
                   logprobs: int | None = None, extra: dict | None = None) -> dict:
        """A request body for the target's endpoint; ``extra`` and then ``target.extra_body`` are merged last.

        ``logprobs``: None asks for none; N >= 0 asks for every emitted token's log-prob and the N most probable
        tokens at each position (completions ``logprobs: N``; chat ``logprobs: true, top_logprobs: N``)."""
        body: dict[str, Any] = {"model": await self.model(), "max_tokens": max_tokens, "temperature": temperature,
                                "stream": stream}
        if self.target.endpoint == "chat":
            if messages is None:
                messages = [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]
            body["messages"] = messages
            body["max_completion_tokens"] = max_tokens
        else:
            if prompt is None:
                raise ConfigError("the completions endpoint needs a prompt")
            body["prompt"] = prompt
        if ignore_eos:
            body["ignore_eos"] = True
        if logprobs is not None:
            if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
                raise ConfigError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
            if self.target.endpoint == "chat":
                body["logprobs"] = True
                body["top_logprobs"] = logprobs
            else:
                body["logprobs"] = logprobs
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        body.update(extra or {})
        body.update(self.target.extra_body)
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.target.endpoint == "chat" else "/v1/completions"

    async def complete(self, body: dict) -> Completion:
        """Send one request (streaming or not, as ``body["stream"]`` says) and observe it."""
        out = Completion()
        start = time.perf_counter()
        try:
            if body.get("stream"):
                await self._stream(body, out, start)
            else:
                response = await self.http.post(self.path, json=body)
                out.latency_s = time.perf_counter() - start
                out.status_code = response.status_code
                if response.status_code != 200:
                    out.error = _http_error(response.status_code, response.text)
                else:
                    self._absorb(response.json(), out, now=None, streaming=False)
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError) as exc:  # malformed JSON / unexpected shapes from the server
            out.error = f"bad response: {type(exc).__name__}: {exc}"
        if out.error is None and out.completion_tokens is None:
            out.error = "the server sent no usage (completion_tokens); token counts must come from usage"
        return out

    async def _stream(self, body: dict, out: Completion, start: float) -> None:
        async with self.http.stream("POST", self.path, json=body) as response:
            out.status_code = response.status_code
            if response.status_code != 200:
                out.error = _http_error(response.status_code, (await response.aread()).decode(errors="replace"))
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - start
                self._absorb(json.loads(data), out, now=now, streaming=True)
                if out.error is not None:
                    return
        out.latency_s = time.perf_counter() - start

    def _absorb(self, obj: dict, out: Completion, *, now: float | None, streaming: bool) -> None:
        """Fold one response object (a whole response or one SSE chunk) into ``out``."""
        if "error" in obj and obj["error"]:
            err = obj["error"]
            out.error = f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        text = ""
        reasoning = ""
        for choice in obj.get("choices") or []:
            if streaming and self.target.endpoint == "chat":
                delta = choice.get("delta") or {}
                text += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            elif self.target.endpoint == "chat":
                message = choice.get("message") or {}
                text += message.get("content") or ""
                reasoning += message.get("reasoning_content") or message.get("reasoning") or ""
            else:
                text += choice.get("text") or ""
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
            if choice.get("logprobs"):
                _absorb_logprobs(choice["logprobs"], out, chat=self.target.endpoint == "chat")
        out.text += text
        if reasoning:
            out.reasoning = (out.reasoning or "") + reasoning
        usage = obj.get("usage") or None
        if usage is not None:
            out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
            out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
        verify_ct, accept_length = spec_stats(obj)
        if verify_ct is not None:
            out.spec_verify_ct = verify_ct
        if accept_length is not None:
            out.accept_length = accept_length
        details = spec_details(obj)
        if details.source is not None:  # stats are cumulative per request: the last object carrying them wins
            out.accept_hist = list(details.accept_hist) if details.accept_hist is not None else out.accept_hist
            out.correct_drafts = details.correct_drafts if details.correct_drafts is not None else out.correct_drafts
            out.proposed_drafts = (details.proposed_drafts if details.proposed_drafts is not None
                                   else out.proposed_drafts)
            out.spec_source = details.source
        if now is None or not (text or reasoning or usage is not None):
            return
        out.chunk_times.append(now)
        out.chunk_texts.append(text + reasoning)
        out.chunk_usage.append(usage.get("completion_tokens") if usage is not None else None)


def _token_id(token: str) -> int | None:
    """vLLM's ``token_id:N`` spelling (``return_tokens_as_token_ids``) -> N; None for an ordinary token string."""
    if token.startswith("token_id:") and token[len("token_id:"):].isdigit():
        return int(token[len("token_id:"):])
    return None


def _absorb_logprobs(obj: dict, out: Completion, *, chat: bool) -> None:
    """Append one choice's (or one chunk's) log-prob entries to ``out``, in either endpoint's shape."""
    if chat:
        items = obj.get("content") or []
        tokens = [str(item["token"]) for item in items]
        chosen = [item.get("logprob") for item in items]
        tops: list[list[tuple[str, float, int | None]] | None] = [
            [(str(t["token"]), float(t["logprob"]), _token_id(str(t["token"])))
             for t in item.get("top_logprobs") or []] for item in items]
    else:
        tokens = [str(t) for t in obj.get("tokens") or []]
        chosen = list(obj.get("token_logprobs") or [None] * len(tokens))
        raw_tops = list(obj.get("top_logprobs") or [None] * len(tokens))
        tops = [None if top is None else
                sorted(((str(t), float(lp), _token_id(str(t))) for t, lp in top.items()), key=lambda e: -e[1])
                for top in raw_tops]
        if not (len(chosen) == len(raw_tops) == len(tokens)):
            raise ValueError(f"logprobs lists of unequal length: {len(tokens)} tokens, {len(chosen)} log-probs, "
                             f"{len(raw_tops)} top entries")
    ids = [_token_id(t) for t in tokens]
    out.tokens = (out.tokens or []) + tokens
    out.token_logprobs = (out.token_logprobs or []) + [None if lp is None else float(lp) for lp in chosen]
    out.top_logprobs = (out.top_logprobs or []) + tops
    if all(i is not None for i in ids) and (out.token_ids is not None or len(out.tokens) == len(tokens)):
        out.token_ids = (out.token_ids or []) + [i for i in ids if i is not None]
    else:
        out.token_ids = None


def _http_error(status: int, body: str) -> str:
    message = body.strip()
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict):
            err = parsed.get("error", parsed)
            message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except ValueError:
        pass
    return f"HTTP {status}: {message[:500]}"
