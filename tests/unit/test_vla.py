"""The pixel path below the flow: packed observations (fields as views of one uint8 row), the tiny VLA's two heads
(the token head's log-probabilities against a hand computation, its decoding against a greedy loop without the
key-value cache, bins and actions), the policy worker's sampler giving each env the same action in any stage split,
and the config's checks of policy.kind=vla."""

import numpy as np
import pytest
import torch
from gymnasium import spaces

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs.maniskill import INSTRUCTION_TOKENS, STATE_DIM, VOCAB, pixel_layout, tokenize
from m2flow.embodied.envs.packed import Field, PackedLayout
from m2flow.embodied.vla import GaussianVLA, TokenVLA
from m2flow.embodied.workers.policy import make_policy, sample_actions

BOX = spaces.Box(-1.0, 1.0, (4,), np.float32)
SIZE = 32  # frames of 32 x 32: 4 patches of 16


def rows(n: int, seed: int = 0) -> np.ndarray:
    """n packed pixel observations: random frames and states, the three tasks' instructions in turn."""
    rng = np.random.default_rng(seed)
    layout = pixel_layout(SIZE)
    texts = ["pick up the cube and move it to the goal", "push the cube to the goal region",
             "stack the red cube on top of the green cube"]
    return np.stack([layout.pack(state=rng.normal(size=STATE_DIM).astype(np.float32),
                                 progress=rng.uniform(size=1).astype(np.float32),
                                 instruction=tokenize(texts[i % 3]).astype(np.int32),
                                 rgb=rng.integers(0, 256, (3, SIZE, SIZE), dtype=np.uint8)) for i in range(n)])


def tiny(head: str, chunk: int = 1, seed: int = 0, value_hidden: tuple[int, ...] = ()):
    torch.manual_seed(seed)
    kw = dict(chunk=chunk, dim=16, layers=1, heads=2, patch=16, value_hidden=value_hidden)
    if head == "tokens":
        return TokenVLA(pixel_layout(SIZE), BOX, len(VOCAB), bins=8, **kw)
    return GaussianVLA(pixel_layout(SIZE), BOX, len(VOCAB), **kw)


def test_a_packed_row_holds_its_fields_and_unpacks_to_views_of_it():
    layout = PackedLayout([Field("state", "float32", (3,)), Field("ids", "int32", (2,)),
                           Field("rgb", "uint8", (3, 5, 5))])
    assert layout.offsets == {"state": 0, "ids": 16, "rgb": 24} and layout.nbytes == 104  # 8-aligned, padded
    a = layout.pack(state=np.array([1.5, -2.0, 3.25]), ids=np.array([7, 9]), rgb=np.full((3, 5, 5), 200))
    b = layout.pack(state=np.zeros(3), ids=np.array([1, 2]), rgb=np.arange(75).reshape(3, 5, 5))
    batch = torch.from_numpy(np.stack([a, b]))
    out = layout.unpack(batch)
    assert out["state"].dtype == torch.float32 and out["state"][0].tolist() == [1.5, -2.0, 3.25]
    assert out["ids"].tolist() == [[7, 9], [1, 2]] and out["rgb"].shape == (2, 3, 5, 5)
    assert out["rgb"][1].flatten().tolist() == list(range(75)) and out["rgb"].dtype == torch.uint8
    batch[0, 0:4] = torch.from_numpy(np.array([4.0], np.float32).view(np.uint8))  # a view: no copy was made
    assert out["state"][0, 0].item() == 4.0
    assert layout.unpack(batch[1:])["ids"].tolist() == [[1, 2]]  # a slice of rows unpacks too
    with pytest.raises(ValueError, match=r"field 'ids' of shape \(3,\), expected \(2,\)"):
        layout.pack(state=np.zeros(3), ids=np.zeros(3), rgb=np.zeros((3, 5, 5)))
    with pytest.raises(ValueError, match=r"packed rows \[B, 104\] uint8 expected"):
        layout.unpack(torch.zeros(2, 100, dtype=torch.uint8))


def test_the_pixel_layout_carries_state_instruction_and_frame():
    layout = pixel_layout(64)
    assert [(f.name, f.shape) for f in layout.fields.values()] == [
        ("state", (STATE_DIM,)), ("progress", (1,)), ("instruction", (INSTRUCTION_TOKENS,)), ("rgb", (3, 64, 64))]
    assert layout.space().shape == (layout.nbytes,) and layout.space().dtype == np.uint8


def test_action_tokens_are_bins_over_the_bounds_and_a_bin_centre_maps_back_to_its_bin():
    policy = tiny("tokens", chunk=2)
    index = torch.tensor([[0, 7, 3, 4, 1, 6, 2, 5]])
    actions = policy.to_actions(index)
    assert actions.shape == (1, 2, 4)
    assert actions[0, 0].tolist() == pytest.approx([-0.875, 0.875, -0.125, 0.125])  # centres of 8 bins on [-1, 1]
    assert torch.equal(policy.to_index(actions), index)
    assert policy.to_index(torch.tensor([[[-1.0, 1.0, -0.99, 0.26]] * 2])).tolist() == [[0, 7, 0, 5] * 2]


def test_the_token_heads_logprobs_are_the_sum_of_its_tokens_computed_by_hand():
    """Decoding with the key-value cache and the teacher-forced `evaluate` both give, for the chosen tokens, the sum
    of log_softmax(LM head) at each token given the prefix and the tokens before it, run here without a cache."""
    policy = tiny("tokens", chunk=2).eval()
    obs = torch.from_numpy(rows(3))
    gumbel = -torch.log(-torch.log(torch.rand(3, policy.n_tokens, policy.bins, generator=torch.Generator()
                                              .manual_seed(1))))
    with torch.no_grad():
        index, logprob, value = policy.decode(obs, gumbel)
        embeds, mask = policy.encoder.prefix(obs)
        want = torch.zeros(3)
        for j in range(policy.n_tokens):  # by hand: the whole sequence so far, one full pass per token
            fed = policy.encoder.lm.embed_tokens(index[:, :j])
            h = policy.encoder.lm(inputs_embeds=torch.cat([embeds, fed], 1),
                                  attention_mask=torch.cat([mask, torch.ones(3, j, dtype=mask.dtype)], 1)
                                  ).last_hidden_state[:, -1]
            log_p = torch.log_softmax(policy.lm_head(h), -1)
            assert torch.equal(index[:, j], (log_p + gumbel[:, j]).argmax(-1))  # the sample the noise picks
            want += log_p[torch.arange(3), index[:, j]]
        got, entropy, values = policy.evaluate(obs, policy.to_actions(index))
    assert index.shape == (3, 8) and logprob.shape == (3,)
    torch.testing.assert_close(logprob, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, value, rtol=1e-5, atol=1e-5)
    assert (entropy > 0).all() and (entropy <= 8 * np.log(8) + 1e-4).all()
    assert not torch.equal(index[0], index[1])  # the noise and the observations differ per env


def test_deterministic_token_decoding_takes_the_likeliest_token_each_time():
    policy = tiny("tokens").eval()
    obs = torch.from_numpy(rows(2, seed=3))
    with torch.no_grad():
        actions, logprob, _ = policy.act(obs, deterministic=True)
        logits, _ = policy.token_logits(obs, policy.to_index(actions))
    assert torch.equal(logits.argmax(-1), policy.to_index(actions))
    torch.testing.assert_close(torch.log_softmax(logits, -1).max(-1).values.sum(-1), logprob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head", ["gaussian", "tokens"])
def test_the_samplers_actions_per_env_do_not_depend_on_the_stage_split(head):
    """sample_actions with the envs cut into stages (lo/total) gives each env the whole batch's action: the noise is
    drawn for all envs and sliced, as for every other policy."""
    policy = tiny(head, chunk=2).eval()
    obs = torch.from_numpy(rows(6))
    whole = sample_actions(policy, obs, 123, 0, 6)
    parts = [sample_actions(policy, obs[:2], 123, 0, 6), sample_actions(policy, obs[2:], 123, 2, 6)]
    for k in range(3):
        torch.testing.assert_close(whole[k], torch.cat([p[k] for p in parts]), rtol=1e-5, atol=1e-5)
    assert whole[0].shape == (6, 2, 4)
    assert not torch.allclose(whole[0], sample_actions(policy, obs, 124, 0, 6)[0])


def test_the_gaussian_vlas_gradient_reaches_the_frame_the_words_and_the_state():
    policy = tiny("gaussian")
    obs = torch.from_numpy(rows(4))
    actions, _, _ = policy.act(obs)
    logprob, entropy, value = policy.evaluate(obs, actions.detach())
    (logprob.sum() + value.sum()).backward()
    enc = policy.encoder
    for name, p in (("vision", enc.vision[0].weight), ("words", enc.words.weight), ("state", enc.state.weight)):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    other = torch.from_numpy(rows(4, seed=9))
    with torch.no_grad():
        assert not torch.allclose(policy.act(obs, True)[0], policy.act(other, True)[0])  # it reads its inputs


@pytest.mark.parametrize("head", ["gaussian", "tokens"])
def test_the_value_loss_trains_the_value_head_and_never_the_encoder_the_actions_come_from(head):
    """In RL the critic reads the readout's state with its gradient stopped: a value loss leaves every encoder
    weight's gradient at zero and the value head's not, while the action's log-probability reaches the encoder;
    behaviour cloning lets it through for the fit."""
    policy = tiny(head)
    obs = torch.from_numpy(rows(4))
    actions, _, _ = policy.act(obs)
    logprob, _, value = policy.evaluate(obs, actions.detach())
    (value - 3.0).square().mean().backward()
    assert all(p.grad is None or not p.grad.any() for p in policy.encoder.parameters())
    assert all(p.grad is not None and p.grad.any() for p in policy.critic_head.parameters())
    policy.zero_grad()
    logprob, _, value = policy.evaluate(obs, actions.detach())
    logprob.sum().backward()
    assert policy.encoder.vision[0].weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.allclose(policy.value(obs), value, atol=1e-5)  # value() is the same head on the same state
    # behaviour cloning lets the returns' regression shape the encoder (bc.fit), and leaves the policy as RL wants it
    from m2flow.embodied.bc import fit

    seen = []
    data = {"obs": obs, "actions": actions.detach(), "returns": torch.arange(4.0)}
    before = policy.encoder.vision[0].weight.detach().clone()
    fit(policy, data, 1, batch_size=4, on_step=lambda i, m: seen.append(policy.value_trains_encoder))
    assert seen == [True] and policy.value_trains_encoder is False
    assert not torch.equal(before, policy.encoder.vision[0].weight)
    # actor.critic_lr's group: the value head alone (the encoder is the actions')
    from m2flow.embodied.workers.actor import value_param_groups

    groups = value_param_groups(policy, 1e-5, 1e-3)
    assert [g["lr"] for g in groups] == [1e-5, 1e-3]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in policy.critic_head.parameters()}


def test_with_a_wrist_camera_the_vla_reads_both_frames_through_one_stem():
    """env.wrist_camera: the rgb field holds two frames; the VLA encodes each with the same stem, into patch tokens
    of their own (positions per view), so a change in either frame alone changes the action."""
    layout = pixel_layout(SIZE, wrist_camera=True)
    torch.manual_seed(0)
    policy = GaussianVLA(layout, BOX, len(VOCAB), dim=16, layers=1, heads=2, patch=16)
    one = tiny("gaussian")
    assert policy.encoder.patches == 2 * one.encoder.patches == 8
    assert policy.encoder.vision[0].weight.shape == one.encoder.vision[0].weight.shape  # a 3-channel stem
    rng = np.random.default_rng(1)
    obs = torch.from_numpy(np.stack([layout.pack(state=rng.normal(size=STATE_DIM).astype(np.float32),
                                                 progress=np.zeros(1, np.float32),
                                                 instruction=tokenize("push the cube to the goal region").astype(np.int32),
                                                 rgb=rng.integers(0, 256, (6, SIZE, SIZE), dtype=np.uint8))
                                     for _ in range(3)]))
    with torch.no_grad():
        base = policy.act(obs, True)[0]
        for view in (slice(0, 3), slice(3, 6)):
            other = obs.clone()
            layout.unpack(other)["rgb"][:, view] = torch.from_numpy(rng.integers(0, 256, (3, 3, SIZE, SIZE),
                                                                                 dtype=np.uint8))
            assert not torch.allclose(policy.act(other, True)[0], base), view
    with pytest.raises(ValueError, match="RGB frames \\(3 channels each\\), got 4 channels"):
        GaussianVLA(PackedLayout([Field("state", "float32", (STATE_DIM,)), Field("progress", "float32", (1,)),
                                  Field("instruction", "int32", (12,)), Field("rgb", "uint8", (4, SIZE, SIZE))]),
                    BOX, len(VOCAB), dim=16, heads=2)


def test_make_policy_builds_the_vla_of_the_config():
    cfg = C.load(EmbodiedConfig, "ppo_pickcube", ["policy.kind=vla", "env.pixels=true", f"env.image_size={SIZE * 2}",
                                                   "vla.head=tokens", "vla.bins=16", "vla.dim=32"])
    policy = make_policy(cfg, pixel_layout(SIZE * 2).space(), BOX)
    assert isinstance(policy, TokenVLA) and policy.bins == 16 and policy.encoder.patches == 16
    assert policy.critic_head.mlp is None  # vla.value_hidden=[]: the linear value head alone
    valued_cfg = C.load(EmbodiedConfig, "ppo_pickcube", ["policy.kind=vla", "env.pixels=true",
                                                        f"env.image_size={SIZE * 2}", "vla.value_hidden=[24]"])
    valued = make_policy(valued_cfg, pixel_layout(SIZE * 2).space(), BOX)
    assert [m.out_features for m in valued.critic_head.mlp if isinstance(m, torch.nn.Linear)] == [24, 1]
    with pytest.raises(ValueError, match=r"packed pixel rows \[\d+\] uint8"):
        make_policy(cfg, spaces.Box(-1, 1, (42,), np.float32), BOX)
    with pytest.raises(ValueError, match="init_std_scale scales a Gaussian"):
        policy.scale_std(0.5)
    wrist = C.load(EmbodiedConfig, "ppo_pickcube", ["policy.kind=vla", "env.pixels=true", f"env.image_size={SIZE * 2}",
                                                     "env.wrist_camera=true", "vla.dim=32"])
    assert make_policy(wrist, pixel_layout(SIZE * 2, True).space(), BOX).encoder.views == 2
    with pytest.raises(ValueError, match=r"env.wrist_camera=True\), got"):
        make_policy(wrist, pixel_layout(SIZE * 2).space(), BOX)


@pytest.mark.parametrize("overrides, message", [
    (["policy.kind=vla"], r"policy.kind=vla reads ManiSkill3's pixel observations: it needs env.pixels=true"),
    (["env.pixels=true"], r"env.pixels=true on ManiSkill3 gives the frame .* \(got policy.kind=mlp\)"),
    (["env.pixels=true", "policy.kind=vla", "env.norm_obs=true"], r"takes env.norm_obs=false and env.instruct=false"),
    (["env.pixels=true", "policy.kind=vla", "env.image_size=72"], r"env.image_size=72 must be a multiple of vla.patch"),
    (["env.pixels=true", "policy.kind=vla", "vla.head=beam"], r"vla.head must be gaussian \| tokens, got 'beam'"),
    (["env.pixels=true", "policy.kind=vla", "vla.dim=30"], r"vla.dim=30 must be a multiple of vla.heads=4"),
    (["env.wrist_camera=true"], r"env.wrist_camera=true adds a hand camera's frames .* it needs env.pixels=true"),
])
def test_vla_configs_that_cannot_run_fail_with_one_line(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load(EmbodiedConfig, "ppo_pickcube", overrides)


@pytest.mark.parametrize("head", ["gaussian", "tokens"])
def test_the_value_reads_the_episodes_progress_and_the_actions_do_not(head):
    """VLAValue: the value MLP reads [proprioception; progress]; the action heads never read the progress, and
    without the MLP (vla.value_hidden=[]) the value is the readout's linear head alone."""
    policy = tiny(head, value_hidden=(16, 16))
    obs = torch.from_numpy(rows(4))
    later = obs.clone()
    policy.encoder.layout.unpack(later)["progress"][:] += 0.5
    with torch.no_grad():
        torch.nn.init.normal_(policy.critic_head.mlp[-1].weight)  # past its near-zero start
        a, b = policy.act(obs, deterministic=True), policy.act(later, deterministic=True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # the same actions, the same log-probabilities
        assert (policy.value(obs) - policy.value(later)).abs().min() > 1e-4
    plain = tiny(head)  # vla.value_hidden's default: []
    assert plain.critic_head.mlp is None
    with torch.no_grad():
        assert torch.equal(plain.value(obs), plain.value(later))


def test_a_checkpoint_without_the_value_mlp_loads_with_policy_init_critic_false(tmp_path):
    """load_policy: a VLA saved without the value MLP (vla.value_hidden=[], the default) does not fit one with it,
    and the error says that policy.init_critic=false loads it: everything but the value function, which keeps its own
    start (the MLP's near 0); a missing key elsewhere is refused all the same."""
    from safetensors.torch import save_file

    from m2flow.embodied.workers.actor import load_policy

    saved = tiny("gaussian", seed=1)
    state = saved.state_dict()
    save_file(state, str(tmp_path / "policy.safetensors"))
    valued = tiny("gaussian", seed=2, value_hidden=(8,))
    with pytest.raises(ValueError, match=r"\['critic_head.mlp.0.bias', .* differ; policy.init_critic=false loads it"):
        load_policy(valued, tmp_path)
    start = {k: v.clone() for k, v in valued.state_dict().items()}
    load_policy(valued, tmp_path, critic=False)
    for k, v in valued.state_dict().items():
        assert torch.equal(v, start[k] if k.startswith("critic_head.") else state[k]), k
    del state["encoder.readout"]
    save_file(state, str(tmp_path / "policy.safetensors"))
    with pytest.raises(ValueError, match=r"\['encoder.readout'\] differ$"):
        load_policy(valued, tmp_path, critic=False)
