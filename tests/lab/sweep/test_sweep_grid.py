"""The sweep grid: ids, baselines, presets, config files, launch-template checks."""

from __future__ import annotations

import sys

import pytest

from ddtree.errors import ConfigError
from ddtree.lab.sweep.cli import build_config
from ddtree.lab.sweep.grid import (
    LaunchSpec,
    SweepConfig,
    SweepPoint,
    parse_dim,
    parse_list,
    render_template,
    template_placeholders,
)
from ddtree.lab.sweep.presets import PRESETS, get_preset


def test_points_include_baselines_first_and_read_like_settings():
    cfg = SweepConfig(budgets=(4, 8), topks=(4, None), block_sizes=(16,), draft_windows=(2048, None))
    ids = [p.config_id for p in cfg.points()]
    assert ids == [
        "ar",
        "dflash-bs16-w2048",
        "dflash-bs16-wnone",
        "ddtree-b4-k4-bs16-w2048",
        "ddtree-b4-k4-bs16-wnone",
        "ddtree-b4-knone-bs16-w2048",
        "ddtree-b4-knone-bs16-wnone",
        "ddtree-b8-k4-bs16-w2048",
        "ddtree-b8-k4-bs16-wnone",
        "ddtree-b8-knone-bs16-w2048",
        "ddtree-b8-knone-bs16-wnone",
    ]
    assert len(set(ids)) == len(ids)


def test_baselines_are_included_even_without_ddtree():
    ids = [p.config_id for p in SweepConfig(methods=("dflash",)).points()]
    assert ids == ["ar", "dflash-bstrained-wnone"]


def test_tree_settings_spell_out_every_knob_of_the_method():
    # an explicit None keeps the server's defaults out of a measured config
    assert SweepPoint("ar").tree_settings() == {"method": "ar"}
    assert SweepPoint("dflash", block_size=None, draft_window=64).tree_settings() == {
        "method": "dflash", "block_size": None, "draft_window": 64,
    }
    assert SweepPoint("ddtree", budget=8, topk=None, block_size=16, draft_window=None).tree_settings() == {
        "method": "ddtree", "budget": 8, "topk": None, "block_size": 16, "draft_window": None,
    }


def test_seed_preset_is_the_users_campaign():
    seed = get_preset("seed")
    assert seed.budgets == (4, 8, 12, 16)
    assert seed.topks == (4, 6, 8)
    assert seed.draft_windows == (2048, None)
    assert seed.block_sizes == (8, 16)
    assert seed.contexts == (60, 1024, 4096, 8192)
    assert seed.concurrency == (1, 8, 32, 64)
    assert seed.gate_tasks is None  # the bench's 5-task GATE_TASKS
    # AR + DFlash per (block, window) + the DDTree product
    assert len(seed.points()) == 1 + 2 * 2 + 4 * 3 * 2 * 2


def test_demo_preset_measures_a_workload_where_acceptance_means_something_within_its_token_budget():
    demo = get_preset("demo")
    assert len(demo.budgets) >= 3
    assert demo.repeats >= 2  # the report can then say whether margins beat the noise
    assert demo.output_tokens >= 128  # enough rounds per request for an acceptance length
    assert min(demo.contexts) <= 64 and max(demo.contexts) >= 512  # a short prompt and a long one
    assert demo.warmup is False and demo.gate_max_tokens >= 128
    # Its cost on the 2-core CPU (docs/benchmarks.md) follows from the tokens it generates, not from a timed test:
    # 5 configs x 4 cells x 2 repeats x 4 requests x 128 tokens, plus at most 128 tokens per gate answer.
    points = demo.points()
    assert len(points) == 1 + 1 + 3
    runs = len(points) * len(demo.contexts) * len(demo.concurrency) * demo.repeats
    bench_tokens = runs * demo.num_requests * demo.output_tokens
    gate_tokens = len(points) * 5 * demo.gate_max_tokens
    assert bench_tokens == 20_480 and bench_tokens + gate_tokens <= 24_000


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match="demo"):
        get_preset("nope")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name):
    cfg = PRESETS[name]
    assert SweepConfig.from_dict(cfg.to_dict()) == cfg


def test_dict_round_trip_with_launch_and_dims():
    cfg = SweepConfig(
        budgets=(4, 8),
        topks=(4,),
        dims=(("tp", ("1", "8")),),
        launch=LaunchSpec("serve --tp {tp} --budget {budget} --topk {topk} --port {port}",
                          ar="serve --tp {tp} --port {port}", dflash="serve --tp {tp} --dflash --port {port}"),
    )
    assert SweepConfig.from_dict(cfg.to_dict()) == cfg
    ids = [p.config_id for p in cfg.points()]
    assert ids[:3] == ["ar-tp1", "dflash-bstrained-wnone-tp1", "ddtree-b4-k4-bstrained-wnone-tp1"]
    assert ids[4:7] == ["ar-tp8", "dflash-bstrained-wnone-tp8", "ddtree-b4-k4-bstrained-wnone-tp8"]


def test_toml_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        """
[grid]
budget = [4, 8]
topk = [4, "none"]
draft_window = [2048, "none"]
[bench]
contexts = [60, 1024]
concurrency = [1, 8]
output_tokens = 64
repeats = 3
[gate]
tasks = ["HumanEval/0"]
max_tokens = 256
"""
    )
    cfg = SweepConfig.from_file(path)
    assert cfg == SweepConfig(
        name="mine", budgets=(4, 8), topks=(4, None), draft_windows=(2048, None), contexts=(60, 1024),
        concurrency=(1, 8), output_tokens=64, repeats=3, gate_tasks=("HumanEval/0",), gate_max_tokens=256,
    )


def test_toml_launch_section_and_dims(tmp_path):
    path = tmp_path / "l.toml"
    path.write_text(
        """
[grid]
budget = [4]
topk = [4]
[dims]
tp = [1, 8]
[launch]
command = "python -m sglang.launch_server --tp-size {tp} --budget {budget} --topk {topk} --port {port}"
ar = "python -m sglang.launch_server --tp-size {tp} --port {port}"
dflash = "python -m sglang.launch_server --tp-size {tp} --algo dflash --port {port}"
ready_timeout_s = 60
"""
    )
    cfg = SweepConfig.from_file(path)
    assert cfg.dims == (("tp", ("1", "8")),)
    assert cfg.launch is not None and cfg.launch.ready_timeout_s == 60
    assert len(cfg.points()) == 2 * 3


def test_toml_unknown_key_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[grid]\nbudgett = [4]\n")
    with pytest.raises(ConfigError, match="budgett"):
        SweepConfig.from_file(path)


def test_yaml_file(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "y.yaml"
    path.write_text("grid:\n  budget: [4, 8]\n  topk: [none]\nbench:\n  contexts: [60]\n  concurrency: [1]\n")
    cfg = SweepConfig.from_file(path)
    assert cfg.budgets == (4, 8) and cfg.topks == (None,) and cfg.contexts == (60,)


def test_yaml_without_pyyaml_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "y.yaml"
    path.write_text("grid: {}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail like an absent package
    with pytest.raises(ConfigError, match="PyYAML"):
        SweepConfig.from_file(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budgets": (0,)}, "budget must be integers >= 1"),
        ({"topks": (4, 0)}, "topk"),
        ({"block_sizes": (16,), "draft_windows": (8,)}, "draft_window 8 is smaller than block_size 16"),
        ({"methods": ("eagle",)}, "unknown method 'eagle'"),
        ({"dims": (("tp", ("1",)),)}, "only mean something to a launched engine"),
        ({"contexts": ()}, "contexts needs at least one value"),
    ],
)
def test_invalid_grids_say_what_to_change(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SweepConfig(**kwargs)


@pytest.mark.parametrize(
    ("launch", "kwargs", "message"),
    [
        (LaunchSpec("serve --tp {tp} --port {port}"), {}, r"\{tp\} has no values"),
        (LaunchSpec("serve --budget {budget} --port {port}"), {"topks": (4,)}, "has \\{budget\\}, which ar"),
        (LaunchSpec("serve --budget {budget} --topk {topk} --port {port}", ar="a --port {port}",
                    dflash="d --port {port}"), {}, "grid has topk=none"),
        (LaunchSpec("serve --budget {budget} --port {port}", ar="a --port {port}", dflash="d --port {port}"),
         {"budgets": (4, 8), "topks": (4, 6)}, "varies topk"),
        (LaunchSpec("serve --budget {budget}", ar="a", dflash="d"), {"topks": (4,)}, "no \\{port\\}"),
    ],
)
def test_launch_templates_are_checked_against_the_grid(launch, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SweepConfig(launch=launch, **kwargs)


def test_launch_template_with_fixed_port_is_accepted():
    cfg = SweepConfig(topks=(4,), launch=LaunchSpec("serve --budget {budget} --topk {topk}", ar="a", dflash="d",
                                                    port=30000))
    assert cfg.launch is not None and cfg.launch.port == 30000


def test_template_placeholders_leave_json_alone():
    template = "vllm serve M --speculative-config '{\"method\": \"x\", \"n\": {budget}}' --port {port}"
    assert template_placeholders(template) == ["budget", "port"]
    rendered = render_template(template, {"budget": "8", "port": "1234"})
    assert rendered == "vllm serve M --speculative-config '{\"method\": \"x\", \"n\": 8}' --port 1234"
    with pytest.raises(ConfigError, match="\\{port\\}"):
        render_template(template, {"budget": "8"})


def test_parsers():
    assert parse_list("4, 8,none", what="topk", optional=True) == (4, 8, None)
    with pytest.raises(ConfigError, match="--budget does not accept 'none'"):
        parse_list("4,none", what="budget")
    with pytest.raises(ConfigError, match="'x' is not an integer"):
        parse_list("4,x", what="budget")
    assert parse_dim("tp=1,8") == ("tp", ("1", "8"))
    with pytest.raises(ConfigError, match="NAME=V1,V2"):
        parse_dim("tp")


def test_cli_flags_refine_a_preset():
    cfg = build_config(preset="demo", budgets="4,16", topks="none", contexts="32")
    demo = get_preset("demo")
    assert cfg.budgets == (4, 16) and cfg.topks == (None,) and cfg.contexts == (32,)
    assert cfg.concurrency == demo.concurrency and cfg.name == "demo"
    assert build_config(preset="demo", gate_tasks="none").gate_tasks == ()


def test_cli_launch_with_dims():
    cfg = build_config(budgets="4", topks="4", dims=["tp=1,2"], launch="s --tp {tp} --b {budget} --k {topk} --port {port}",
                       launch_ar="s --tp {tp} --port {port}", launch_dflash="s --tp {tp} --d --port {port}")
    assert cfg.launch is not None and len(cfg.points()) == 6
    with pytest.raises(ConfigError, match="need --launch"):
        build_config(launch_ar="x")


def test_text_flag_sets_the_prompt_filler():
    assert build_config(preset="demo").prompt_text == "code"
    assert build_config(preset="demo", text="words").prompt_text == "words"
    assert build_config().prompt_text == "words"
    with pytest.raises(ConfigError, match="prompt text"):
        build_config(text="poems")
