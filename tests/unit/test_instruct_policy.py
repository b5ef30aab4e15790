"""Instruction-conditioned observations and policy (issue 24): ManiSkill envs with `instruct` show [the instruction's
word ids; the state padded to 48], so three tasks share one observation space, and `InstructActorCritic` reads the
task from the words."""

import numpy as np
import pytest
import torch
from gymnasium import spaces

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import EnvGroup, make_env_fns, maniskill
from m2flow.embodied.policies import build_policy
from m2flow.embodied.steps import iteration_metrics

MULTI = "PickCube-v1,PushCube-v1,StackCube-v1"


def test_instructions_become_word_ids_padded_to_a_fixed_length():
    ids = maniskill.tokenize("Pick up the cube and fly")
    assert ids.shape == (maniskill.INSTRUCTION_TOKENS,) and ids.dtype == np.int64
    assert [maniskill.VOCAB[i] for i in ids[:5]] == ["pick", "up", "the", "cube", "and"]
    assert ids[5] == 1 and not ids[6:].any()  # "fly" is unknown; then padding
    assert len({tuple(maniskill.tokenize(t)) for t in maniskill.TASKS.values()}) == 3


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_multi_task_group_shows_each_env_its_instruction_and_a_padded_state():
    g = EnvGroup(make_env_fns(MULTI, 3, seed=0, instruct=True), env_id=MULTI)
    obs = g.reset(seed=0)
    k = maniskill.INSTRUCTION_TOKENS
    assert obs.shape == (3, k + maniskill.STATE_DIM)
    for i, task in enumerate(MULTI.split(",")):  # env i runs task i % 3
        assert obs[i, :k].tolist() == maniskill.tokenize(maniskill.TASKS[task]).tolist()
    assert g._s.tasks == MULTI.split(",")  # what its episodes will name
    assert not obs[0, k + 42:].any() and not obs[1, k + 35:].any() and obs[2, k + 42:].any()  # 42, 35, 48 numbers
    g.close()
    with pytest.raises(ValueError, match="need instruction observations"):
        make_env_fns(MULTI, 3)
    with pytest.raises(ValueError, match="instruction observations .* are for the ManiSkill3 tasks"):
        make_env_fns("CartPole-v1", 1, instruct=True)


def test_envs_that_share_a_reset_seed_run_one_task():
    """Embodied GRPO on several tasks: a group of env.seed_groups envs shares a reset seed and compares its outcomes,
    so it runs one task; with groups of 1 the envs take turns, as before."""
    tasks = MULTI.split(",")
    assert maniskill.env_tasks(MULTI, 4) == [*tasks, tasks[0]]
    assert maniskill.env_tasks(MULTI, 12, seed_groups=2) == [t for t in tasks for _ in range(2)] * 2
    g = EnvGroup.make(MULTI, 6, seed=7, seed_groups=2, env_kwargs={"instruct": True})
    obs = g.reset()
    assert g._s.tasks == [t for t in tasks for _ in range(2)]  # what its episodes name, as the envs were made
    k = maniskill.INSTRUCTION_TOKENS
    for i in range(0, 6, 2):  # a group: one seed, one task, so one initial observation
        assert obs[i].tolist() == obs[i + 1].tolist()
        assert obs[i, :k].tolist() == maniskill.tokenize(maniskill.TASKS[tasks[i // 2]]).tolist()
    assert obs[0].tolist() != obs[2].tolist() != obs[4].tolist()
    g.close()


def test_an_iterations_metrics_give_each_tasks_success():
    def episode(task, success):
        return {"env_index": 0, "return": 1.0, "length": 5, "success_once": success, "success": success, "task": task}

    out = {"episodes": [episode("PickCube-v1", True), episode("PushCube-v1", False), episode("PickCube-v1", False)],
           "env_steps": 15, "seconds": 1.0, "env_time": 0.5, "policy_time": 0.2, "wait_time": 0.3}
    got = iteration_metrics([out, {**out, "episodes": [episode("PushCube-v1", True)]}], [])
    assert got["rollout/success_once"] == 0.5
    assert got["rollout/success_once/PickCube-v1"] == 0.5 and got["rollout/success_once/PushCube-v1"] == 0.5
    assert "rollout/success_once/StackCube-v1" not in got  # no episode of it ended
    single = iteration_metrics([{**out, "episodes": [{k: v for k, v in episode("", True).items() if k != "task"}]}], [])
    assert not [k for k in single if k.startswith("rollout/success_once/")]


def test_the_policy_acts_on_the_instruction():
    k, state = maniskill.INSTRUCTION_TOKENS, maniskill.STATE_DIM
    torch.manual_seed(0)
    policy = build_policy(spaces.Box(-np.inf, np.inf, (k + state,)), spaces.Box(-1, 1, (4,)), kind="instruct",
                          hidden=(32, 32), activation="tanh", chunk=2)
    x = torch.randn(1, state).repeat(3, 1)  # one state, three instructions
    words = torch.tensor(np.stack([maniskill.tokenize(t) for t in maniskill.TASKS.values()]), dtype=torch.float32)
    obs = torch.cat([words, x], dim=1)
    with torch.no_grad():
        actions = policy.act(obs, deterministic=True)[0]
    assert actions.shape == (3, 2, 4)  # a chunk of 2 actions each
    assert not torch.allclose(actions[0], actions[1]) and not torch.allclose(actions[1], actions[2])
    logprob, _, value = policy.evaluate(obs, actions)
    (logprob.sum() + value.sum()).backward()
    assert policy.embed.weight.grad[maniskill.VOCAB.index("stack")].abs().sum() > 0  # the words learn
    assert policy.embed.weight.grad[0].abs().sum() == 0  # padding does not
    with pytest.raises(ValueError, match="word ids outside"):
        policy.act(torch.cat([words.neg() - 1, x], dim=1))


def test_the_policy_and_the_observations_go_together():
    with pytest.raises(C.ConfigError, match="policy.kind=instruct and env.instruct=true go together"):
        C.load(EmbodiedConfig, "ppo_pickcube", ["policy.kind=instruct"])
    cfg = C.load(EmbodiedConfig, "ppo_pickcube", [f"env.id={MULTI}", "env.instruct=true", "policy.kind=instruct"])
    assert cfg.env.id == MULTI
    # GRPO on several tasks: its groups run one task each (test_envs_that_share_a_reset_seed_run_one_task)
    grpo = C.load(EmbodiedConfig, "ppo_maniskill3", ["algorithm.name=grpo", "env.seed_groups=2"])
    assert grpo.algorithm.name == "grpo" and grpo.env.seed_groups == 2
