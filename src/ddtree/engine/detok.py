"""Incremental detokenization with stop strings.

Speculative rounds commit several tokens at once, and a stop string may straddle two rounds, so the text is
rebuilt from the ids with a small look-back window (the approach vLLM and TGI use): decode the ids from a
``prefix_offset``; emit only the part after ``read_offset`` once it no longer ends in an incomplete UTF-8 sequence
(U+FFFD). Stop strings are matched on the accumulated text, and text that could still be the start of a stop
string is held back so a client never sees a stop string's prefix that is later trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

_REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    stop: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (before stop trimming)
    emitted: int = 0  # characters of `text` already handed out
    prefix_offset: int = 0
    read_offset: int = 0
    stopped: bool = False

    def add(self, new_ids: Sequence[int], *, check_stop: bool = True) -> str:
        """Append token ids; return the new text that is safe to emit (stop string trimmed if it appeared).

        check_stop=False (tokens before min_tokens): the text is emitted whole, no stop string is matched in it."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        if not check_stop and not self.stopped:
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of the request (incomplete bytes included)."""
        if self.read_offset < len(self.ids):
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
            full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        for s in self.stop:
            hit = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if hit != -1:
                self.stopped = True
                self.text = self.text[:hit]
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out
        end = len(self.text)
        if not final:
            # hold back a tail that is a prefix of some stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
