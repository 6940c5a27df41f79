"""Sweeps for real: the tiny engine in-process over HTTP, per-config ``ddtree serve`` launches, failures, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from ddtree.lab.sweep.grid import LaunchSpec, SweepConfig
from ddtree.lab.sweep.launcher import LaunchedServer, free_port, group_members
from ddtree.lab.sweep.layout import RunLayout, atomic_write_json, read_json
from ddtree.lab.sweep.runner import SweepTarget, run_sweep

TINY = SweepConfig(
    name="tiny",
    budgets=(2, 6),
    topks=(None,),
    contexts=(12,),
    concurrency=(1, 2),
    output_tokens=8,
    num_requests=2,
    repeats=1,
    gate_tasks=("HumanEval/0", "HumanEval/23"),
    gate_max_tokens=12,
)


def _cells_done(events: list[dict]) -> Counter:
    return Counter((e["config_id"], e["cell"]) for e in events if e["event"] == "cell_done")


@pytest.mark.slow
def test_inprocess_sweep_measures_every_cell_and_reports(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(oracle=True, max_len=1024)
    outcome = run_sweep(TINY, SweepTarget(), tmp_path / "run", engine=engine)
    assert outcome.status == "finished" and outcome.cells_failed == 0
    layout = RunLayout(tmp_path / "run")
    ids = [p.config_id for p in TINY.points()]
    assert ids == ["ar", "dflash-bstrained-wnone", "ddtree-b2-knone-bstrained-wnone", "ddtree-b6-knone-bstrained-wnone"]
    assert outcome.cells_run == len(ids) * 3  # two bench cells and the gate each
    accept = {}
    for cid in ids:
        for ctx, conc in TINY.bench_cells():
            cell = read_json(layout.bench_path(cid, ctx, conc))
            assert cell["config"]["config_id"] == cid and cell["engine"] == "ddtree"
            assert cell["workload"]["prompt_lengths"] == [12, 12]
            assert cell["summary"]["errors"] == 0
            for request in cell["runs"][0]["requests"]:
                assert request["completion_tokens"] == 8
            accept[cid] = cell["summary"]["accept_length"]
    # the tree settings reached the engine per request: AR commits one token per round, the oracle-drafted
    # chain and trees more, and a bigger tree at least as much as a smaller one on the same text
    assert accept["ar"] == pytest.approx(8 / 7)  # one token per round, after the prefill's first token
    assert accept["dflash-bstrained-wnone"] > 1.0
    assert accept["ddtree-b6-knone-bstrained-wnone"] >= accept["ddtree-b2-knone-bstrained-wnone"] > 1.0
    # the lossless gate: every speculative config's greedy gate outputs equal AR's byte for byte
    ar_gate = read_json(layout.eval_path("ar"))
    assert ar_gate["lossless"] is None and ar_gate["total"] == 2
    for cid in ids[1:]:
        gate = read_json(layout.eval_path(cid))
        assert gate["lossless"]["compared"] == 2 and gate["lossless"]["identical"] == 2, cid
    manifest = read_json(layout.manifest_path)
    assert manifest["configs"] == ids and manifest["sessions"][-1]["status"] == "finished"
    assert set(manifest["timings"]) == set(ids)
    assert all(v == 1 for v in _cells_done(list(layout.events())).values())
    md = (layout.root / "summary.md").read_text()
    assert "## Recommendations" in md and "Lossless check: all 3 speculative configs" in md

    # a finished run resumed does nothing and keeps every file
    inodes = {p: p.stat().st_ino for p in layout.configs_dir.rglob("*.json")}
    again = run_sweep(TINY, SweepTarget(), tmp_path / "run", engine=engine, resume=True, report=False)
    assert again.cells_run == 0 and again.cells_skipped == len(ids) * 3
    assert {p: p.stat().st_ino for p in layout.configs_dir.rglob("*.json")} == inodes


def test_failed_cells_are_recorded_and_the_sweep_goes_on(tiny_engine_factory, tmp_path):
    # max_len 64 fits ctx 12 + 8 output tokens but no HumanEval prompt: every gate fails with a 400, alone
    engine = tiny_engine_factory(max_len=64)
    cfg = SweepConfig(name="t", budgets=(2,), contexts=(12,), concurrency=(1,), output_tokens=8, num_requests=1,
                      gate_tasks=("HumanEval/0",), gate_max_tokens=8)
    outcome = run_sweep(cfg, SweepTarget(), tmp_path / "run", engine=engine)
    layout = RunLayout(tmp_path / "run")
    assert outcome.status == "finished-with-failures" and outcome.cells_failed == 3 and outcome.cells_run == 3
    for point in cfg.points():
        assert layout.bench_done(point.config_id, 12, 1)
        failure = layout.failures(point.config_id)["humaneval"]
        assert failure["kind"] == "http" and "1 gate request(s) failed" in failure["error"]
        assert failure["data"]["tasks"][0]["reason"].startswith("error: ")
    assert "## Failures" in (layout.root / "summary.md").read_text()


@pytest.mark.slow
def test_a_launch_that_never_gets_ready_is_recorded_and_the_sweep_goes_on(tmp_path):
    never = f"{sys.executable} -c \"import sys, time; print('loading', sys.argv[1:], flush=True); time.sleep(600)\""
    cfg = SweepConfig(
        name="never", budgets=(2, 4), topks=(2,), contexts=(12,), concurrency=(1,), gate_tasks=(),
        launch=LaunchSpec(f"{never} --budget {{budget}} --port {{port}}", ar=f"{never} --port {{port}}",
                          dflash=f"{never} --dflash --port {{port}}", ready_timeout_s=0.8, stop_timeout_s=2.0),
    )
    outcome = run_sweep(cfg, SweepTarget(mode="launch"), tmp_path / "run")
    layout = RunLayout(tmp_path / "run")
    ids = [p.config_id for p in cfg.points()]
    assert outcome.status == "finished-with-failures" and outcome.cells_failed == len(ids)
    for cid in ids:
        failure = layout.failures(cid)["launch"]
        assert failure["kind"] == "launch" and "not ready after 0.8 s" in failure["error"]
        assert failure["cells"] == ["ctx12-c1"]
        launch = read_json(layout.config_path(cid))["launch"]
        assert launch["load_to_ready_s"] is None and launch["port_freed"] is True
        assert group_members(launch["pid"]) == []  # stopped for good
        assert "loading" in layout.log_path(cid).read_text()  # stdout kept per config
    assert [e["config_id"] for e in layout.events() if e["event"] == "launch_failed"] == ids
    assert "## Failures" in (layout.root / "summary.md").read_text()

    # A sweep SIGKILLed while a server was up leaves it running (its own session): --resume stops it first.
    orphan = LaunchedServer(f"{sys.executable} -c \"import time; time.sleep(600)\"", port=free_port(),
                            log_path=tmp_path / "orphan.log")
    orphan.start()
    try:
        record = orphan.record.to_dict()  # as persisted at launch; stop_signal still None
        data = read_json(layout.config_path("ar"))
        atomic_write_json(layout.config_path("ar"), {**data, "launch": record})
        again = run_sweep(cfg, SweepTarget(mode="launch"), tmp_path / "run", resume=True, report=False)
        assert again.cells_failed == len(ids)  # still never ready, and recorded again
        assert group_members(record["pid"]) == []
        assert [e["pid"] for e in layout.events() if e["event"] == "orphan_stopped"] == [record["pid"]]
    finally:
        orphan.stop()


@pytest.mark.slow
def test_launch_path_starts_ddtree_serve_per_config(tiny_model_dirs, tmp_path):
    target, drafter = tiny_model_dirs
    serve = (f"{sys.executable} -m ddtree.server --target {target} --draft {drafter} --max-len 256 --max-batch 2 "
             "--log-level warning --port {port}")
    cfg = SweepConfig(
        name="launched", budgets=(4,), topks=(3,), contexts=(12,), concurrency=(1,), output_tokens=6, num_requests=2,
        gate_tasks=(),
        launch=LaunchSpec(f"{serve} --method ddtree --budget {{budget}} --topk {{topk}}",
                          ar=f"{serve} --method ar", dflash=f"{serve} --method dflash", ready_timeout_s=120),
    )
    outcome = run_sweep(cfg, SweepTarget(mode="launch", tokenizer=str(target)), tmp_path / "run")
    assert outcome.status == "finished", [RunLayout(tmp_path / "run").failures(p.config_id) for p in cfg.points()]
    layout = RunLayout(tmp_path / "run")
    for point in cfg.points():
        record = read_json(layout.config_path(point.config_id))["launch"]
        assert f"--method {point.method}" in record["command"]
        assert record["verified"] == "process-group" and record["load_to_ready_s"] > 0
        assert record["stop_signal"] == "SIGTERM" and record["port_freed"]
        assert group_members(record["pid"]) == []
        cell = read_json(layout.bench_path(point.config_id, 12, 1))
        assert cell["engine"] == "ddtree" and cell["summary"]["errors"] == 0
        # the launched server runs the requested method: its /server_info defaults say so
        info = cell["env"]["server_info"]
        assert json.dumps(info).count(point.method) >= 1
    assert read_json(layout.bench_path("ar", 12, 1))["summary"]["accept_length"] == pytest.approx(6 / 5)
    assert "## Launches" in (layout.root / "summary.md").read_text()


_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from conftest import OracleDrafter, build_tiny_pair
    from transformers import AutoTokenizer
    from ddtree.engine import Engine, EngineConfig
    from ddtree.lab.sweep.grid import SweepConfig
    from ddtree.lab.sweep.runner import SweepTarget, run_sweep
    tok = AutoTokenizer.from_pretrained({tokdir!r})
    target, inner = build_tiny_pair(tok)
    drafter = OracleDrafter(inner, target)
    engine = Engine.from_models(target, drafter, tok, EngineConfig(max_batch=2, max_len=1024, max_budget=16),
                                model_name="tiny")
    drafter.attach(engine)
    engine.start()
    cfg = SweepConfig.from_dict({cfg!r})
    run_sweep(cfg, SweepTarget(), Path({run!r}), engine=engine, resume={resume!r})
    """
)


@pytest.mark.slow
def test_kill_mid_sweep_then_resume_loses_and_repeats_nothing(tiny_tokenizer_dir, tiny_engine_factory, tmp_path):
    run = tmp_path / "run"
    layout = RunLayout(run)
    script = _CHILD.format(tests=str(Path(__file__).parents[2]), tokdir=str(tiny_tokenizer_dir),
                           cfg=TINY.to_dict(), run=str(run), resume=False)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and child.poll() is None:
            done = sum(1 for _ in layout.configs_dir.glob("*/bench/*.json")) if layout.configs_dir.is_dir() else 0
            if done >= 4:  # AR and the DFlash chain finished, in the middle of the sweep
                break
            time.sleep(0.05)
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    before = {p: p.stat().st_ino for p in layout.configs_dir.rglob("*.json") if p.name != "config.json"}
    finished_before = _cells_done(list(layout.events()))
    assert len(finished_before) >= 4
    total = len(TINY.points()) * 3
    assert len(finished_before) < total, "the sweep finished before the kill; kill it earlier"

    engine = tiny_engine_factory(oracle=True, max_len=1024)
    outcome = run_sweep(TINY, SweepTarget(), run, engine=engine, resume=True)
    assert outcome.status == "finished"
    assert outcome.cells_skipped + outcome.cells_run == total
    assert outcome.cells_skipped == len(finished_before)
    done = _cells_done(list(layout.events()))
    assert len(done) == total and set(done.values()) == {1}  # nothing lost, nothing measured twice
    for path, inode in before.items():
        if path.name != "failure.json":
            assert path.stat().st_ino == inode, f"{path} was rewritten on resume"
    sessions = read_json(layout.manifest_path)["sessions"]
    assert [s["status"] for s in sessions] == ["running", "finished"]  # the killed session never finished


def test_url_mode_sweeps_a_running_server_with_settings_per_request(tiny_engine_factory, tmp_path, tiny_tokenizer_dir):
    from ddtree.server.app import create_app
    from ddtree.server.threaded import ThreadedServer

    engine = tiny_engine_factory(oracle=True, max_len=256)
    cfg = SweepConfig(name="url", budgets=(4,), contexts=(12,), concurrency=(2,), output_tokens=8, num_requests=2,
                      gate_tasks=())
    with ThreadedServer(create_app(engine)) as server:
        outcome = run_sweep(cfg, SweepTarget(mode="url", url=server.url, tokenizer=str(tiny_tokenizer_dir)),
                            tmp_path / "run", report=False)
    assert outcome.status == "finished" and outcome.cells_run == 3
    layout = RunLayout(tmp_path / "run")
    accept = {p.config_id: read_json(layout.bench_path(p.config_id, 12, 2))["summary"]["accept_length"]
              for p in cfg.points()}
    assert accept["ar"] == pytest.approx(8 / 7) and accept["ddtree-b4-knone-bstrained-wnone"] > 1.5
    assert read_json(layout.manifest_path)["target"]["url"] == server.url
