"""POST /server_config changes the default tree settings for later requests, without a restart."""

from __future__ import annotations

BODY = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def tree_of(client, **extra) -> dict:
    r = client.post("/v1/completions", json={**BODY, **extra})
    assert r.status_code == 200, r.text
    return r.json()["ddtree"]["tree"]


def test_defaults_change_live(client, engine):
    start = client.get("/server_config").json()["ddtree"]
    assert start == engine.defaults.to_dict() and tree_of(client)["budget"] == start["budget"]

    r = client.post("/server_config", json={"ddtree": {"budget": 3, "topk": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["ddtree"] == {**start, "budget": 3, "topk": 2}
    assert tree_of(client) == {**start, "budget": 3, "topk": 2}
    # A request's own settings still win over the new defaults, merged field by field.
    assert tree_of(client, ddtree={"budget": 5}) == {**start, "budget": 5, "topk": 2}

    r = client.post("/server_config", json={"ddtree": {"method": "dflash"}})
    assert r.json()["ddtree"]["method"] == "dflash" and r.json()["ddtree"]["budget"] == 3
    assert tree_of(client)["method"] == "dflash"
    assert client.get("/server_config").json()["ddtree"] == engine.defaults.to_dict()


def test_rejected_change_leaves_defaults_alone(client, engine):
    before = client.get("/server_config").json()
    r = client.post("/server_config", json={"ddtree": {"budget": 10_000}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ddtree.budget"
    assert client.get("/server_config").json() == before
    assert tree_of(client) == before["ddtree"]
