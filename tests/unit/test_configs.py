"""Every config a user can start from runs: each flow's defaults and every preset load and build their plan."""

import pytest

from m2flow import config as C
from m2flow.embodied import flow as embodied
from m2flow.embodied.config import EmbodiedConfig
from m2flow.planner.plan import make_plan
from m2flow.reasoning import flow as reasoning
from m2flow.reasoning.config import ReasoningConfig

FLOWS = {"reasoning": (ReasoningConfig, reasoning.COMPONENTS), "embodied": (EmbodiedConfig, embodied.COMPONENTS)}


@pytest.mark.parametrize("flow", sorted(FLOWS))
def test_a_flows_defaults_build_a_plan_on_one_machine(flow):
    cls, components = FLOWS[flow]
    cfg = C.load(cls, None, [])
    for devices in (1, 2):
        plan = make_plan(cfg.cluster.placement, devices, components, 64, 32)
        assert plan.placement.mode == "collocated" and sorted(plan.placement.components) == sorted(components)
        # one process per component over the devices: the reasoning actor trains on one rank (actor.backend torch)
        assert all(len(plan[c].rank_devices) == 1 for c in components)


@pytest.mark.parametrize("flow", sorted(FLOWS))
def test_a_flow_called_with_placement_auto_names_the_api(flow, tmp_path):
    """Auto mode is resolved above the flows (m2flow.train -> planning.auto -> flow.train(cfg, cluster, plan)): a flow
    called directly without a plan refuses before it starts anything or writes into its run directory."""
    cls, _ = FLOWS[flow]
    cfg = C.load(cls, None, [f"run.dir={tmp_path}", "run.name=r", "cluster.placement=auto"])
    module = reasoning if flow == "reasoning" else embodied

    class NoCluster:  # the plan is checked before any worker is launched
        num_devices = 2

    with pytest.raises(ValueError, match=r"cluster.placement: auto is resolved before a flow runs: use m2flow.train"):
        module.train(cfg, NoCluster())
    assert not (tmp_path / "r" / "config.yaml").exists()


@pytest.mark.parametrize("preset", sorted(p.stem for p in C.CONFIG_DIR.glob("*.yaml")))
def test_every_preset_loads_and_builds_its_plan(preset):
    data = C.read_yaml(C.resolve_path(preset))
    cls, components = FLOWS[data.get("flow", "reasoning")]
    cfg = C.load(cls, data, [])
    if cls is ReasoningConfig:
        components = reasoning.components(cfg)  # with the critic under algorithm.name=ppo
    if cfg.cluster.placement != "auto":
        make_plan(cfg.placement(), 2, components, 64, 32)
    if cls is ReasoningConfig:  # from random weights the reward stays 0: a warm start or a model of the user's
        assert cfg.sft.steps > 0 or cfg.model.path, f"{preset}: neither sft.steps nor model.path"


@pytest.mark.parametrize("preset", sorted(p.stem for p in C.CONFIG_DIR.glob("*.yaml")))
def test_validation_leaves_the_placement_as_written(preset):
    """Validation checks and never rewrites: the critic and the tool component are placed where the plan is made
    (`cfg.placement()`), not in `cluster.placement` (a PPO preset, a tool-calling one and the defaults alike)."""
    data = C.read_yaml(C.resolve_path(preset))
    cfg = C.load(FLOWS[data.get("flow", "reasoning")][0], data, [])
    assert cfg.cluster.placement == data.get("cluster", {}).get("placement", type(cfg.cluster)().placement)


def test_a_mapping_given_as_an_override_replaces_the_presets_where_dotted_keys_merge():
    """`agent.tools={}` turns a preset's tools off (a mapping value replaces, whole); `agent.tools.py=python` adds one
    tool to the preset's."""
    assert C.load(ReasoningConfig, "agent_calc").agent.tools == {"calc": "calc"}
    off = C.load(ReasoningConfig, "agent_calc", ["agent.tools={}"])
    assert off.agent.tools == {} and "tool" not in off.placement()
    assert C.load(ReasoningConfig, "agent_calc", ["agent.tools={py: python}"]).agent.tools == {"py": "python"}
    assert C.load(ReasoningConfig, "agent_calc", ["agent.tools.py=python"]).agent.tools == {"calc": "calc",
                                                                                             "py": "python"}


@pytest.mark.parametrize("preset", ["ppo_pickcube", "grpo_arithmetic"])
def test_a_runs_saved_config_loads_back_as_the_same_flow_with_its_values(preset, tmp_path):
    from m2flow import api

    cfg = api.load_config(preset, ["run.steps=7", "run.seed=3"])
    C.save_yaml(cfg, tmp_path / "config.yaml")
    assert C.read_yaml(tmp_path / "config.yaml")["flow"] == type(cfg).FLOW
    again = api.load_config(str(tmp_path / "config.yaml"), ["run.resume=true"])
    assert type(again) is type(cfg)
    assert C.to_dict(again) == {**C.to_dict(cfg), "run": {**C.to_dict(cfg)["run"], "resume": True}}


def _numeric_fields(cls, where=""):
    """(dotted name, type hint, declared Interval or None) of every field of `cls` that holds numbers."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, name = hints[f.name], f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(hint):
            yield from _numeric_fields(hint, name)
            continue
        leaves = set(typing.get_args(hint)) | {hint}
        leaves |= {a for leaf in list(leaves) for a in typing.get_args(leaf)}  # list[int] -> int
        if leaves & {int, float}:
            yield name, hint, f.metadata.get("within")


def _outside(within, hint):
    """Values just outside `within` (and NaN and inf for a float field), written as an override would be."""
    import math
    import typing

    floats = float in set(typing.get_args(hint)) | {hint}
    lo = within.lo - (1 if within.lo_closed else 0) if not math.isinf(within.lo) else None
    hi = within.hi + (1 if within.hi_closed else 0) if not math.isinf(within.hi) else None
    values = [v for v in (lo, hi) if v is not None]
    values = [v if floats else int(v) for v in values] + (["nan", "inf", "-inf"] if floats else [])
    listed = typing.get_origin(hint) is list
    return [f"[{v}]" if listed else str(v) for v in values]


@pytest.mark.parametrize("cls", [ReasoningConfig, EmbodiedConfig])
def test_every_numeric_field_declares_its_range_and_a_value_outside_it_is_refused_naming_the_field(cls):
    fields = list(_numeric_fields(cls))
    assert len(fields) > 50
    assert [name for name, _, within in fields if within is None] == []
    for name, hint, within in fields:
        default = C.load(cls)
        for value in _outside(within, hint):
            with pytest.raises(C.ConfigError, match=f"^{name} must be .*, got "):
                C.load(cls, None, [f"{name}={value}"])
        assert C.load(cls) == default  # the defaults lie inside every range


def test_a_range_reads_as_a_bound_and_help_config_shows_it():
    assert [str(C.Interval(t)) for t in ("[0, inf)", "(0, inf)", "(-inf, 1]", "(0, 1]", "(-inf, inf)")] == [
        ">= 0", "> 0", "<= 1", "in (0, 1]", "a finite number"]
    assert 0.5 in C.Interval("(0, 1]") and 1 in C.Interval("(0, 1]") and 0 not in C.Interval("(0, 1]")
    assert float("nan") not in C.Interval("(-inf, inf)") and 10**400 in C.Interval("[0, inf)")
    rows = {name: text for name, _, text in C.describe(ReasoningConfig)}
    assert rows["rollout.top_p"].startswith("[in (0, 1]] nucleus sampling")
    assert rows["actor.lr"].startswith("[> 0] the AdamW learning rate")
    with pytest.raises(C.ConfigError, match=r"^policy.hidden must be >= 1 \(each of them\), got \[64, 0\]$"):
        C.load(EmbodiedConfig, None, ["policy.hidden=[64, 0]"])
    with pytest.raises(C.ConfigError, match=r"^actor.lr must be > 0, got nan$"):
        C.load(ReasoningConfig, None, ["actor.lr=nan"])
