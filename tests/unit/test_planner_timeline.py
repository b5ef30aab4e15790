"""The predicted-schedule picture and the `m2flow plan` command's logic (plan beyond the profiled machine)."""

import shutil
from pathlib import Path

import yaml

from m2flow.planner.profile import Profile
from m2flow.planner.search import plan_command, search
from m2flow.planner.timeline import plot_predicted

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_predicted_writes_two_panel_png(tmp_path):
    p = Profile.load(FIXTURES / "pipeline_wins.json")
    r = search(p, 4)
    out = plot_predicted(p, r.best, tmp_path / "plots" / "plan.png", compare=r.collocated)
    data = Path(out).read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    single = plot_predicted(p, r.best, tmp_path / "one.png")
    assert Path(single).read_bytes().startswith(PNG)


def test_plan_command_plans_64_devices_from_an_8_device_profile(tmp_path):
    profile = tmp_path / "profile.json"
    shutil.copy(FIXTURES / "reasoning_8xh100.json", profile)
    text = plan_command(profile, 64, batch=4096)
    assert "profiled on 8 x H100-80GB" in text and "planning for 64 device(s), 4096 samples per step" in text
    assert "#  mode" in text and "chosen: " in text and "breakdown: " in text
    assert "64 devices > the 8 profiled" in text
    plan = yaml.safe_load((tmp_path / "plan_64dev.yaml").read_text())  # default: next to the profile
    assert plan["placement_spec"] in text and plan["predicted_step_seconds"] > 0
    assert sum(len(ranks) for ranks in plan["placement"].values()) >= 64
    assert (tmp_path / "plan_64dev.png").read_bytes().startswith(PNG)
    assert f"timeline: {tmp_path / 'plan_64dev.png'}" in text


def test_plan_command_with_max_staleness_predicts_the_overlap(tmp_path):
    on = plan_command(FIXTURES / "collocate_wins.json", 4, out_dir=tmp_path / "on")
    off = plan_command(FIXTURES / "collocate_wins.json", 4, out_dir=tmp_path / "off", staleness=1)
    assert "generation up to 1 step(s) ahead (max_staleness)" in off and "ahead" not in on
    assert "chosen: collocated" in on and "chosen: hybrid" in off
    assert "overlap with the next steps' generation (max_staleness 1) -" in off  # a negative part of the breakdown
    plan = yaml.safe_load((tmp_path / "off" / "plan_4dev.yaml").read_text())
    assert plan["predicted_step_seconds"] < yaml.safe_load((tmp_path / "on" / "plan_4dev.yaml").read_text())[
        "predicted_step_seconds"]


def test_plan_command_out_dir_and_embodied(tmp_path):
    text = plan_command(FIXTURES / "embodied_hybrid.json", 4, out_dir=tmp_path / "out")
    assert "env: 0-1; rollout: 2-3; actor: all" in text and "2 loop pipeline stage(s)" in text
    assert (tmp_path / "out" / "plan_4dev.png").exists() and (tmp_path / "out" / "plan_4dev.yaml").exists()
