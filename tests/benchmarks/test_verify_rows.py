"""benchmarks/verify_rows.py's dry run on the CPU (the demo pair, eager): one timing per (context, rows), the JSON
and the table say the same."""

from __future__ import annotations

import json

from benchmark_scripts import load_script


def test_dry_run_times_every_row_count_at_every_context(tmp_path, capsys):
    script = load_script("verify_rows")
    out = tmp_path / "rows.json"
    script.main(["--device", "cpu", "--contexts", "8,12", "--rows", "1,3,5", "--reps", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["ms"]) == {"8", "12"}
    for per_rows in data["ms"].values():
        assert set(per_rows) == {"1", "3", "5"} and all(v > 0 for v in per_rows.values())
    printed = capsys.readouterr().out
    assert "| rows | ms at context 8 | ms at context 12 |" in printed
    assert printed.count("\n| 5 | ") == 1
