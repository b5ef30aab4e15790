"""The VLA from pixels through the embodied flow on ManiSkill3 (issue 70): the task camera's frames, packed with the
proprioception and the instruction, go from the env workers through the policy workers and the trajectory channel
to the actor; PPO trains the Gaussian head and GRPO the action-token head (with the hand camera's frames too) for a
few iterations with the simulator's success in the metrics; the checkpoint evaluates with `m2flow eval`; lockstep and pipelined plans collect the same
trajectories for a fixed seed."""

import json

import torch

from m2flow import config as C
from m2flow.api import evaluate
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import Trajectory
from m2flow.embodied.envs.maniskill import pixel_layout
from m2flow.embodied.flow import train
from m2flow.embodied.workers.env import EnvWorker
from m2flow.embodied.workers.policy import PolicyWorker
from m2flow.runtime import Channel, parse_placement, release_all, wait_all

PIXELS = ["env.pixels=true", "env.image_size=48", "policy.kind=vla", "vla.dim=32", "vla.layers=1", "vla.heads=2",
          "env.max_episode_steps=8"]


def pixel_cfg(tmp_path, name, *overrides):
    return C.load(EmbodiedConfig, "ppo_pickcube", [
        f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.steps=2", "run.save_every=1",
        "eval.episodes=0", "env.num_envs=4", "rollout.steps=8", "actor.minibatch_size=16", "actor.epochs=1",
        *PIXELS, *overrides])


def test_ppo_and_grpo_train_a_vla_from_pixels_and_its_checkpoint_evaluates(cluster, tmp_path):
    for name, extra in (("ppo", ["cluster.placement=env,rollout: 0; actor: 1"]),
                        # scored by the dense return: 8-step episodes never succeed, and success alone would give
                        # every env the same score, no advantage, and (the value loss kept off the encoder) no update
                        ("grpo", ["algorithm.name=grpo", "algorithm.score=return", "env.seed_groups=2",
                                  "vla.head=tokens", "vla.bins=16",
                                  "cluster.placement=env,rollout,actor: 0-1", "env.wrist_camera=true"])):
        result = train(pixel_cfg(tmp_path, name, *extra), cluster)
        rows = [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2] and rows[-1]["env_steps"] == 2 * 4 * 8, name
        for r in rows:  # every env's 8-step episode ends each iteration, scored by the simulator
            assert r["rollout/episodes"] == 4 and 0.0 <= r["rollout/success_once"] <= 1.0, name
            assert r["actor/approx_kl"] == r["actor/approx_kl"] and r["actor/entropy"] > 0, name  # trained, finite
        # the actor trained on frames: its vision weights moved from the first checkpoint to the second
        from safetensors.torch import load_file

        ckpt = tmp_path / name / "checkpoints"
        first, second = (load_file(str(ckpt / f"step_{k}" / "policy.safetensors")) for k in (1, 2))
        key = "encoder.vision.0.weight"
        assert first[key].shape[1] == 3 and not torch.equal(first[key], second[key]), name
        views = 2 if name == "grpo" else 1  # GRPO's run sees the hand camera's frames too (env.wrist_camera)
        assert first["encoder.vision_pos"].shape[1] == views * (48 // 16) ** 2, name
        video = tmp_path / f"{name}_video"
        out = evaluate(str(tmp_path / name), episodes=2, video_dir=str(video))  # `m2flow eval RUN_DIR --video D`
        assert out["episodes"] == 2 and out["length_mean"] == 8 and 0.0 <= out["success_rate"] <= 1.0, name
        # the video is the render camera's view of env 0's first episode, beside the frames the policy saw
        assert [f.suffix for f in video.iterdir()] in ([".mp4"], [".gif"]) and out["video_dir"] == str(video), name


def test_lockstep_and_pipelined_plans_collect_the_same_pixel_trajectories(cluster, tmp_path):
    """The token head's actions are discrete: lockstep (one stage, the policy in the env's process) and two pipeline
    stages on two devices give the same frames, actions and rewards, step for step, for a fixed seed."""
    runs = [("env,rollout: 0", 1, True), ("env: 0; rollout: 1", 2, False)]
    got = []
    for spec, stages, cohost in runs:
        cfg = pixel_cfg(tmp_path, f"t{stages}", "vla.head=tokens", "vla.bins=16", f"env.pipeline_stages={stages}")
        plan = parse_placement(spec, cluster.num_devices)
        env = EnvWorker.launch(cluster, plan["env"], cfg)
        obs_space, action_space = env.on(0).spaces().wait()[0]
        assert obs_space == pixel_layout(48).space()
        policy = PolicyWorker.launch(cluster, plan["rollout"], cfg, obs_space, action_space,
                                     host_with=env if cohost else None)
        out = Channel.create(f"vla-test-{stages}")
        try:
            wait_all([env.rollout(policy, out, cfg.rollout.steps, 0, 1)])
            got.append(Trajectory.cat_envs([out.get(key=0)["traj"]]))
        finally:
            release_all([env, policy])
            out.destroy()
    a, b = got
    assert a.obs.dtype == torch.uint8 and a.obs.shape == (8, 4, pixel_layout(48).nbytes)
    for name in ("obs", "actions", "rewards", "terminated", "truncated", "next_obs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    frames = pixel_layout(48).unpack(a.obs.reshape(32, -1))["rgb"]
    assert frames.float().std() > 10 and not torch.equal(frames[0], frames[-1])  # real frames, and they change


def test_behaviour_cloning_from_pixel_demonstrations_beats_the_untrained_policy(tmp_path):
    """`m2flow demos PickCube-v1 --pixels` then `m2flow sft CONFIG OUT --demos DIR` on the VLA: the clone reaches for
    the cube from the frames (a higher dense return on held-out seeds than the same policy untrained, which does not
    move toward it), and its checkpoint holds the config an RL run starts from."""
    from m2flow.embodied.cloning import behaviour_clone
    from m2flow.embodied.envs.experts import write_demos

    demos = tmp_path / "demos"
    write_demos("PickCube-v1", 15, demos, pixels=True, image_size=48)  # ~250 frames (16.7 an episode)
    cfg = C.load(EmbodiedConfig, "ppo_pickcube", [*PIXELS, "env.max_episode_steps=30", "eval.episodes=8",
                                                   "eval.num_envs=8"])
    untrained = behaviour_clone(cfg, demos, tmp_path / "untrained", steps=1, show=False)
    clone = behaviour_clone(cfg, demos, tmp_path / "bc", steps=400, batch_size=64, lr=1e-3, show=False)
    print(f"\nuntrained: {untrained['eval']}\nclone: {clone['eval']}")
    assert clone["demo_episodes"] == 15 and clone["bc/nll"] < untrained["bc/nll"]
    # measured: 2.91 against 1.46 over these 8 held-out episodes (2.0x; 10 demonstrations of the expert that now reads
    # only the current state, 160 frames, gave 1.27x; 10 of the phase-keeping one, 240 frames, 1.86x)
    assert clone["eval"]["return_mean"] > 1.3 * untrained["eval"]["return_mean"], (clone["eval"], untrained["eval"])
    assert C.read_yaml(tmp_path / "bc" / "config.yaml")["env"]["pixels"] is True
