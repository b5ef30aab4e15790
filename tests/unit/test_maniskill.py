"""ManiSkill3 tasks through m2flow's env layer (issue 24): PickCube-v1, PushCube-v1 and StackCube-v1 with state
observations; per-episode success from the simulator; seeded resets; the scripted experts and their datasets; clear
errors for a wrong task name and for a machine without a Vulkan device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from m2flow.embodied.envs import EnvGroup, check_env_id, make_env_fns
from m2flow.embodied.envs import experts, maniskill

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "demos" / "PickCube-v1"


def group(task: str, n: int = 1, seed: int = 0) -> EnvGroup:
    return EnvGroup(make_env_fns(task, n, seed=seed), env_id=task, seed=seed)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_the_env_group_reports_success_for_the_experts_demos_and_failure_for_random_actions():
    """The shipped demos (`m2flow demos PickCube-v1 -n 10`) replayed from their reset seeds: the same observations,
    and every episode ends in success at the recorded step. Random actions from the same seeds never succeed."""
    summary, demos = experts.load_demos(FIXTURE)
    assert summary["task"] == "PickCube-v1" and summary["success_rate"] == 1.0
    g = group("PickCube-v1")  # one env for the episodes in turn, as the expert ran them
    for number, episode in enumerate(summary["episodes"][:3]):
        rows = demos["episode"] == number
        obs = g.reset(seed=episode["seed"])
        replayed = []
        for action in demos["actions"][rows]:
            replayed.append(obs[0])
            obs = g.step(action[None]).obs
        replayed, recorded = np.array(replayed), demos["obs"][rows].copy()
        if number:  # recorded before NoGraspAtReset: its first obs carried the last episode's grasp (is_grasped 1)
            assert recorded[0, 18] == 1.0 and replayed[0, 18] == 0.0
            recorded[0, 18] = 0.0
        # the physics rounds otherwise on another CPU: 5e-5 apart on an Intel Xeon (AVX-512), the fixture's from an EPYC
        np.testing.assert_allclose(replayed, recorded, atol=1e-3)
        [ep] = g.pop_episodes()
        assert ep["success"] and ep["success_once"] and ep["length"] == episode["length"] < 100
    g.close()
    g = group("PickCube-v1", n=2, seed=summary["episodes"][0]["seed"])
    g.reset(seed=summary["episodes"][0]["seed"])
    rng = np.random.default_rng(0)
    for _ in range(100):
        g.step(rng.uniform(-1, 1, (2, 4)).astype(np.float32))
    episodes = g.pop_episodes()
    assert len(episodes) == 2 and not any(e["success_once"] or e["success"] for e in episodes)
    assert all(e["length"] == maniskill.MAX_EPISODE_STEPS for e in episodes)  # truncated at the time limit
    g.close()


def test_with_ignore_terminations_an_episode_runs_on_past_success_to_the_step_limit():
    """`env.kwargs.ignore_terminations=true` (ManiSkill's option): the expert's episode does not end at its success;
    it runs to the step limit (here 40), and the episode still counts as successful once."""
    summary, demos = experts.load_demos(FIXTURE)
    episode = summary["episodes"][0]
    g = EnvGroup(make_env_fns("PickCube-v1", 1, max_episode_steps=40, ignore_terminations=True), env_id="PickCube-v1")
    g.reset(seed=episode["seed"])
    actions = demos["actions"][demos["episode"] == 0]
    for t in range(40):
        g.step(actions[min(t, len(actions) - 1)][None])  # past the demo: its last action again
        if t + 1 == episode["length"]:
            assert g.pop_episodes() == []  # succeeded here, did not end
    [ep] = g.pop_episodes()
    assert ep["length"] == 40 and ep["success_once"] and episode["length"] < 40
    g.close()


@pytest.mark.parametrize("task,obs_dim", [("PickCube-v1", 42), ("PushCube-v1", 35), ("StackCube-v1", 48)])
def test_every_task_resets_from_its_seed_and_its_expert_solves_it(task, obs_dim):
    g = group(task, n=2)
    first, again = g.reset(seed=7), g.reset(seed=7)
    assert first.shape == (2, obs_dim) and first.dtype == np.float32 and g.action_space.shape == (4,)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first[0], first[1])  # env i resets from seed + i
    g.close()
    run = experts.run_expert(task, seed=3)
    assert run["success"] and run["length"] < maniskill.MAX_EPISODE_STEPS and run["obs"].shape == (run["length"],
                                                                                                   obs_dim)


def test_an_unseeded_reset_follows_the_envs_own_seed_not_torchs_global_rng():
    """ManiSkill draws an unseeded reset from torch's global RNG; m2flow's envs seed it from their last seeded reset,
    so the episodes after an auto-reset are the same in any plan (whatever else the process draws)."""
    import torch

    env = maniskill.make("PickCube-v1")
    env.reset(seed=3)
    first, _ = env.reset()
    env.reset(seed=3)
    torch.rand(100)  # the policy, or another env, drawing from the global RNG in between
    again, _ = env.reset()
    np.testing.assert_array_equal(first, again)
    env.reset(seed=4)
    assert not np.array_equal(first, env.reset()[0])
    env.close()


@pytest.mark.parametrize("task", ["PickCube-v1", "PushCube-v1"])
def test_pixel_observations_are_the_task_cameras_frame_with_the_proprioception_and_the_instruction(task):
    """env.pixels on ManiSkill3: each observation is one packed row of `pixel_layout(image_size)`: the task camera's
    RGB frame at that size, the state ManiSkill gives beside its frames (no object pose) but the joints' velocities,
    zero-padded, the task's word ids. The frame changes as the arm moves; a reset from the same seed gives the same row."""
    import torch

    g = EnvGroup(make_env_fns(task, 2, seed=0, pixels=True, image_size=48), env_id=task)
    layout = maniskill.pixel_layout(48)
    obs = g.reset(seed=7)
    assert obs.shape == (2, layout.nbytes) and obs.dtype == np.uint8 and g.observation_space == layout.space()
    np.testing.assert_array_equal(obs, g.reset(seed=7))
    fields = layout.unpack(torch.from_numpy(obs))
    rgb, state = fields["rgb"].numpy(), fields["state"].numpy()
    assert rgb.shape == (2, 3, 48, 48) and rgb.std() > 10  # a rendered scene, not a blank frame
    assert fields["instruction"][0].tolist() == maniskill.tokenize(maniskill.instruction(task)).tolist()
    used = np.flatnonzero(np.abs(state).max(0) > 0)
    # the joints' positions (9) and the gripper's pose (7), PickCube's grasp flag and goal (4): no velocities
    assert used.max() + 1 == {"PickCube-v1": 20, "PushCube-v1": 16}[task] and not state[:, 20:].any()
    assert not fields["progress"].any()  # the episode's progress: 0 at a reset, then the steps over the limit
    moved, since = obs, np.zeros(2)
    for _ in range(5):
        out = g.step(np.tile([[1.0, 0.0, 1.0, -1.0]], (2, 1)).astype(np.float32))
        moved, since = out.obs, np.where(out.terminated | out.truncated, 0, since + 1)  # an ended episode resets
        assert layout.unpack(torch.from_numpy(moved))["progress"][:, 0].tolist() == \
            (since / maniskill.MAX_EPISODE_STEPS).astype(np.float32).tolist()
    after = layout.unpack(torch.from_numpy(moved))
    assert np.abs(after["rgb"].numpy().astype(int) - rgb.astype(int)).mean() > 0.5  # the arm moved in the frame
    assert not np.allclose(after["state"].numpy(), state)
    assert since.max() > 0
    assert not layout.unpack(torch.from_numpy(g.reset(seed=7)))["progress"].any()
    g.close()


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_wrist_camera_adds_the_hand_cameras_frame_which_follows_the_hand():
    """env.wrist_camera: the rgb field holds the task camera's frame, then the hand camera's ([6, size, size]). The
    hand camera moves with the gripper: lifting the hand changes its whole frame, while the task camera's shows the
    arm move in a part of it. Without it, StackCube (whose ManiSkill default robot carries the hand camera) renders the
    task camera alone; a wrist camera without pixels is refused."""
    import torch

    layout = maniskill.pixel_layout(48, wrist_camera=True)
    assert layout.fields["rgb"].shape == (6, 48, 48)
    env = maniskill.make("PickCube-v1", pixels=True, image_size=48, wrist_camera=True)
    assert env.observation_space == layout.space()
    before = layout.unpack(torch.from_numpy(env.reset(seed=2)[0][None]))["rgb"][0].int()
    for _ in range(5):
        obs = env.step(np.array([0.0, 0.0, 1.0, 1.0], np.float32))[0]
    after = layout.unpack(torch.from_numpy(obs[None]))["rgb"][0].int()
    task, hand = (after - before).abs()[:3], (after - before).abs()[3:]
    assert before[:3].float().std() > 10 and before[3:].float().std() > 10  # two rendered scenes
    assert (before[:3] - before[3:]).abs().float().mean() > 20  # from two viewpoints
    changed = lambda d: (d.amax(0) > 30).float().mean().item()  # the share of pixels that changed
    assert changed(hand) > 2 * changed(task) > 0.0  # measured: 27% of the hand frame's pixels, 9% of the task's
    env.close()
    stack = maniskill.make("StackCube-v1", pixels=True, image_size=48)
    assert stack.observation_space == maniskill.pixel_layout(48).space()
    stack.close()
    with pytest.raises(ValueError, match="wrist_camera needs pixels"):
        maniskill.make("PickCube-v1", wrist_camera=True)
    with pytest.raises(ValueError, match=r"a wrist camera \(env.wrist_camera\) adds frames to the pixel observations"):
        make_env_fns("PickCube-v1", 1, wrist_camera=True)


def visual_triangles(env, prefix: str = "") -> dict[str, int]:
    """Triangles of each render body's meshes in the env's scene whose entity name starts with `prefix`."""
    import sapien

    out = {}
    for entity in env.unwrapped.scene.sub_scenes[0].entities:
        for c in entity.components:
            if isinstance(c, sapien.render.RenderBodyComponent) and entity.name.startswith(prefix):
                out[entity.name] = sum(len(p.get_triangles()) for s in c.render_shapes
                                       if isinstance(s, sapien.render.RenderShapeTriangleMesh) for p in s.parts)
    return out


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_pixel_frames_render_the_robot_with_simplified_meshes_and_the_same_physics():
    """env.render_triangles: the Panda's visual meshes (about 135,000 triangles as shipped) keep about 1,000 per link
    for pixel observations, also after a reset that rebuilds the scene; the frame differs from the shipped meshes'
    in a few pixels only, and the physics, hence the state, is the same step for step."""
    import torch

    layout = maniskill.pixel_layout(64)
    shipped = maniskill.make("PickCube-v1", pixels=True, image_size=64, render_triangles=0)
    simple = maniskill.make("PickCube-v1", pixels=True, image_size=64)
    assert sum(visual_triangles(shipped, "panda").values()) > 100_000
    links = visual_triangles(simple, "panda")
    assert len(links) >= 10 and max(links.values()) <= 1_100 and sum(links.values()) < 12_000
    assert visual_triangles(simple)["scene-0_ground"] == visual_triangles(shipped)["scene-0_ground"]  # textured: kept
    rows = [[env.reset(seed=3)[0]] for env in (shipped, simple)]
    action = np.array([0.5, -0.3, 0.8, 1.0], np.float32)
    for _ in range(4):
        for env, out in zip((shipped, simple), rows):
            out.append(env.step(action)[0])
    a, b = (layout.unpack(torch.from_numpy(np.stack(r))) for r in rows)
    torch.testing.assert_close(a["state"], b["state"])  # collision shapes and physics untouched
    diff = (a["rgb"].int() - b["rgb"].int()).abs()
    assert a["rgb"].float().std() > 10 and diff.float().mean() < 2.0 and (diff.amax(1) > 40).float().mean() < 0.02
    simple.reset(seed=3, options=dict(reconfigure=True))  # a rebuilt scene is simplified again
    assert max(visual_triangles(simple, "panda").values()) <= 1_100
    shipped.close(), simple.close()


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_m2flow_demos_writes_a_dataset_with_seeds_and_success(tmp_path):
    out = tmp_path / "push"
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "PushCube-v1", "-n", "3", "--seed", "5",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "3 episodes of PushCube-v1: 100% successful" in result.stdout
    summary = json.loads((out / "demos.json").read_text())
    assert [e["seed"] for e in summary["episodes"]] == [5, 6, 7] and summary["instruction"] == maniskill.TASKS[
        "PushCube-v1"]
    _, arrays = experts.load_demos(out)
    lengths = [e["length"] for e in summary["episodes"]]
    assert len(arrays["obs"]) == len(arrays["actions"]) == sum(lengths)
    assert np.bincount(arrays["episode"]).tolist() == lengths
    assert np.abs(arrays["actions"]).max() <= 1.0


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_pixel_demonstrations_hold_the_frames_and_the_state_datasets_actions(tmp_path):
    """`m2flow demos TASK --pixels`: the expert reads the simulator either way, so a pixel dataset's actions are the
    state dataset's for the same seeds; its observations are packed pixel rows, and behaviour cloning of a state
    config refuses it, naming the command that records what the config needs."""
    import torch

    from m2flow.embodied.bc import demo_data

    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "PickCube-v1", "-n", "2", "--pixels",
                             "--image-size", "48", "--out", str(tmp_path / "px")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    experts.write_demos("PickCube-v1", 2, tmp_path / "state")
    (summary, pixels), (_, state) = experts.load_demos(tmp_path / "px"), experts.load_demos(tmp_path / "state")
    assert summary["pixels"] is True and summary["image_size"] == 48 and summary["success_rate"] == 1.0
    layout = maniskill.pixel_layout(48)
    assert pixels["obs"].dtype == np.uint8 and pixels["obs"].shape == (len(state["obs"]), layout.nbytes)
    np.testing.assert_array_equal(pixels["actions"], state["actions"])
    np.testing.assert_array_equal(pixels["episode"], state["episode"])
    frames = layout.unpack(torch.from_numpy(pixels["obs"]))["rgb"]
    assert frames.float().std() > 10 and not torch.equal(frames[0], frames[-1])
    data = demo_data(str(tmp_path / "px"), "PickCube-v1", pixels=True, image_size=48)
    assert data["obs"].dtype == torch.uint8 and len(data["obs"]) == len(data["actions"]) == len(state["obs"])
    with pytest.raises(ValueError, match=r"demonstrations of pixels at 48x48, but the config observes states"):
        demo_data(str(tmp_path / "px"), "PickCube-v1")
    with pytest.raises(ValueError, match=r"demonstrations of state observations, but the config observes pixels at "
                                         r"64x64 \(record them with `m2flow demos PickCube-v1 --pixels --image-size "
                                         r"64`\)"):
        demo_data(str(tmp_path / "state"), "PickCube-v1", pixels=True, image_size=64)
    assert summary["render_triangles"] == maniskill.RENDER_TRIANGLES  # the frames were rendered as env.pixels renders
    with pytest.raises(ValueError, match=r"demonstrations rendered with render_triangles=1000, but the config's "
                                         r"env.render_triangles is 0 .*`m2flow demos PickCube-v1 --pixels --image-size "
                                         r"48 --render-triangles 0`"):
        demo_data(str(tmp_path / "px"), "PickCube-v1", pixels=True, image_size=48, render_triangles=0)
    assert summary["wrist_camera"] is False and summary["joint_velocities"] is False
    with pytest.raises(ValueError, match=r"demonstrations without the hand camera's frames, but the config's "
                                         r"env.wrist_camera is true .*`m2flow demos PickCube-v1 --pixels --image-size "
                                         r"48 --wrist-camera`"):
        demo_data(str(tmp_path / "px"), "PickCube-v1", pixels=True, image_size=48, wrist_camera=True)
    assert summary["progress"] is True
    progress = layout.unpack(torch.from_numpy(pixels["obs"]))["progress"][:, 0]
    first = np.flatnonzero(np.r_[True, pixels["episode"][1:] != pixels["episode"][:-1]])
    assert not progress[first].any()  # each episode from 0, then a step's share of the limit each step
    assert progress[1] == np.float32(1 / maniskill.MAX_EPISODE_STEPS)
    summary["progress"] = False  # as pixel datasets recorded before it were
    (tmp_path / "px" / "demos.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"demonstrations without the episode's progress in their observations, "
                                         r"which pixel observations carry now \(record them again with `m2flow demos "
                                         r"PickCube-v1 --pixels --image-size 48`\)"):
        demo_data(str(tmp_path / "px"), "PickCube-v1", pixels=True, image_size=48)
    summary["progress"] = True
    summary["joint_velocities"] = True  # as pixel datasets recorded before 2026-12-06 were
    (tmp_path / "px" / "demos.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"demonstrations whose proprioception holds the joints' velocities, which "
                                         r"pixel observations no longer do \(record them again with `m2flow demos "
                                         r"PickCube-v1 --pixels --image-size 48`\)"):
        demo_data(str(tmp_path / "px"), "PickCube-v1", pixels=True, image_size=48)


def test_a_wrong_task_name_lists_the_tasks():
    with pytest.raises(ValueError, match="PickCube-v1"):
        check_env_id("PickCub-v1")
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "demos", "PickCub-v1", "-n", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == ("m2flow: error: demos: no expert for task 'PickCub-v1'; tasks: PickCube-v1, "
                                     "PushCube-v1, StackCube-v1, or metaworld/TASK for a Meta-World task (e.g. "
                                     "metaworld/reach-v3)")


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_machine_without_a_vulkan_device_gets_a_one_line_error_naming_the_fix(tmp_path):
    env = dict(os.environ, VK_ICD_FILENAMES=str(tmp_path / "no_driver.json"))  # Vulkan's loader finds no driver
    result = subprocess.run([sys.executable, "-m", "m2flow.cli", "train", "ppo_pickcube", f"run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"m2flow: error: env.id: PickCube-v1: {maniskill.VULKAN_ERROR}"


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_the_first_observation_after_a_grasped_episode_holds_nothing_and_the_expert_starts_as_in_a_fresh_env():
    """SAPIEN's CPU physics keeps the last step's contacts through a reset: ManiSkill's is_grasping reported the
    grasp that ended the previous episode until the next episode's first step (the observation's is_grasped 1, an
    expert's first action carrying a cube it did not hold). A reused env now starts each episode as a fresh one."""
    env = maniskill.make("PickCube-v1")
    first = experts.run_expert("PickCube-v1", 0, env)
    base = env.unwrapped
    assert first["success"] and bool(base.agent.is_grasping(base.cube)[0])  # it ended holding the cube
    reused = experts.run_expert("PickCube-v1", 1, env)
    fresh = experts.run_expert("PickCube-v1", 1)
    assert reused["obs"][0, 18] == 0.0  # is_grasped (PickCube's state: qpos 9, qvel 9, then this flag)
    np.testing.assert_array_equal(reused["obs"], fresh["obs"])
    np.testing.assert_array_equal(reused["actions"], fresh["actions"])
    assert reused["actions"][0, 3] == experts.OPEN  # its first action reaches for the cube, open
    assert reused["obs"][1:, 18].max() == 1.0  # and a grasp is seen once the fingers close on it
    env.close()
