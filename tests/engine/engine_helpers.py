"""Helpers shared by the engine's tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from ddtree.engine import GenerationRequest


def submit_staggered(engine, requests: Sequence[GenerationRequest], gap: float | Callable[[int], float] = 0.03, *,
                     timeout: float = 120.0) -> list[list[int]]:
    """Submit ``requests`` one by one, ``gap`` seconds (or ``gap(i)`` after request i) apart, so each arrives while
    the earlier ones decode; wait for all of them -> each one's completion tokens, in order. Every request must end
    with finish reason "length" and no error (checked once all are done, not inside the engine's callback, where a
    failed assert would only cancel that request)."""
    results: dict[int, list[int]] = {}
    reasons: dict[int, tuple] = {}
    done = threading.Event()
    for i, req in enumerate(requests):
        toks: list[int] = []

        def on_chunk(ch, i=i, toks=toks):
            toks.extend(ch.token_ids)
            if ch.finished:
                results[i] = toks
                reasons[i] = (ch.finish_reason, ch.error)
                if len(results) == len(requests):
                    done.set()

        engine.submit(req, on_chunk)
        time.sleep(gap(i) if callable(gap) else gap)
    assert done.wait(timeout), f"{len(results)} of {len(requests)} requests finished"
    assert all(r == ("length", None) for r in reasons.values()), reasons
    return [results[i] for i in range(len(requests))]


def plain_greedy(target, prompt_ids: list[int], n: int) -> list[int]:
    """The engine's reference: full recompute with ``forward_train`` at every step, argmax (no cache, no trees)."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(target.forward_train(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
