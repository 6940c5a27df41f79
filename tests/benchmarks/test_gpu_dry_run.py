"""benchmarks/gpu.py's dry run on the CPU (the demo pair as is): the cells it writes, and the per-request timeline
that says where a cell's wall time went. The script is a preset over ddtree.lab.bench (matrix, inprocess), whose
pieces these tests reach there."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_script, script_path

from ddtree.lab.bench import matrix
from ddtree.lab.bench.inprocess import mean_in_flight


def test_dry_run_records_a_closed_loop_timeline(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cuda_calls = {name: getattr(torch.cuda, name) for name in ("synchronize", "max_memory_allocated")}
    load_script("gpu").main(["--device", "cpu", "--shape", "none", "--no-hf", "--concurrency", "2", "--contexts", "16",
                             "--budgets", "4", "--new-tokens", "6", "--waves", "2", "--out", str(out)])
    # device-agnostic: the CPU path calls no CUDA function, so it stubs none
    assert {name: getattr(torch.cuda, name) for name in cuda_calls} == cuda_calls
    report = json.loads((out / "gpu.json").read_text())
    assert [c["method"] for c in report["cells"]] == ["ar", "dflash", "ddtree-b4"]
    for cell in report["cells"]:
        timeline = cell["timeline"]
        assert len(timeline) == cell["prompts"] == 4  # two waves of C = 2
        for submitted, first, finished in timeline:
            assert 0 <= submitted <= first <= finished <= cell["wall_s"] + 1e-3
        # The closed loop: never more than C in flight, and the third prompt waits for a finish.
        events = sorted([(s, 1) for s, _, _ in timeline] + [(f, -1) for _, _, f in timeline], key=lambda e: (e[0], e[1]))
        in_flight = 0
        for _, step in events:
            in_flight += step
            assert in_flight <= 2
        assert timeline[2][0] >= min(timeline[0][2], timeline[1][2]) - 1e-3
        assert 1.0 <= cell["mean_in_flight"] <= 2.0
    assert "| 2 | 16 | ddtree-b4 |" in (out / "gpu.md").read_text()


def test_the_engine_s_cost_curve_is_written_beside_the_cells(tmp_path):
    """With a cost curve (here a file, EngineConfig.cost_curve), the run writes the one the engine used to
    OUT/cost_curve.json, for `ddtree replay predict --cost-curve`, and names its source in gpu.json."""
    from ddtree.engine.cost_curve import load_curve, make_curve, save_curve

    curve = make_curve("cpu", "standin-none (float32)", (1, 4), (0, 3, 7), (64, 512),
                       lambda r, b, k: 0.01 + 0.001 * r * (b + 1) + 1e-6 * k)
    path = save_curve(curve, tmp_path / "curve.json")
    out = tmp_path / "run"
    load_script("gpu").main(["--device", "cpu", "--shape", "none", "--no-hf", "--concurrency", "2", "--contexts", "16",
                             "--budgets", "4", "--new-tokens", "4", "--waves", "1", "--auto", "--cost-curve", str(path),
                             "--out", str(out)])
    assert load_curve(out / "cost_curve.json") == curve
    report = json.loads((out / "gpu.json").read_text())
    assert report["cost_curve"]["source"] == "file" and report["cost_curve"]["path"] == str(path)
    assert [c["method"] for c in report["cells"]][-1] == "ddtree-auto"


def test_compile_log_splits_compilations_by_window():
    """The listener's records land in the window they happened in, with disk-cache hits counted apart."""
    from types import SimpleNamespace

    log = matrix.CompileLog()
    times = SimpleNamespace(ir_initialization=1000, lowering_stages=[("ttir", 2000), ("ptx", 500_000)],
                            store_results=1000)
    log(src=None, metadata={"name": "_rms_norm_kernel"}, metadata_group={}, times=times, cache_hit=False)
    middle = log.events[-1][0] + 1e-6
    log(src=None, metadata={"name": "_silu_mul_kernel"}, metadata_group={}, times=times, cache_hit=True)
    log.events[-1] = (middle + 1.0, *log.events[-1][1:])
    first = log.between(0.0, middle)
    assert first == {"count": 1, "disk_hits": 0, "s": 0.504, "kernels": ["_rms_norm_kernel"]}
    second = log.between(middle, middle + 2.0)
    assert second == {"count": 1, "disk_hits": 1, "s": 0.504, "kernels": []}


def test_mean_in_flight_by_hand():
    """Two requests over 4 s: one for the whole cell, one from 1 s to 3 s -> (4 + 2) / 4 = 1.5 in flight."""
    assert mean_in_flight([[0.0, 0.1, 4.0], [1.0, 1.2, 3.0]], 4.0) == 1.5
    # A closed loop that never drains: always two in flight.
    assert mean_in_flight([[0.0, 0.1, 2.0], [0.0, 0.1, 1.0], [1.0, 1.1, 2.0]], 2.0) == 2.0


def test_a_timed_run_that_met_a_capture_is_timed_again(tmp_path, monkeypatch):
    """The first cell's timed run 'captures' two graphs: it runs once more; the row is the second run's, the
    warm-up's counts stay the warm-up's, and the first run is kept under ``retimed``."""
    gpu = load_script("gpu")
    calls, captured = [], [0]
    real_run_cell = matrix.run_cell

    def run_cell(engine, *args, **kwargs):
        out = real_run_cell(engine, *args, **kwargs)
        calls.append(engine)
        if len(calls) == 4:  # calls 1-2: the graph-vs-eager probe; 3: AR's warm-up; 4: AR's timed run
            captured[0] += 2
        return out

    monkeypatch.setattr(gpu, "run_cell", run_cell)  # the graph-vs-eager probe
    monkeypatch.setattr(matrix, "run_cell", run_cell)  # the cells' warm-ups and timed runs
    monkeypatch.setattr(matrix, "graph_captures", lambda engine: captured[0])
    out = tmp_path / "run"
    gpu.main(["--device", "cpu", "--shape", "none", "--no-hf", "--concurrency", "2", "--contexts", "16",
              "--budgets", "4", "--new-tokens", "4", "--waves", "1", "--out", str(out)])
    ar, chain, tree = json.loads((out / "gpu.json").read_text())["cells"]
    assert len(calls) == 2 + 3 + 2 + 2  # AR ran warm-up, timed, timed again; the others warm-up and timed
    assert ar["retimed"]["captures"] == 2 and ar["retimed"]["tok_s"] > 0
    assert ar["captures"] == {"warm_up": 0, "cell": 0}
    assert chain["retimed"] is None and tree["retimed"] is None


def test_compile_log_listens_to_triton_and_stops():
    knobs = pytest.importorskip("triton.knobs")
    log = matrix.CompileLog()
    before = knobs.compilation.listener
    try:
        assert log.install() is True and knobs.compilation.listener is log
        log.uninstall()
        assert knobs.compilation.listener is None
    finally:
        knobs.compilation.listener = before


def test_help_runs_on_the_cpu_and_lists_the_documented_flags():
    """docs/benchmarks.md's commands: --out --no-hf --concurrency --contexts --budgets --time-budget (and more)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, str(script_path("gpu")), "--help"], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    for flag in ("--out", "--no-hf", "--concurrency", "--contexts", "--budgets", "--time-budget", "--c1-prompts",
                 "--shape", "--quick", "--device", "--warm-up", "--waves", "--draft-fp8", "--no-blas-rule"):
        assert flag in res.stdout
