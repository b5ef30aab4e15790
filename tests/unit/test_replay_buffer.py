"""The replay buffer: ring order, uniform sampling, episode boundaries as SB3 handles them, checkpoint round trip,
and the clear error of a buffer that does not fit in memory."""

import pytest
import torch

from m2flow.embodied.envs import Trajectory
from m2flow.embodied.sac.replay import ReplayBuffer, transitions


def rows(lo: int, n: int, obs_dim: int = 2) -> dict[str, torch.Tensor]:
    """n transitions numbered lo..lo+n-1 in every field."""
    i = torch.arange(lo, lo + n, dtype=torch.float32)
    return {"obs": i[:, None].repeat(1, obs_dim), "actions": -i[:, None], "rewards": i,
            "next_obs": i[:, None].repeat(1, obs_dim) + 0.5, "terminated": i % 2 == 0}


def test_the_ring_overwrites_the_oldest_and_samples_only_what_it_holds():
    buf = ReplayBuffer(5, (2,), (1,), seed=0)
    buf.add(rows(0, 3))
    assert len(buf) == 3
    assert set(buf.sample(200)["rewards"].tolist()) == {0.0, 1.0, 2.0}
    buf.add(rows(3, 4))  # 3..6: 5 and 6 overwrite slots 0 and 1
    assert len(buf) == 5 and buf.pos == 2
    assert buf.data["rewards"].tolist() == [5.0, 6.0, 2.0, 3.0, 4.0]
    got = buf.sample(500)
    assert set(got["rewards"].tolist()) == {2.0, 3.0, 4.0, 5.0, 6.0}
    # every field of a sampled row comes from the same transition
    assert torch.equal(got["obs"][:, 0], got["rewards"]) and torch.equal(got["actions"][:, 0], -got["rewards"])
    assert torch.equal(got["terminated"], got["rewards"] % 2 == 0)


def test_sampling_is_uniform():
    buf = ReplayBuffer(4, (2,), (1,), seed=1)
    buf.add(rows(0, 4))
    counts = torch.bincount(buf.sample(40_000)["rewards"].long(), minlength=4).float() / 40_000
    assert torch.allclose(counts, torch.full((4,), 0.25), atol=0.01)


def test_a_larger_batch_than_the_capacity_keeps_the_newest():
    buf = ReplayBuffer(3, (2,), (1,))
    buf.add(rows(0, 7))
    assert sorted(buf.data["rewards"].tolist()) == [4.0, 5.0, 6.0] and len(buf) == 3


def test_episode_ends_keep_their_last_obs_and_only_termination_stops_the_bootstrap():
    # 3 steps of 2 envs; obs[t, i] = 10 t + i. Env 0 is truncated at t=1 (a time limit), env 1 terminated at t=0:
    # the env auto-reset both, so obs[t + 1] is the next episode's first obs, 100 + ...
    obs = torch.tensor([[[0.0], [1.0]], [[10.0], [100.0]], [[101.0], [21.0]]])
    terminated = torch.tensor([[False, True], [False, False], [False, False]])
    truncated = torch.tensor([[False, False], [True, False], [False, False]])
    final_obs = torch.zeros(3, 2, 1)
    final_obs[0, 1], final_obs[1, 0] = -1.0, -2.0  # the last obs of the episodes that ended
    z = torch.zeros(3, 2)
    traj = Trajectory(obs=obs, actions=torch.zeros(3, 2, 1), logprobs=z, values=z, rewards=torch.ones(3, 2),
                      terminated=terminated, truncated=truncated, final_values=z,
                      next_obs=torch.tensor([[30.0], [31.0]]), next_values=torch.zeros(2), final_obs=final_obs)
    t = transitions(traj)
    # time-major: (t=0, env 0), (t=0, env 1), (t=1, env 0), ...
    assert t["obs"][:, 0].tolist() == [0.0, 1.0, 10.0, 100.0, 101.0, 21.0]
    assert t["next_obs"][:, 0].tolist() == [10.0, -1.0, -2.0, 21.0, 30.0, 31.0]
    assert t["terminated"].tolist() == [False, True, False, False, False, False]  # the truncation bootstraps
    with pytest.raises(ValueError, match="final_obs"):
        transitions(Trajectory(**{**traj.__dict__, "final_obs": None}))


def test_a_restored_buffer_samples_what_the_original_goes_on_to_sample():
    a = ReplayBuffer(6, (2,), (1,), seed=3)
    a.add(rows(0, 4))
    a.sample(8)
    state = {k: v.clone() for k, v in a.state_dict().items()}
    assert state["data.rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]  # only the rows held are saved
    b = ReplayBuffer(6, (2,), (1,), seed=99)
    b.load_state_dict(state)
    for step in range(3):
        a.add(rows(10 * step, 3))
        b.add(rows(10 * step, 3))
        sa, sb = a.sample(16), b.sample(16)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ValueError, match="sac.buffer_size is 7"):
        ReplayBuffer(7, (2,), (1,)).load_state_dict(state)


def test_a_buffer_too_large_for_memory_fails_before_it_allocates():
    need = ReplayBuffer.bytes_needed(10**12, (17,), (6,))
    assert need == 10**12 * (2 * 17 * 4 + 6 * 4 + 4 + 1)
    with pytest.raises(MemoryError, match=r"1,000,000,000,000 transitions needs .* GiB.*lower sac.buffer_size"):
        ReplayBuffer(10**12, (17,), (6,))
    assert ReplayBuffer(1000, (17,), (6,)).nbytes == ReplayBuffer.bytes_needed(1000, (17,), (6,))
