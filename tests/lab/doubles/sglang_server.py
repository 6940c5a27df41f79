"""A stand-in for an SGLang server (``python -m sglang.launch_server``) with DFlash/DDTree speculative decoding.

Follows SGLang's public HTTP API as of late 2026 (``python/sglang/srt/entrypoints/http_server.py`` and
``openai_api/serving_completions.py``, the ``meta_info`` keys of ``managers/tokenizer_manager.py``, the metric names
of ``metrics/collector.py``; summarised in ``docs/references.md``):

- ``/health`` answers 503 for the first ``health_503`` polls, then 200, while generation still answers 503 for
  the first ``generate_503`` requests: SGLang reports healthy before the model can generate.
- ``/v1/completions`` streams ``data:`` chunks with ``usage: null`` (SGLang sends usage once, at the end), several
  tokens per chunk (one verify round each), then a usage chunk with ``choices: []`` that carries
  ``sglext.spec_tokens_details`` when the request asked for ``return_spec_tokens_details``, then ``[DONE]``.
  Non-streamed answers carry ``meta_info`` on the choice.
- per-request fields: ``spec_verify_ct``, ``spec_accept_length`` (completion tokens / verify rounds),
  ``spec_accept_rate``, and the draft counts and histogram under the current names (``spec_num_correct_drafts``,
  ``spec_num_proposed_drafts``, ``spec_correct_drafts_histogram``) or the old ones (``spec_accepted_drafts``,
  ``spec_proposed_drafts``, ``spec_accept_histogram``): ``names`` = "new", "old" or "both" (SGLang today).
- ``/server_info`` (and the older ``/get_server_info``): ``internal_states[0].avg_spec_accept_length``, cumulative
  since start-up or the last ``/flush_cache`` (POST), which resets it.
- ``serve_metrics`` / ``report_details`` switch off ``/metrics`` and the per-request fields, to leave only
  ``/server_info`` as the acceptance source.
- ``/metrics``: ``sglang:generation_tokens_total``, ``sglang:spec_verify_calls_total`` (counters),
  ``sglang:spec_accept_length`` (gauge), labelled ``model_name`` and ``tp_rank``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from doubles.script import Script, Truth

MODEL = "double-sglang-model"


@dataclass
class SGLangDouble:
    names: str = "both"  # "new", "old" or "both"
    script: Script = field(default_factory=Script)
    health_503: int = 2
    generate_503: int = 1
    pause_s: float = 0.002
    serve_metrics: bool = True  # False: a server started without --enable-metrics (/metrics answers 404)
    report_details: bool = True  # False: a build that sends no per-request speculative fields
    truth: Truth = field(default_factory=Truth)  # since start-up: /metrics
    since_flush: Truth = field(default_factory=Truth)  # /server_info
    requests: list[Truth] = field(default_factory=list)

    def spec_fields(self, t: Truth) -> dict:
        proposed = t.rounds * self.script.drafts_per_round
        out: dict = {"spec_verify_ct": t.rounds, "spec_accept_length": t.tokens / t.rounds if t.rounds else 0.0,
                     "spec_accept_rate": t.accepted / proposed if proposed else 0.0}
        new = {"spec_num_correct_drafts": t.accepted, "spec_num_proposed_drafts": proposed,
               "spec_correct_drafts_histogram": list(t.hist)}
        old = {"spec_accepted_drafts": t.accepted, "spec_proposed_drafts": proposed,
               "spec_accept_histogram": list(t.hist)}
        if self.names in ("new", "both"):
            out.update(new)
        if self.names in ("old", "both"):
            out.update(old)
        return out

    def _record(self, t: Truth) -> None:
        self.requests.append(t)
        for total in (self.truth, self.since_flush):
            total.tokens += t.tokens
            for n, count in enumerate(t.hist):
                for _ in range(count):
                    total.rounds += 1
                    total.accepted += n
                    while len(total.hist) <= n:
                        total.hist.append(0)
                    total.hist[n] += 1

    def app(self) -> FastAPI:
        app = FastAPI()
        polls = {"health": 0, "generate": 0}

        @app.get("/health")
        async def health() -> PlainTextResponse:
            polls["health"] += 1
            return PlainTextResponse("", status_code=503 if polls["health"] <= self.health_503 else 200)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]})

        async def server_info() -> JSONResponse:
            t = self.since_flush
            return JSONResponse({"model_path": MODEL, "speculative_algorithm": "DFLASH", "internal_states": [
                {"avg_spec_accept_length": t.tokens / t.rounds if t.rounds else 0.0, "last_gen_throughput": 0.0}]})

        app.get("/server_info")(server_info)
        app.get("/get_server_info")(server_info)

        @app.post("/flush_cache")
        async def flush() -> PlainTextResponse:
            self.since_flush = Truth()
            return PlainTextResponse("Cache flushed.")

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            if not self.serve_metrics:
                return PlainTextResponse("Not Found", status_code=404)
            t, labels = self.truth, f'{{model_name="{MODEL}",tp_rank="0"}}'
            return PlainTextResponse(
                "# TYPE sglang:generation_tokens_total counter\n"
                f"sglang:generation_tokens_total{labels} {float(t.tokens)}\n"
                "# TYPE sglang:spec_verify_calls_total counter\n"
                f"sglang:spec_verify_calls_total{labels} {float(t.rounds)}\n"
                "# TYPE sglang:spec_accept_length gauge\n"
                f"sglang:spec_accept_length{labels} {t.tokens / t.rounds if t.rounds else 0.0}\n")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            polls["generate"] += 1
            if polls["generate"] <= self.generate_503:
                return JSONResponse({"object": "error", "message": "The server is not ready."}, status_code=503)
            n = int(body.get("max_tokens") or 16)
            events, truth = self.script.request(n)
            self._record(truth)
            prompt = body.get("prompt")
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            details = (self.spec_fields(truth) if body.get("return_spec_tokens_details") and self.report_details
                       else None)
            head = {"id": "cmpl-sgl", "object": "text_completion", "created": 1, "model": MODEL}
            if not body.get("stream"):
                choice = {"index": 0, "text": " tok" * n, "finish_reason": "length",
                          "meta_info": {"completion_tokens": n,
                                        **(self.spec_fields(truth) if self.report_details else {})}}
                return JSONResponse({**head, "choices": [choice], "usage": usage})

            async def stream():
                for i, k in enumerate(events):
                    await asyncio.sleep(self.pause_s)
                    last = i == len(events) - 1
                    choice = {"index": 0, "text": " tok" * k, "logprobs": None,
                              "finish_reason": "length" if last else None, "matched_stop": None}
                    yield f"data: {json.dumps({**head, 'choices': [choice], 'usage': None})}\n\n"
                final: dict = {**head, "choices": [], "usage": usage}
                if details is not None:
                    final["sglext"] = {"spec_tokens_details": details}
                yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        return app
