"""Fixtures for the server tests: a real engine over the tiny random pair, its app, and an ASGI client."""

from __future__ import annotations

import pytest
from server_helpers import SyncClient

from ddtree.server.app import create_app

# Small limits keep every generation on the tiny pair well under a second on one CPU thread.
ENGINE_LIMITS = {"max_batch": 8, "max_len": 256, "max_budget": 16, "max_queue": 64}


@pytest.fixture
def engine(tiny_engine_factory):
    return tiny_engine_factory(**ENGINE_LIMITS)


@pytest.fixture
def app(engine):
    return create_app(engine)


@pytest.fixture
def client(app) -> SyncClient:
    return SyncClient(app)
