"""Profile tables: the fixtures load, save/load round-trips, and bad files fail with the file and field named."""

import copy
import json
from pathlib import Path

import pytest

from m2flow.planner.profile import Profile, ProfileError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"
GOOD = json.loads((FIXTURES / "embodied_hybrid.json").read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_fixtures_load_and_round_trip(name, tmp_path):
    p = Profile.load(FIXTURES / name)
    assert p.measurements and set(p.components) == set(p.stages)
    p.save(tmp_path / "again.json")
    q = Profile.load(tmp_path / "again.json")
    assert q.to_dict() == p.to_dict()
    assert q.source == str(tmp_path / "again.json")


def test_fields_are_read():
    p = Profile.from_dict(GOOD, "x.json")
    assert p.flow == "embodied" and p.stages == ("env", "rollout", "actor") and p.loop == ("env", "rollout")
    assert p.batch == 64 and p.machine.devices == 4 and p.machine.memory_bytes == 40_000_000_000
    assert p.components["actor"].streams is False and p.components["actor"].fixed_seconds == 0.3
    assert p.components["env"].shard_state is False  # default
    assert p.weights.source == "actor" and p.weights.to == ("rollout",)
    assert p.transfer.seconds(1000) == pytest.approx(0.001 + 1000 * 1e6 / 1e9 * 0.1)
    m = p.measurements[0]
    assert (m.component, m.batch, m.devices) == ("env", 8, 1) and m.peak_bytes > 0


def mutate(fn):
    data = copy.deepcopy(GOOD)
    fn(data)
    return data


BAD = [
    (lambda d: d.pop("batch"), r"batch is missing"),
    (lambda d: d.update(batch=0), r"batch must be >= 1, got 0"),
    (lambda d: d.update(batch="64"), r"batch must be a whole number"),
    (lambda d: d.update(bacth=3), r"bacth is not a known field \(did you mean 'batch'\?\)"),
    (lambda d: d.update(stages=[]), r"stages is empty"),
    (lambda d: d.update(stages=["env", "env", "actor"]), r"stages lists a component twice"),
    (lambda d: d.update(loop=["rollout", "env"]), r"loop must be the first two stages"),
    (lambda d: d["machine"].pop("memory_bytes"), r"machine.memory_bytes is missing"),
    (lambda d: d["machine"].update(devices=-1), r"machine.devices must be >= 1"),
    (lambda d: d["components"].pop("actor"), r"components.actor is missing"),
    (lambda d: d["components"]["actor"].update(streams="no"), r"components.actor.streams must be true or false"),
    (lambda d: d["components"]["env"].update(offload_seconds=-1), r"components.env.offload_seconds must be >= 0"),
    (lambda d: d["components"]["env"].update(state=1), r"components.env.state is not a known field \(did you mean 'state_bytes'\?\)"),
    (lambda d: d["measurements"][2].update(seconds=0), r"measurements\[2\].seconds must be > 0"),
    (lambda d: d["measurements"][1].update(component="rolout"), r"measurements\[1\].component is 'rolout'.*did you mean 'rollout'"),
    (lambda d: d["measurements"][0].update(devices=16), r"measurements\[0\].devices is 16, but the profiled machine has 4"),
    (lambda d: d["measurements"][3].pop("batch"), r"measurements\[3\].batch is missing"),
    (lambda d: d.update(measurements=[r for r in d["measurements"] if r["component"] != "actor"]),
     r"measurements has no row for component 'actor'"),
    (lambda d: d["weights"].update(to=["critic"]), r"weights.to names 'critic', which is not a stage"),
    (lambda d: d["transfer"].update(seconds_per_gb="fast"), r"transfer.seconds_per_gb must be a number"),
    (lambda d: d["components"]["actor"].update(merge_samples=-1), r"components.actor.merge_samples must be >= 0"),
    (lambda d: d.update(cohosted_scale=0.5), r"cohosted_scale must be > 0 and only in a profile without a "
                                             r"loop \(profiles with one use loop_latency"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_bad_profile_names_file_and_field(tmp_path, change, message):
    path = tmp_path / "bad_profile.json"
    path.write_text(json.dumps(mutate(change)))
    with pytest.raises(ProfileError, match=rf"^{tmp_path}/bad_profile.json: .*{message}"):
        Profile.load(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{\"flow\": ")
    with pytest.raises(ProfileError, match=r"broken.json: not valid JSON"):
        Profile.load(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ProfileError, match=r"list.json: the top level must be a JSON object"):
        Profile.load(tmp_path / "list.json")


def test_the_documented_example_is_a_valid_profile():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    example = doc.split("```json\n", 1)[1].split("```", 1)[0]
    p = Profile.from_dict(json.loads(example), "docs/planner.md")
    assert p.stages == ("rollout", "reward", "inference", "actor") and len(p.measurements) == 5

