"""The OpenAI-compatible HTTP server (``ddtree serve``): FastAPI + uvicorn over one engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not, with per-request tree settings
in a ``"ddtree"`` object), ``GET /v1/models``, ``GET /health`` (503 until the engine is warm), ``GET /server_info``,
``GET /metrics`` (Prometheus), ``GET``/``POST /server_config`` (the default tree settings, changed live).

    from ddtree.server import create_app, serve_app
    app = create_app(engine)                   # a running Engine; or create_app(engine_factory=...)
    serve_app(app, host="127.0.0.1", port=8000)  # blocks; SIGTERM drains and returns 0
"""

from ddtree.server.app import create_app
from ddtree.server.cli import serve_app

__all__ = ["create_app", "serve_app"]
