"""Offload in collocated plans (issue 15, `cluster.offload`): the components that share a device take turns on it,
and each moves its weights and optimizer state off it when its turn ends (to disk, on CPU devices) and back when its
next begins. Training is bit for bit the same as with everything resident."""

import json

import pytest
import yaml
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train

COLLOCATED = "cluster.placement=rollout,reward,inference,actor: 0-1:0"
# every stateful component holds a model: the inference stage the old and reference policies, the actor its optimizer
STATEFUL = ["algorithm.kl_coef=0.01", "algorithm.old_logprobs=recompute"]


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=true", "run.steps=3",
            "run.save_every=2", "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4",
            "actor.lr=1e-3", "data.train_size=200", "data.eval_size=20", "reward.fn=reward_fixtures:digit_fraction",
            COLLOCATED, *STATEFUL]
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster)
    out = tmp_path / name
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out


def turns(trace_path) -> dict[int, list[tuple[float, float, str]]]:
    """Per device lane of the trace: (onload start, offload end, component) of every turn with its state on it."""
    events = sorted((e for e in json.loads(trace_path.read_text())["traceEvents"]
                     if e.get("ph") == "X" and e["name"] in ("onload", "offload")), key=lambda e: e["ts"])
    lanes: dict[int, list] = {}
    began: dict[tuple, float] = {}
    for e in events:
        key = (e["pid"], e["cat"])
        if e["name"] == "onload":
            began[key] = e["ts"]
        elif key in began:  # an offload ends the turn its onload began (the first offloads end construction)
            lanes.setdefault(e["pid"], []).append((began.pop(key), e["ts"] + e["dur"], e["cat"]))
    return lanes


@pytest.mark.parametrize("cohost", [True, False], ids=["one process", "a process per component"])
def test_offload_between_turns_trains_bit_identically_with_one_components_state_on_a_device_at_a_time(
        cluster, tmp_path, cohost):
    """Collocated in one process (the stages take turns in it) or one process per component (they take turns through
    the device lock): with `cluster.offload=true` every step brings rollout, inference and actor state back for their
    turns, never two components' at once on a device, and the metrics and final weights equal the resident run's."""
    hosting = f"rollout.cohost={str(cohost).lower()}"
    resident, plain_dir = run(cluster, tmp_path, "resident", hosting)
    switched, switched_dir = run(cluster, tmp_path, "switched", hosting, "cluster.offload=true")
    for a, b in zip(resident, switched, strict=True):
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl", "response/length_mean"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    final = "checkpoints/step_3/model/model.safetensors"
    wa, wb = load_file(str(plain_dir / final)), load_file(str(switched_dir / final))
    assert all(wa[k].equal(wb[k]) for k in wa)

    assert yaml.safe_load((switched_dir / "plan.yaml").read_text())["offload"] is True
    assert yaml.safe_load((plain_dir / "plan.yaml").read_text())["offload"] is False
    assert all(r["offload/onloads"] >= 3 and r["offload/seconds"] > 0 for r in switched)  # rollout, inference, actor
    # between steps none of the switched state stays on the devices: the four copies of the model (rollout, the
    # inference stage's old and reference policies, actor: 2.2 MB at the start; Adam's moments come later) are on disk
    assert all(r["offload/state_bytes"] > 2e6 and r["offload/resident_bytes"] == 0 for r in switched)
    assert not any("offload/onloads" in r for r in resident)
    lanes = turns(switched_dir / "trace.json")
    assert set(lanes) == {0, 1}
    for lane, spans in lanes.items():
        assert {c for _, _, c in spans} == {"rollout", "inference", "actor"}
        for (_, end, who), (start, _, nxt) in zip(spans, spans[1:]):
            assert end <= start, f"device {lane}: {nxt}'s state came on before {who}'s went off"


@pytest.mark.parametrize("memory_gb,offloads", [(0.001, True), (100.0, False)])
def test_offload_auto_switches_when_the_devices_state_exceeds_its_memory(cluster, tmp_path, memory_gb, offloads):
    """`cluster.offload=auto`: the tiny model's weights, copies and optimizer state (several MB on each device) exceed
    1 MB but not 100 GB."""
    rows, out = run(cluster, tmp_path, "auto", "run.steps=1", "cluster.offload=auto",
                    f"cluster.device_memory_gb={memory_gb}")
    assert yaml.safe_load((out / "plan.yaml").read_text())["offload"] is offloads
    assert ("offload/onloads" in rows[0]) is offloads


def test_offload_is_checked():
    with pytest.raises(C.ConfigError, match="cluster.offload must be true | false | auto, got 'sometimes'"):
        C.load(ReasoningConfig, None, ["cluster.offload=sometimes"])
    with pytest.raises(C.ConfigError, match="the embodied flow keeps its small policies resident"):
        C.load(EmbodiedConfig, "ppo_cartpole", ["cluster.offload=true"])
