"""Atomic writes, cell state and failure records of a run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ddtree.errors import ConfigError
from ddtree.lab.sweep.grid import SweepConfig
from ddtree.lab.sweep.layout import BENCH_SCHEMA, RunLayout, atomic_write_json, read_json
from ddtree.lab.sweep.manifest import Manifest


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "a" / "cell.json"
    atomic_write_json(path, {"v": 1})
    inode = path.stat().st_ino
    atomic_write_json(path, {"v": 2, "nan": float("nan")})
    assert json.loads(path.read_text()) == {"v": 2, "nan": None}
    assert path.stat().st_ino != inode  # a new file renamed over the old one, never rewritten in place
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    with pytest.raises(TypeError):
        atomic_write_json(path, {"v": object()})
    assert json.loads(path.read_text())["v"] == 2  # a failed write leaves the old file
    assert [p.name for p in path.parent.iterdir()] == ["cell.json"]  # and no temp file behind


def test_a_writer_killed_mid_write_never_leaves_a_torn_file(tmp_path):
    # a child rewrites a large file in a loop; we SIGKILL it and the file must still parse
    path = tmp_path / "big.json"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from ddtree.lab.sweep.layout import atomic_write_json
        i = 0
        while True:
            atomic_write_json(Path({str(path)!r}), {{"i": i, "data": list(range(200000))}})
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = 200
        while not path.exists() and deadline:
            deadline -= 1
            subprocess.run(["sleep", "0.05"])
        subprocess.run(["sleep", "0.3"])
    finally:
        proc.kill()
        proc.wait()
    data = json.loads(path.read_text())
    assert data["data"][-1] == 199999


def test_cell_state_and_failures(tmp_path):
    layout = RunLayout(tmp_path / "run")
    assert not layout.bench_done("ar", 60, 1)
    layout.bench_path("ar", 60, 1).parent.mkdir(parents=True)
    layout.bench_path("ar", 60, 1).write_text('{"schema": "ddtree.bench.cell/1", "summ')  # torn by hand
    assert not layout.bench_done("ar", 60, 1)
    atomic_write_json(layout.bench_path("ar", 60, 1), {"schema": "something/else"})
    assert not layout.bench_done("ar", 60, 1)
    atomic_write_json(layout.bench_path("ar", 60, 1), {"schema": BENCH_SCHEMA})
    assert layout.bench_done("ar", 60, 1)

    layout.record_failure("ar", "ctx60-c8", {"kind": "http", "error": "HTTP 500"})
    layout.record_failure("ar", "humaneval", {"kind": "crash", "error": "gone"})
    assert set(layout.failures("ar")) == {"ctx60-c8", "humaneval"}
    layout.clear_failure("ar", "ctx60-c8")
    assert set(layout.failures("ar")) == {"humaneval"}
    layout.clear_failure("ar", "humaneval")
    assert not layout.failure_path("ar").exists()


def test_events_survive_a_torn_last_line(tmp_path):
    layout = RunLayout(tmp_path)
    layout.log_event("cell_done", cell="a")
    with layout.events_path.open("a") as fh:
        fh.write('{"event": "cell_do')  # killed mid-append
    layout.log_event("cell_done", cell="b")
    assert [e["cell"] for e in layout.events()] == ["a", "b"]


def test_manifest_resume_checks_the_grid(tmp_path):
    layout = RunLayout(tmp_path / "run")
    cfg = SweepConfig(budgets=(4,), contexts=(60,), concurrency=(1,))
    manifest = Manifest.open(layout, cfg, {"mode": "inprocess"}, resume=False)
    manifest.finish("interrupted")
    data = read_json(layout.manifest_path)
    assert data["configs"] == ["ar", "dflash-bstrained-wnone", "ddtree-b4-knone-bstrained-wnone"]
    session = data["sessions"][0]
    assert session["environment"]["versions"]["ddtree"] and session["environment"]["hardware"]["cpu_count"]
    with pytest.raises(ConfigError, match="--resume"):
        Manifest.open(layout, cfg, {"mode": "inprocess"}, resume=False)
    with pytest.raises(ConfigError, match="differs in: budgets"):
        Manifest.open(layout, SweepConfig(budgets=(8,), contexts=(60,), concurrency=(1,)), {}, resume=True)
    again = Manifest.open(layout, cfg, {"mode": "inprocess"}, resume=True)
    again.finish("finished")
    data = read_json(layout.manifest_path)
    assert [s["resumed"] for s in data["sessions"]] == [False, True]
    assert [s["status"] for s in data["sessions"]] == ["interrupted", "finished"]


def test_git_revision_is_recorded_when_run_from_a_checkout():
    from ddtree.lab.sweep.manifest import git_revision

    rev = git_revision()
    if rev is None:
        pytest.skip("not running from a git checkout")
    assert len(rev["commit"]) == 40 and isinstance(rev["dirty"], bool)
    assert os.path.isdir(rev["path"])


def test_versions_name_the_installed_torch_and_triton():
    """What scripts/test.sh prints first and every manifest records: the torch and Triton actually imported."""
    import importlib.util

    import torch

    from ddtree.lab.sweep.manifest import versions

    found = versions()
    assert found["torch"] == torch.__version__
    if importlib.util.find_spec("triton") is None:
        assert found["triton"] is None
    else:
        import triton

        assert found["triton"] == triton.__version__
