"""Bounds on what one request may cost the server before the engine sees it: body bytes, prompt characters, fields.

Three checks, cheapest first, each able to refuse a request long before it costs memory or CPU:

1. **Body bytes** (:class:`BodyLimitMiddleware`, an ASGI middleware): a ``Content-Length`` over the limit is
   refused before one byte is read; a body without one (chunked) is counted while it is read and refused at the
   first chunk that passes the limit. Both get a 413 naming the limit and ``Connection: close``, so the rest of
   the upload is never read; at most ``limit`` bytes (plus the chunk that crossed it) are ever held.
2. **Prompt characters** (:meth:`ResolvedLimits.check_prompt_chars`): a text prompt (or a rendered chat) longer
   than the longest text that could still fit in ``max_len`` tokens is refused before tokenization
   (:func:`prompt_char_bound` derives that length from the tokenizer and says why it never refuses a prompt
   that fits). Token-id prompts longer than ``max_len`` are refused without looking at the ids.
3. **Fields** (:meth:`ResolvedLimits.check_fields`): at most so many stop strings, characters per stop string,
   stop token ids.

The body limit is derived from the same bound: the longest prompt that fits, JSON-escaped in the worst case
(6 bytes per UTF-8 byte: ``\\u0001`` for a control byte), plus 1 MiB for the other fields and chat framing; a body
that big or smaller is never refused for its size. ``--max-body-bytes`` sets it explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ddtree.errors import ConfigError, InvalidRequestError
from ddtree.server.protocol import error_body

logger = logging.getLogger("ddtree.server")

BODY_OVERHEAD_BYTES = 1 << 20  # the non-prompt fields of a body, chat framing, whitespace
JSON_ESCAPE_FACTOR = 6  # worst-case JSON bytes per UTF-8 byte of text ("\u0001" for one control byte)
# Normalizers that never shrink text by more than COMPOSITION_FACTOR (canonical composition joins at most four
# code points into one, e.g. U+1F82 from alpha + three marks, and a 4-code-point decomposition has <= 4x the
# bytes of its composed form) or never shrink it at all (case mapping, prepending, replacing with a non-empty
# string). Any other normalizer (strip, BERT's control-character removal, ...) can delete unbounded input, so no
# character bound is safe for it and the pre-check is off.
COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC", "NFD", "NFKD"})
NON_SHRINKING_NORMALIZERS = frozenset({"Lowercase", "Prepend"})
COMPOSITION_FACTOR = 4
PROVISIONAL_BODY_BYTES = BODY_OVERHEAD_BYTES  # while the engine (and so the tokenizer) is still loading

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    """What the server accepts per request and holds in its queue; ``None`` = derived from the engine's config.

    ``max_body_bytes``: request body size (413 above). ``max_queued_tokens``: prompt + max_tokens summed over the
    requests waiting for a KV slot (default four full batches: ``4 * max_batch * max_len``); ``max_queued``:
    requests waiting (default the engine's ``max_queue``). ``tokenizer_workers``: threads that tokenize and
    render chat templates off the event loop (default: the machine's cores, at most 8)."""

    max_body_bytes: int | None = None
    max_queued_tokens: int | None = None
    max_queued: int | None = None
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 1024
    tokenizer_workers: int | None = None
    max_choices: int = 64  # prompts x n of one request (each is one engine request, or one copy of a greedy one)

    def validated(self) -> ServerLimits:
        for name in ("max_body_bytes", "max_queued_tokens", "max_queued", "tokenizer_workers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 (or unset), got {value!r}")
        if isinstance(self.max_choices, bool) or not isinstance(self.max_choices, int) or self.max_choices < 1:
            raise ConfigError(f"max_choices must be an integer >= 1, got {self.max_choices!r}")
        for name in ("max_stop", "max_stop_chars", "max_stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        return self

    def resolve(self, *, max_len: int, max_batch: int, max_queue: int, tokenizer: Any, vocab_size: int
                ) -> ResolvedLimits:
        """Concrete limits for one engine (its context length, slots, queue and tokenizer)."""
        bound = prompt_char_bound(tokenizer, max_len)
        text_bytes = (bound.chars if bound.chars is not None else max_len * bound.max_token_bytes * COMPOSITION_FACTOR)
        ids_bytes = max_len * (len(str(max(vocab_size - 1, 0))) + 2)  # "123, " per id
        derived_body = JSON_ESCAPE_FACTOR * max(text_bytes, ids_bytes) + BODY_OVERHEAD_BYTES
        queued_tokens = self.max_queued_tokens or 4 * max_batch * max_len
        if queued_tokens < max_len:
            raise ConfigError(f"max_queued_tokens ({queued_tokens}) must be >= max_len ({max_len}), or a request "
                              "using the whole context could never be queued")
        workers = self.tokenizer_workers or max(1, min(8, os.cpu_count() or 1))
        return ResolvedLimits(
            max_len=max_len, max_body_bytes=self.max_body_bytes or derived_body, prompt_chars=bound.chars,
            max_token_bytes=bound.max_token_bytes, max_queued_tokens=queued_tokens,
            max_queued=self.max_queued or max_queue, max_running=max_batch, max_stop=self.max_stop,
            max_stop_chars=self.max_stop_chars, max_stop_token_ids=self.max_stop_token_ids,
            tokenizer_workers=workers, max_choices=self.max_choices,
        )


@dataclass(frozen=True)
class PromptBound:
    """``chars``: no text longer than this tokenizes to ``max_len`` tokens or fewer (None: no safe bound);
    ``max_token_bytes``: the longest token's text in UTF-8 bytes."""

    chars: int | None
    max_token_bytes: int
    normalizer: str | None


def prompt_char_bound(tokenizer: Any, max_len: int) -> PromptBound:
    """The most characters a text of at most ``max_len`` tokens can have, for this tokenizer.

    Why it is safe: a tokenizer splits the (normalized) text into pieces whose bytes concatenate back to it, so
    a text of ``n`` tokens has at most ``n * B`` UTF-8 bytes, ``B`` the longest token's bytes, and a character is
    at least one byte. ``B`` is taken over every id (added and special tokens too: ``<|im_start|>`` in a text is
    one token of 12 bytes) as the larger of the decoded piece's UTF-8 length (a partial UTF-8 sequence decodes to
    U+FFFD, 3 bytes, never fewer than it stands for) and the raw token string's length (byte-level BPE spells one
    byte per character, ``Ġ`` for a space; SentencePiece's ``▁`` stands for the space a lone decode drops).
    A normalizer that composes characters (NFC in Qwen's tokenizers) may shrink the input up to 4x before
    splitting, so the bound is multiplied by 4 there; one that can delete input has no bound (``chars=None``).
    """
    size = len(tokenizer)
    decoded = tokenizer.batch_decode([[i] for i in range(size)])
    raw = tokenizer.convert_ids_to_tokens(list(range(size)))
    longest = max(max(len(d.encode("utf-8", "replace")), len(r or "")) for d, r in zip(decoded, raw, strict=True))
    longest = max(longest, 1)
    normalizer = _normalizer_spec(tokenizer)
    factor = _shrink_factor(normalizer)
    name = None if normalizer is None else str(normalizer.get("type"))
    if factor is None:
        logger.warning("tokenizer normalizer %s may delete input: prompts are not length-checked before "
                       "tokenization (the body limit still applies)", name)
    return PromptBound(chars=None if factor is None else max_len * longest * factor, max_token_bytes=longest,
                       normalizer=name)


def _normalizer_spec(tokenizer: Any) -> dict[str, Any] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: no declared normalizer to reason about
        return {"type": type(tokenizer).__name__}
    return json.loads(backend.to_str()).get("normalizer")


def _shrink_factor(spec: dict[str, Any] | None) -> int | None:
    """How many times shorter the normalized text can be than its input (None: unbounded)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            inner = _shrink_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in COMPOSING_NORMALIZERS:
        return COMPOSITION_FACTOR
    if kind in NON_SHRINKING_NORMALIZERS:
        return 1
    if kind == "Replace" and spec.get("content"):
        pattern = spec.get("pattern", {})
        if isinstance(pattern, dict) and "String" in pattern and len(pattern["String"]) <= len(spec["content"]):
            return 1  # e.g. SentencePiece's " " -> "▁": never shorter
    return None


@dataclass(frozen=True)
class ResolvedLimits:
    """:class:`ServerLimits` made concrete for one engine; every check raises an error naming the field."""

    max_len: int
    max_body_bytes: int
    prompt_chars: int | None
    max_token_bytes: int
    max_queued_tokens: int
    max_queued: int
    max_running: int
    max_stop: int
    max_stop_chars: int
    max_stop_token_ids: int
    tokenizer_workers: int
    max_choices: int

    def check_choices(self, prompts: int, n: int) -> None:
        """Refuse a request of more choices (prompts x n) than one request may ask for."""
        if prompts * n > self.max_choices:
            param = "n" if prompts == 1 else "prompt"
            raise InvalidRequestError(f"{prompts} prompt(s) x n={n} asks for {prompts * n} choices; at most "
                                      f"{self.max_choices} are allowed per request", param=param)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit in ``max_len`` tokens, before spending time tokenizing it."""
        if self.prompt_chars is not None and len(text) > self.prompt_chars:
            raise InvalidRequestError(
                f"{param} has {len(text)} characters; at most {self.prompt_chars} can fit in the context limit of "
                f"{self.max_len} tokens with this tokenizer (its longest token is {self.max_token_bytes} bytes)",
                param=param,
            )

    def check_prompt_ids(self, ids: list[int]) -> None:
        if len(ids) > self.max_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} token ids, more than the context limit of {self.max_len} tokens",
                param="prompt",
            )

    def check_fields(self, stop: Any, stop_token_ids: list[int] | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > self.max_stop:
            raise InvalidRequestError(f"stop has {len(stops)} strings; at most {self.max_stop} are allowed",
                                      param="stop")
        for s in stops:
            if len(s) > self.max_stop_chars:
                raise InvalidRequestError(
                    f"a stop string has {len(s)} characters; at most {self.max_stop_chars} are allowed", param="stop")
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequestError(f"stop_token_ids has {len(stop_token_ids)} ids; at most "
                                      f"{self.max_stop_token_ids} are allowed", param="stop_token_ids")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SPOOL_BYTES = 512 * 1024  # a body's bytes kept in memory while it is read; the rest waits on disk


class BodyBuffer:
    """A request body as it arrives: chunks in a list up to ``spool_bytes``, then appended to an unnamed temporary
    file (``tempfile.TemporaryFile``: unlinked at once, so nothing is left behind, also if the process dies).

    Why not all in memory: the body limit must admit a body of exactly the limit, so a refusal can only come once
    the limit is in hand; held in memory, that (plus the server's read buffers) is more resident memory than the
    limit itself for every refused upload. The file's pages live in the page cache, not in the process's resident
    set. Writes are page-cache copies of at most one read (~256 KiB), short enough to stay on the event loop."""

    def __init__(self, spool_bytes: int = SPOOL_BYTES) -> None:
        self.spool_bytes = spool_bytes
        self.size = 0
        self._parts: list[bytes] = []
        self._file: Any = None

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._file is None and self.size > self.spool_bytes:
            self._file = tempfile.TemporaryFile()
            for part in self._parts:
                self._file.write(part)
            self._parts.clear()
        if self._file is not None:
            self._file.write(chunk)
        else:
            self._parts.append(chunk)

    def read(self) -> bytes:
        """The whole body (one copy), and the buffer emptied."""
        if self._file is None:
            data = b"".join(self._parts)
            self._parts.clear()
            return data
        self._file.seek(0)
        return self._file.read()

    def close(self) -> None:
        self._parts.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


class BodyLimitMiddleware:
    """Reads each HTTP request body itself, at most ``limit_fn()`` bytes, then hands it to ``app`` in one message.

    A declared ``Content-Length`` over the limit is refused before reading; an undeclared (chunked) body is
    refused at the first chunk that passes the limit. What has been read waits in a :class:`BodyBuffer` (memory up
    to ``SPOOL_BYTES``, then an unnamed temporary file), so a refused upload never holds the limit in resident
    memory: uvicorn's own read buffers (~1.2 MiB for a fast sender) plus at most ``SPOOL_BYTES`` (a growing
    ``bytearray`` over-allocates: 6.2 MiB peak and 5.8 MiB left resident after 50 refused 25 MiB bodies; chunks
    held in a list, 3.4 MiB peak against the 2.5 MiB limit; docs/benchmarks.md). The 413 carries
    ``Connection: close``: uvicorn (h11) then closes the connection after the answer; kept alive, it would read
    and drop every byte of the rest of the upload (each h11 ``Data`` event until the end of the message) before
    the next request (a 150 MB body: 150 MB read for nothing). The client reads the
    413 first (it is written before the close; curl and httpx both report it, also mid-upload), at the price of
    a new connection for its next request. ``on_refused(path)`` is called for each 413 (metrics)."""

    def __init__(self, app: ASGIApp, limit_fn: Callable[[], int], on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.limit_fn = limit_fn
        self.on_refused = on_refused

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_fn()
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, send, limit, f"Content-Length {declared}")
            return
        buffer = BodyBuffer(SPOOL_BYTES)
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left while sending: nothing to answer
                    return
                chunk = message.get("body", b"")
                if buffer.size + len(chunk) > limit:
                    await self._refuse(scope, send, limit, f"more than {limit} bytes")
                    return
                buffer.add(chunk)
                if not message.get("more_body", False):
                    break
            body = [buffer.read()]
        finally:
            buffer.close()

        async def replay() -> Any:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            return await receive()  # later messages (http.disconnect) come from the connection

        await self.app(scope, replay, send)

    async def _refuse(self, scope: MutableMapping[str, Any], send: Callable[[Any], Awaitable[None]], limit: int,
                      got: str) -> None:
        self.on_refused(scope.get("path", ""))
        message = (f"request body too large: {got}, the limit is {limit} bytes (derived from the context limit; "
                   "the server's --max-body-bytes changes it)")
        await send_json(send, 413, error_body(message, code="request_too_large"), headers=[(b"connection", b"close")])


def _content_length(scope: MutableMapping[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_json(send: Callable[[Any], Awaitable[None]], status: int, body: dict[str, Any],
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer a request from a middleware with a JSON body."""
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
