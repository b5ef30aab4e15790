"""Placement specs: valid forms, modes, rank spreading, and error messages that quote the spec (no Ray)."""

import pytest

from m2flow.runtime.placement import ComponentPlacement, PlacementError, parse_placement


def test_collocated_names_share_devices():
    p = parse_placement("actor,rollout: 0-1", 2)
    assert p.mode == "collocated"
    assert p["actor"].rank_devices == ((0,), (1,))
    assert p["rollout"].devices == (0, 1) and p["rollout"].world_size == 2
    assert p.shares_device("actor", "rollout")


def test_disaggregated_with_semicolons():
    p = parse_placement("rollout: 0; actor: 1", 2)
    assert p.mode == "disaggregated"
    assert p["rollout"].rank_devices == ((0,),) and p["actor"].rank_devices == ((1,),)
    assert not p.shares_device("rollout", "actor")


def test_hybrid_with_commas_and_all():
    p = parse_placement("env: 0, rollout: 1, actor: all", 2)
    assert p.mode == "hybrid"
    assert list(p.components) == ["env", "rollout", "actor"]
    assert p["actor"].rank_devices == ((0,), (1,))
    assert p.shares_device("env", "actor") and not p.shares_device("env", "rollout")


def test_comma_joined_names_after_a_comma_entry():
    p = parse_placement("a: 0, b,c: 1-2", 3)
    assert p["b"].devices == p["c"].devices == (1, 2)
    assert p.mode == "hybrid"  # b and c share devices, a does not


def test_ranks_spread_evenly_over_devices():
    assert parse_placement("actor: 0-1:0-3", 2)["actor"].rank_devices == ((0,), (0,), (1,), (1,))
    assert parse_placement("actor: 0-1:0", 2)["actor"].rank_devices == ((0, 1),)
    assert parse_placement("actor: 0-3:0-1", 4)["actor"].rank_devices == ((0, 1), (2, 3))
    assert parse_placement("actor: 1", 2)["actor"].rank_devices == ((1,),)


def test_dict_form_and_trailing_separator():
    p = parse_placement({"actor,rollout": "0-1", "reward": 0}, 2)
    assert p["reward"].devices == (0,) and p.mode == "hybrid"
    assert "actor" in p and "critic" not in p
    assert parse_placement("a: 0;", 1)["a"].devices == (0,)


def test_components_given_match():
    p = parse_placement("rollout: 0; actor: 1", 2, components=["actor", "rollout"])
    assert set(p.components) == {"actor", "rollout"}


def test_component_placement_properties():
    cp = ComponentPlacement("x", ((1, 0), (3,)))
    assert cp.world_size == 2 and cp.devices == (0, 1, 3)


@pytest.mark.parametrize("spec, n, components, needle", [
    ("actor: 0-2", 2, None, "device 2 does not exist; the cluster has 2 device(s)"),
    ("actor: 5", 4, None, "numbered 0-3"),
    ("actor 0-1", 2, None, "cannot parse"),
    ("actor: 0-1,2", 4, None, "cannot parse"),
    ("actor: 1-0", 2, None, "end is below the start"),
    ("actor: x", 2, None, "bad devices 'x'"),
    ("", 2, None, "empty"),
    ("   ", 2, None, "empty"),
    ("actor: 0; actor: 1", 2, None, "'actor' is listed twice"),
    ("actor,actor: 0", 2, None, "listed twice"),
    ("actor: 0", 2, ["actor", "rollout"], "rollout have no devices"),
    ("actor: 0; critic: 1", 2, ["actor"], "unknown component(s) critic"),
    ("actor: 0-2:0-1", 3, None, "2 ranks on 3 devices"),
    ("actor: 0-1:0-2", 2, None, "3 ranks on 2 devices"),
    ("actor: 0-1:1-2", 2, None, "must start at 0"),
    ("all: 0", 2, None, "device keyword"),
])
def test_errors_quote_the_spec(spec, n, components, needle):
    with pytest.raises(PlacementError) as err:
        parse_placement(spec, n, components)
    assert needle in str(err.value)
    assert repr(spec.strip()) in str(err.value)


def test_unknown_component_lookup_lists_known():
    p = parse_placement("rollout: 0; actor: 1", 2)
    with pytest.raises(PlacementError, match="no component 'critic'; known: rollout, actor"):
        p["critic"]
    assert issubclass(PlacementError, ValueError)
