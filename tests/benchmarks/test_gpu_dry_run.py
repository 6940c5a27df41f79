"""benchmarks/gpu.py's dry run on the CPU (the demo pair as is): the cells it writes, and the per-request timeline
that says where a cell's wall time went."""

from __future__ import annotations

import json

import torch
from benchmark_scripts import load_script

from ddtree.models import gemm_backend


def test_dry_run_records_a_closed_loop_timeline(tmp_path, monkeypatch):
    for name in ("synchronize", "reset_peak_memory_stats", "max_memory_allocated", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))  # the dry run stubs them; restored after
    monkeypatch.setattr(gemm_backend, "enabled", gemm_backend.enabled)
    out = tmp_path / "run"
    load_script("gpu").main(["--device", "cpu", "--shape", "none", "--no-hf", "--concurrency", "2", "--contexts", "16",
                             "--budgets", "4", "--new-tokens", "6", "--out", str(out)])
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
    assert "| 2 | 16 | ddtree-b4 |" in (out / "gpu.md").read_text()
