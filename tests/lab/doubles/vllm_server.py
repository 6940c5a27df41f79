"""A stand-in for a vLLM server (``vllm serve M --speculative-config '{"method": "dflash", ...}'``).

Follows vLLM's public HTTP API as of late 2026 (``vllm/entrypoints/openai/api_server.py`` and
``serving_completion.py``, the spec-decode metrics of ``vllm/v1/spec_decode/metrics.py``; summarised in
``docs/references.md``):

- ``/health`` answers 200 as soon as the API server is up, while generation still answers 503 for the first
  ``generate_503`` requests (the engine core is still warming up).
- ``/v1/completions`` streams one chunk per verify round; with ``stream_options.continuous_usage_stats`` every
  chunk carries the cumulative ``usage``, and with ``include_usage`` a last chunk has ``choices: []`` and the
  totals; then ``[DONE]``. No per-request speculative fields.
- ``/metrics``: counters ``vllm:spec_decode_num_drafts_total`` (verify rounds that drafted),
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` (rounds whose draft token i was accepted),
  plus ``vllm:generation_tokens_total``; labelled ``engine`` and ``model_name``, cumulative since start-up.
- ``/version``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from doubles.script import Script, Truth

MODEL = "double-vllm-model"


@dataclass
class VLLMDouble:
    script: Script = field(default_factory=Script)
    generate_503: int = 1
    pause_s: float = 0.002
    truth: Truth = field(default_factory=Truth)
    per_position: list[int] = field(default_factory=list)
    requests: list[Truth] = field(default_factory=list)

    def _record(self, t: Truth) -> None:
        self.requests.append(t)
        self.truth.tokens += t.tokens
        for n, count in enumerate(t.hist):
            self.truth.rounds += count
            self.truth.accepted += n * count
            while len(self.truth.hist) <= n:
                self.truth.hist.append(0)
            self.truth.hist[n] += count
            while len(self.per_position) < n:
                self.per_position.append(0)
            for i in range(n):
                self.per_position[i] += count

    def app(self) -> FastAPI:
        app = FastAPI()
        polls = {"generate": 0}

        @app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("")

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": "0.26.0-double"})

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]})

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            t, labels = self.truth, f'engine="0",model_name="{MODEL}"'
            lines = [
                "# TYPE vllm:generation_tokens_total counter", f"vllm:generation_tokens_total{{{labels}}} {t.tokens}.0",
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {t.rounds}.0",
                "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {t.rounds * self.script.drafts_per_round}.0",
                "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {t.accepted}.0",
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
            ]
            for i in range(self.script.drafts_per_round):
                count = self.per_position[i] if i < len(self.per_position) else 0
                lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {count}.0')
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            polls["generate"] += 1
            if polls["generate"] <= self.generate_503:
                return JSONResponse({"object": "error", "message": "engine not ready", "code": 503}, status_code=503)
            n = int(body.get("max_tokens") or 16)
            events, truth = self.script.request(n)
            self._record(truth)
            prompt = body.get("prompt")
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            head = {"id": "cmpl-vllm", "object": "text_completion", "created": 1, "model": MODEL}

            def usage(done: int) -> dict:
                return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

            if not body.get("stream"):
                choice = {"index": 0, "text": " tok" * n, "finish_reason": "length", "stop_reason": None}
                return JSONResponse({**head, "choices": [choice], "usage": usage(n)})
            options = body.get("stream_options") or {}

            async def stream():
                done = 0
                for i, k in enumerate(events):
                    await asyncio.sleep(self.pause_s)
                    done += k
                    last = i == len(events) - 1
                    chunk: dict = {**head, "choices": [{"index": 0, "text": " tok" * k, "logprobs": None,
                                                        "finish_reason": "length" if last else None,
                                                        "stop_reason": None}]}
                    if options.get("continuous_usage_stats"):
                        chunk["usage"] = usage(done)
                    yield f"data: {json.dumps(chunk)}\n\n"
                if options.get("include_usage"):
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(n)})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        return app
