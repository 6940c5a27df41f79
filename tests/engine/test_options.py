"""Engine flags generated from EngineConfig (ddtree.engine.options) and the one integer-list parser."""

from __future__ import annotations

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import HELP, engine_fields, engine_options, int_list
from ddtree.errors import ConfigError


def _app(**kwargs) -> tuple[typer.Typer, list[EngineConfig]]:
    seen: list[EngineConfig] = []
    app = typer.Typer()

    @app.command()
    @engine_options(**kwargs)
    def cmd(other: int = typer.Option(1), *, engine_config: EngineConfig) -> None:
        seen.append(engine_config)

    return app, seen


def test_every_engine_field_has_a_help_line():
    assert {f.name for f in engine_fields()} == set(HELP)
    assert {f.name for f in dataclasses.fields(EngineConfig)} - set(HELP) == {"default_tree"}


def test_flags_reach_the_config_and_omitted_ones_keep_its_defaults():
    app, seen = _app(exclude=("max_batch",), defaults={"max_len": 999})
    out = CliRunner().invoke(app, ["--no-cuda-graphs", "--overlap-rounds", "--no-gpu-kernels", "--target", "t",
                                   "--kv-memory-fraction", "0.5", "--max-block-size", "4"])
    assert out.exit_code == 0, out.output
    assert seen[-1] == EngineConfig(target="t", max_len=999, cuda_graphs=False, overlap_rounds=True,
                                    gpu_kernels=False, kv_memory_fraction=0.5, max_block_size=4)
    out = CliRunner().invoke(app, [])
    assert out.exit_code == 0 and seen[-1] == EngineConfig(max_len=999)  # overlap_rounds stays None (auto)
    assert CliRunner().invoke(app, ["--max-batch", "3"]).exit_code != 0  # excluded: no such flag


def test_serve_has_the_switches_it_used_to_lack():
    from ddtree.server.cli import serve

    params = set(serve.__signature__.parameters)
    assert {"cuda_graphs", "gpu_kernels", "overlap_rounds", "prefill_graphs", "api_key", "max_body_bytes"} <= params


def test_a_field_that_is_not_an_option_is_refused():
    with pytest.raises(ConfigError, match="max_batchh"):
        engine_options(exclude=("max_batchh",))


def test_int_list():
    assert int_list("4, 8,16,") == (4, 8, 16)
    with pytest.raises(ConfigError, match="--budgets must be comma-separated integers"):
        int_list("4,x", name="--budgets")
