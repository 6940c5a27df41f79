"""How many prompts a prefill step takes: each prompt's share (``prefill_chunk``) and the step's padded size
(``prefill_step_tokens``), one rule for the scheduler, the warm-up plan, exact mode's check and replay's model, and
for the prompt chunks a mixed round carries (``mixed_chunk`` as the step's size: ``PrefillSteps._ride_rows``).

Why two numbers: ``prefill_chunk`` is also the cache headroom every slot keeps (a chunk's padded width is written
past the prompt's end), so it stays small, while the step's size sets the prefill rate the batch can sustain. At 64
requests of 1k tokens on the H200 stand-in a DDTree request finished about every round and each needed two 512-token
steps, but the loop runs one step a round: with both numbers 512 the batch drained and DDTree fell to 1.04x AR;
with steps of 2048 and chunks of 512 DDTree gained 27-31 % on one H100 (docs/benchmarks.md, "Prefill steps sized
apart from the chunk"). vLLM's ``max_num_batched_tokens`` and SGLang's ``chunked_prefill_size`` are this step budget.

A step's rows are padded to the widest (and, when graphed, to a power-of-two rows bucket and width bucket,
:func:`ddtree.engine.cuda_graphs.prefill_key`), so the step is bounded by what it computes, not by the tokens it
writes: rows and width rounded up to powers of two (width at least 16) multiply to at most ``prefill_step_tokens``.
A single row is always allowed (its width is at most ``prefill_chunk``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

PREFILL_STEP_TOKENS_CUDA = 2048  # EngineConfig.prefill_step_tokens' default on CUDA (at least prefill_chunk)


def resolve_step_tokens(value: int | None, prefill_chunk: int, device_type: str) -> int:
    """``EngineConfig.prefill_step_tokens`` for an engine on ``device_type``: the value given, or the device's
    default when None (CUDA: :data:`PREFILL_STEP_TOKENS_CUDA`, elsewhere ``prefill_chunk``: a CPU step costs its
    tokens' compute, so a larger step only makes decoding rows wait longer), never below ``prefill_chunk``."""
    if value is None:
        value = PREFILL_STEP_TOKENS_CUDA if device_type == "cuda" else prefill_chunk
    return max(value, prefill_chunk)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def step_fits(rows: int, widest: int, *, chunk: int, step_tokens: int) -> bool:
    """Whether a prefill step of ``rows`` rows whose widest row takes ``widest`` tokens is one the scheduler makes
    (module docstring)."""
    if rows < 1 or not 1 <= widest <= chunk:
        return False
    return rows == 1 or _pow2(rows) * max(16, _pow2(widest)) <= step_tokens


def step_takes(left: Sequence[int], *, chunk: int, step_tokens: int) -> list[int]:
    """The prompt tokens a step takes from each of the leading prompts, given the tokens each has ``left`` (in
    admission order, each > 0): ``min(left, chunk)`` each, while the step still fits (:func:`step_fits`); the first
    prompt always goes. Admission order is kept: a prompt that does not fit ends the step."""
    takes: list[int] = []
    widest = 0
    for n in left:
        take = min(n, chunk)
        if takes and not step_fits(len(takes) + 1, max(widest, take), chunk=chunk, step_tokens=step_tokens):
            break
        takes.append(take)
        widest = max(widest, take)
    return takes


def step_shapes(*, max_batch: int, chunk: int, step_tokens: int) -> Iterator[tuple[int, int]]:
    """Every (rows, widest row's largest take) of a step the scheduler can make, rows ascending; the warm-up plan
    and exact mode enumerate widths up to the second number. :func:`step_fits` is monotone in the width and
    changes only where its power of two does, so the largest fitting take is the chunk or a power of two below it."""
    candidates = [chunk] + [1 << k for k in range(chunk.bit_length()) if 1 << k < chunk]
    for rows in range(1, max_batch + 1):
        widest = max((w for w in candidates if step_fits(rows, w, chunk=chunk, step_tokens=step_tokens)), default=0)
        if widest < 1:
            return
        yield rows, widest


def eager_steps(*, max_batch: int, chunk: int, step_tokens: int) -> Iterator[tuple[int, int]]:
    """Every (rows, padded width) of an eager step: the widest take rounded up to a multiple of 16
    (:func:`ddtree.engine.cuda_graphs.eager_chunk_dims`), for every step :func:`step_shapes` allows."""
    top = -(-chunk // 16) * 16
    for rows, widest in step_shapes(max_batch=max_batch, chunk=chunk, step_tokens=step_tokens):
        for width in range(16, top + 1, 16):
            if width - 15 > widest:  # the narrowest take this width pads from is past the step's widest
                break
            yield rows, width
