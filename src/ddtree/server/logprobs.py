"""Log-probs in OpenAI's response shapes, from the engine's :class:`~ddtree.engine.api.TokenLogprob` entries.

The engine's log-probs are the target's raw distribution (before temperature, vLLM's default
``logprobs_mode="raw_logprobs"``), whatever method produced the tokens (see :mod:`ddtree.engine.logprobs`).

Shapes (as vLLM and OpenAI send them):

- completions: ``{"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
  "text_offset": [int]}``; each ``top_logprobs`` dict holds the request's N most probable tokens plus the chosen
  one (so N or N + 1 entries; ``logprobs: 0`` gives the chosen token alone). With ``echo`` the prompt's tokens come
  first, the first of them with ``null`` log-prob and ``null`` top (nothing predicts it). ``text_offset`` is each
  token's character offset in the choice's text so far (token strings concatenated, the echoed prompt included).
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}``, ``top_logprobs`` the request's N (``top_logprobs``, 0 by default) most probable.

A token's string is ``tokenizer.decode([id])`` with special tokens kept (vLLM's choice; a token that is part of a
UTF-8 sequence shows the replacement character, its ``bytes`` are those of that string).

Streaming: chunks whose tokens produced no text yet are not sent (:func:`ddtree.server.generation.sse_events`), so
the formatter keeps their entries and hands them over with the next chunk that is sent: every token's log-probs
reach the client exactly once, in order.
"""

from __future__ import annotations

from typing import Any

from ddtree.engine.api import StreamChunk, TokenLogprob

FLOOR = -9999.0  # a log-prob of -inf (a token the target rules out in fp32) is sent as this, as vLLM does: JSON has no -inf


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


class LogprobFormatter:
    """One engine request's log-probs as the response shape of its endpoint, chunk by chunk."""

    def __init__(self, tokenizer: Any, *, chat: bool, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.prompt_ids = prompt_ids
        self.offset = 0  # characters of token strings handed out so far (completions' text_offset)
        self._pending: list[tuple[int, TokenLogprob | None]] = []  # (token id, entry; None: the first prompt token)
        self._strings: dict[int, str] = {}

    def feed(self, chunk: StreamChunk) -> None:
        """Keep the chunk's entries (its prompt's first, when it carries them) until :meth:`take`."""
        if chunk.prompt_logprobs is not None:
            self._pending += [(entry.token_id if entry is not None else tok, entry)
                              for tok, entry in zip(self.prompt_ids, chunk.prompt_logprobs, strict=True)]
        for entry in chunk.logprobs or ():
            self._pending.append((entry.token_id, entry))

    def take(self) -> dict[str, Any]:
        """Everything kept since the last call, in the endpoint's shape (empty lists when nothing is kept)."""
        pending, self._pending = self._pending, []
        return self._chat(pending) if self.chat else self._completion(pending)

    def _token(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _completion(self, pending: list[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, entry in pending:
            text = self._token(tok)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(entry.logprob))
            top = {self._token(i): _finite(lp) for i, lp in entry.top}
            top.setdefault(text, _finite(entry.logprob))  # the chosen token is always listed (vLLM's N + 1)
            out["top_logprobs"].append(top)
        return out

    def _chat(self, pending: list[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        content = []
        for tok, entry in pending:
            if entry is None:  # chat never echoes the prompt
                continue
            content.append({**self._item(tok, entry.logprob),
                            "top_logprobs": [self._item(i, lp) for i, lp in entry.top]})
        return {"content": content, "refusal": None}

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
