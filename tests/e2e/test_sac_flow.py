"""SAC through the embodied flow on real Ray workers: Pendulum-v1 learns (mean return >= -300), the lockstep and the
pipelined plan give identical results at max_policy_lag=0, max_policy_lag=1 trains on the previous iteration's
steps, and a checkpoint holds the replay buffer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m2flow import config as C
from m2flow.cli import main
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.evaluation import evaluate_checkpoint
from m2flow.embodied.flow import train
from m2flow.runtime import WorkerError


class Touch:
    """Unpickling it creates a file: what a crafted checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def cfg_for(tmp_path, name, *overrides):
    return C.load(EmbodiedConfig, "sac_pendulum", [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false",
                                                       "run.trace=false", *overrides])


def rows(result):
    return [json.loads(line) for line in open(f"{result['run_dir']}/metrics.jsonl")]


def test_sac_learns_pendulum(cluster, tmp_path, capsys):
    """The preset's recipe on smaller networks (64x64: a fifth of the update time on CPU), 6,400 env steps."""
    result = train(cfg_for(tmp_path, "learn", "policy.hidden=[64,64]", "run.steps=100", "eval.episodes=10"), cluster)
    history = rows(result)
    assert history[0]["sac/updates"] == 0 and history[1]["sac/updates"] == 64  # learning_starts=100: from step 1
    assert history[0]["env_steps"] == 64 and result["metrics"]["env_steps"] == 6400
    first = next(r["rollout/return"] for r in history if "rollout/return" in r)  # all 8 envs' first, at 1,600 steps
    assert first < -900  # mostly random actions: the pendulum hangs down
    assert result["eval"]["return_mean"] >= -300, result["eval"]
    ckpt = tmp_path / "learn" / "checkpoints" / "step_100"
    replay = load_file(str(ckpt / "replay.safetensors"))
    assert replay["data.rewards"].shape == (6400,) and int(replay["pos"]) == 6400
    # the checkpoint's actor evaluates on its own, deterministically
    again = evaluate_checkpoint(ckpt, episodes=10)
    assert again["return_mean"] == pytest.approx(result["eval"]["return_mean"])
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        assert main(["eval", str(tmp_path / "learn"), "--episodes", "10"]) == 0  # `m2flow eval` on the run directory
    finally:
        torch.set_num_threads(threads)  # main() sets the driver's to 1
    assert f"return_mean: {again['return_mean']:.4f}" in capsys.readouterr().out


def test_lockstep_and_pipelined_plans_give_identical_sac_runs_at_lag_0(cluster, tmp_path):
    common = ["policy.hidden=[32,32]", "run.steps=6", "sac.learning_starts=63", "eval.episodes=0"]
    lockstep = train(cfg_for(tmp_path, "lockstep", "cluster.placement=env,rollout,actor: 0", *common), cluster)
    piped = train(cfg_for(tmp_path, "piped", "cluster.placement=env,rollout: 0; actor: 1", "env.pipeline_stages=2",
                          *common), cluster)
    assert piped["plan"]["mode"] != lockstep["plan"]["mode"]
    a, b = rows(lockstep), rows(piped)
    for key in ("sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/q_mean"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    wa = load_file(f"{lockstep['checkpoint']}/policy.safetensors")
    wb = load_file(f"{piped['checkpoint']}/policy.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_parallel_update_gives_the_same_run_in_the_lockstep_and_the_pipelined_plan(cluster, tmp_path):
    """sac.parallel_update reaches the learner (its actor reads the critics before each step's update, so its losses
    part from the sequential step's after the first update) and stays deterministic across plans; with
    sac.actor_process the actor's side runs in a process of the learner's and the run is the same."""
    common = ["policy.hidden=[32,32]", "run.steps=3", "sac.learning_starts=63", "eval.episodes=0"]
    runs = [train(cfg_for(tmp_path, name, *placement, *common, *extra), cluster) for name, placement, extra in (
        ("par_lockstep", ["cluster.placement=env,rollout,actor: 0"], ["sac.parallel_update=true"]),
        ("par_piped", ["cluster.placement=env,rollout: 0; actor: 1", "env.pipeline_stages=2"],
         ["sac.parallel_update=true"]),
        ("seq_lockstep", ["cluster.placement=env,rollout,actor: 0"], []),
        ("proc_piped", ["cluster.placement=env,rollout: 0; actor: 1"],
         ["sac.parallel_update=true", "sac.actor_process=true"]))]
    par, piped, seq, proc = (rows(r) for r in runs)
    for key in ("sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/q_mean"):
        assert [r.get(key) for r in par] == [r.get(key) for r in piped] == [r.get(key) for r in proc], key
    wa, wb = (load_file(f"{runs[i]['checkpoint']}/policy.safetensors") for i in (0, 3))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # sac.actor_process: the same actor, stepped in its process
    assert all(r["sac/critic_loss"] == r["sac/critic_loss"] for r in par)  # trains: finite
    assert [r["sac/actor_loss"] for r in par] != [r["sac/actor_loss"] for r in seq]


def test_auto_mode_profiles_the_sac_learner_and_plans_it_as_one_rank(cluster, tmp_path):
    """cluster.placement=auto with SAC: the profiler times the SAC learner's real gradient steps on 1 and 2 devices
    (one process over both), every plan it ranks launches one learner rank, and the chosen plan trains at lag 1."""
    from auto_check import auto_outputs

    from m2flow.api import train as api_train
    from m2flow.planner.profile import Profile
    from m2flow.runtime import parse_placement

    cfg = cfg_for(tmp_path, "auto", "policy.hidden=[32,32]", "run.steps=3", "sac.learning_starts=63",
                  "eval.episodes=0", "sac.max_policy_lag=1", "cluster.placement=auto")
    api_train(cfg, cluster=cluster)
    run = tmp_path / "auto"
    profile = Profile.load(run / "profile.json")
    actor = {m.devices: m for m in profile.measurements if m.component == "actor"}
    assert set(actor) == {1, 2} and all(m.batch == 8 and m.seconds > 0 for m in actor.values())
    assert profile.components["actor"].state_bytes >= cfg.sac.buffer_size * 4 * (3 + 1 + 1 + 3)  # the buffer counts
    plan, plans, _ = auto_outputs(run, 3)
    assert len(plans) == 4
    for c in plans:
        assert parse_placement(c["placement_spec"], 2, ["env", "rollout", "actor"])["actor"].world_size == 1
    assert "8 envs x 8 steps per iteration" in (run / "plan_candidates.txt").read_text()
    history = rows({"run_dir": run})
    assert [r["sac/updates"] for r in history] == [0, 64, 64]  # lag 1: the first iteration's steps train the second
    assert all(r["sac/critic_loss"] == r["sac/critic_loss"] for r in history[1:])


def test_max_policy_lag_1_updates_before_it_takes_the_iterations_steps(cluster, tmp_path):
    """With lag 1 the updates of iteration k see the steps up to k - 1: the first updates come an iteration later
    than at lag 0, and the run still trains (the critic's loss is finite, the actor's weights move)."""
    common = ["policy.hidden=[32,32]", "run.steps=4", "sac.learning_starts=63", "eval.episodes=0",
              "cluster.placement=env,rollout: 0; actor: 1"]
    lag0 = rows(train(cfg_for(tmp_path, "lag0", *common), cluster))
    lag1 = rows(train(cfg_for(tmp_path, "lag1", "sac.max_policy_lag=1", *common), cluster))
    assert [r["sac/updates"] for r in lag0] == [64, 64, 64, 64]
    assert [r["sac/updates"] for r in lag1] == [0, 64, 64, 64]
    assert all(r["sac/critic_loss"] == r["sac/critic_loss"] for r in lag1[1:])
    assert lag0[1]["sac/critic_loss"] != lag1[1]["sac/critic_loss"]


def test_sac_ahead_queues_the_learners_next_iteration_and_gives_the_same_run(cluster, tmp_path):
    """sac.ahead at lag 1 (the default): the learner's next call is queued before this one's result is in, and its
    weights come back with its result. The same run as one iteration after the other: the same losses, the same
    weights in the checkpoint written mid-run (no queued call ran past it) and at the end, the syncs checked. With the
    learner in the env workers' process (the lockstep plan) nothing is queued ahead, and the run is the same too."""
    common = ["policy.hidden=[32,32]", "run.steps=6", "run.save_every=3", "sac.learning_starts=63", "eval.episodes=0",
              "sac.max_policy_lag=1", "rollout.check_weight_sync=true"]
    piped = "cluster.placement=env,rollout: 0; actor: 1"
    ahead = train(cfg_for(tmp_path, "ahead", piped, *common), cluster)
    serial = train(cfg_for(tmp_path, "serial", piped, "sac.ahead=false", *common), cluster)
    train(cfg_for(tmp_path, "lockstep", "cluster.placement=env,rollout,actor: 0", *common), cluster)
    a = rows(ahead)
    assert [r["sac/updates"] for r in a] == [0, 64, 64, 64, 64, 64]
    assert all(r["sync/checked"] == 1 for r in a)
    for other in (rows(serial), rows({"run_dir": tmp_path / "lockstep"})):
        for key in ("sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/q_mean", "env_steps", "rollout/return"):
            assert [r.get(key) for r in a] == [r.get(key) for r in other], key
    for step in (3, 6):
        for name in ("policy", "sac_critic"):
            wa, *others = (load_file(str(tmp_path / run / "checkpoints" / f"step_{step}" / f"{name}.safetensors"))
                           for run in ("ahead", "serial", "lockstep"))
            assert all(torch.equal(wa[k], w[k]) for w in others for k in wa), (step, name)


def test_a_resumed_sac_run_equals_an_uninterrupted_one(cluster, tmp_path):
    """The checkpoint holds the replay buffer, every generator, the optimizers and (Pendulum pickles) the envs
    mid-episode: 3 iterations, a stop, 3 more give the weights and losses of 6 in one go, bit for bit."""
    common = ["policy.hidden=[32,32]", "sac.learning_starts=63", "eval.episodes=0", "run.save_every=3",
              "env.num_envs=4"]
    whole = train(cfg_for(tmp_path, "whole", "run.steps=6", *common), cluster)
    train(cfg_for(tmp_path, "parts", "run.steps=3", *common), cluster)
    ckpt = tmp_path / "parts" / "checkpoints" / "step_3"
    assert (ckpt / "replay.safetensors").exists() and (ckpt / "env_0.pkl").exists()
    parts = train(cfg_for(tmp_path, "parts", "run.steps=6", "run.resume=true", *common), cluster)
    assert parts["iterations"] == 3
    a, b = rows(whole), rows(parts)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for key in ("sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/q_mean", "env_steps"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    for name in ("policy", "sac_critic"):
        wa, wb = (load_file(f"{r['checkpoint']}/{name}.safetensors") for r in (whole, parts))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name
    # sac.save_buffer=latest (the default): once step 6's checkpoint is complete, step 3's gives its buffer up
    assert not (ckpt / "replay.safetensors").exists() and (ckpt / "policy.safetensors").exists()
    assert (tmp_path / "parts" / "checkpoints" / "step_6" / "replay.safetensors").exists()

    # the envs' snapshot is a pickle, sealed by this machine's m2flow: a planted one (here one that would create a
    # file when unpickled) is refused with the file named, and its code never runs
    snapshot, marker = tmp_path / "parts" / "checkpoints" / "step_6" / "env_0.pkl", tmp_path / "code_ran"
    torch.save({"group": Touch(marker), "obs": None}, snapshot)
    with pytest.raises(WorkerError, match=r"env rank 0: load_state\(\) raised ValueError: .*env_0.pkl: refused to "
                                          r"load: it holds pickled objects, .* does not carry the seal of this "
                                          r"machine's m2flow"):
        train(cfg_for(tmp_path, "parts", "run.steps=7", "run.resume=true", *common), cluster)
    assert not marker.exists()


def test_sac_save_buffer_all_keeps_every_buffer_and_none_resumes_on_an_empty_one(cluster, tmp_path, capfd):
    """sac.save_buffer=all: every checkpoint holds its buffer. none: no checkpoint does, and a resumed run says so,
    refills the buffer and waits sac.learning_starts env steps again before it updates."""
    common = ["policy.hidden=[32,32]", "sac.learning_starts=100", "eval.episodes=0", "run.save_every=2",
              "env.num_envs=4", "sac.train_freq=16"]
    train(cfg_for(tmp_path, "all", "run.steps=4", "sac.save_buffer=all", *common), cluster)
    assert all((tmp_path / "all" / "checkpoints" / f"step_{n}" / "replay.safetensors").exists() for n in (2, 4))
    train(cfg_for(tmp_path, "none", "run.steps=2", "sac.save_buffer=none", *common), cluster)
    assert not list((tmp_path / "none").rglob("replay.safetensors"))
    capfd.readouterr()
    resumed = rows(train(cfg_for(tmp_path, "none", "run.steps=4", "run.resume=true", "sac.save_buffer=none",
                                 *common), cluster))
    assert "holds no replay buffer" in capfd.readouterr().err
    assert [r["sac/updates"] for r in resumed] == [0, 64, 0, 64]  # 64 env steps an iteration: 100 after 2 of them
    assert [r["sac/buffer_size"] for r in resumed] == [64, 128, 64, 128]


def test_sac_critic_layernorm_and_ensemble_run_through_the_flow_and_change_the_critics(cluster, tmp_path):
    """sac.critic_layernorm from the config: the checkpoint's critics and targets hold a LayerNorm per hidden layer,
    and the critics' losses differ from the same run without it (same seed); so do sac.n_critics' ensemble's."""
    common = ["policy.hidden=[32,32]", "run.steps=3", "sac.learning_starts=63", "eval.episodes=0"]
    plain = rows(train(cfg_for(tmp_path, "plain", *common), cluster))
    normed = train(cfg_for(tmp_path, "normed", "sac.critic_layernorm=true", *common), cluster)
    nets = load_file(f"{normed['checkpoint']}/sac_critic.safetensors")
    for net in ("critic", "target"):
        for q in (0, 1):
            assert nets[f"{net}.qs.{q}.0.1.weight"].shape == nets[f"{net}.qs.{q}.0.4.weight"].shape == (32,)
    losses = [r["sac/critic_loss"] for r in rows(normed)][1:]
    assert all(x == x for x in losses) and losses != [r["sac/critic_loss"] for r in plain][1:]
    # RLPD's ensemble from the config: 5 critics and targets in the checkpoint, the target over a random 2 of them
    ens = train(cfg_for(tmp_path, "ens", "sac.n_critics=5", "sac.min_qs=2", "sac.actor_q=mean", *common), cluster)
    nets = load_file(f"{ens['checkpoint']}/sac_critic.safetensors")
    assert {k.split(".")[2] for k in nets if k.startswith(("critic.qs", "target.qs"))} == {"0", "1", "2", "3", "4"}
    losses = [r["sac/critic_loss"] for r in rows(ens)][1:]
    assert all(x == x for x in losses) and losses != [r["sac/critic_loss"] for r in plain][1:]


def test_sac_grad_manual_trains_as_autograd_does_and_refuses_networks_it_cannot_take(cluster, tmp_path):
    """sac.grad=manual (the hand-written gradients) reaches the learner in both update orders: its losses part from
    autograd's by float rounding only, so they are not bit for bit the same but agree to 1e-4."""
    common = ["policy.hidden=[32,32]", "run.steps=4", "sac.learning_starts=63", "eval.episodes=0"]
    for extra in ([], ["sac.parallel_update=true"]):
        manual, auto = (train(cfg_for(tmp_path, f"{grad}{len(extra)}", f"sac.grad={grad}", *common, *extra), cluster)
                        for grad in ("manual", "autograd"))
        for key in ("sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/q_mean"):
            a, b = [r[key] for r in rows(manual)[1:]], [r[key] for r in rows(auto)[1:]]
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6), key
        wa, wb = (load_file(f"{r['checkpoint']}/policy.safetensors") for r in (manual, auto))
        assert all(torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-5) for k in wa)
        assert not all(torch.equal(wa[k], wb[k]) for k in wa)  # computed apart
    with pytest.raises(C.ConfigError, match="sac.grad=manual writes out the gradients of ReLU MLPs only, but "
                                            "policy.activation is 'tanh', not relu: use sac.grad=auto or autograd"):
        cfg_for(tmp_path, "tanh", "sac.grad=manual", "policy.activation=tanh")


def _nice_by_pid() -> dict[int, tuple[str, list[int]]]:
    """pid -> (title, nice of each thread) of every Ray worker process of this session's cluster (titled `m2flow:...`
    while it waits for a call, `ray::...` while it runs one) and of every sac.actor_process process (`actor_process of
    PPID`). Only this process's descendants: another m2flow run on the machine has workers of the same titles."""
    import os

    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            parent[int(pid)] = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError):  # gone meanwhile
            pass

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    out = {}
    for pid in filter(lambda p: p.isdigit() and ours(int(p)), os.listdir("/proc")):
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace").strip()
            if "sac.actor_process" in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                stat = open(f"/proc/{pid}/stat").read()  # sac.actor_process's process, by its parent
                title = f"actor_process of {stat[stat.rindex(')') + 2:].split()[1]}"
            if title.startswith(("m2flow:", "ray::", "actor_process")):
                tids = os.listdir(f"/proc/{pid}/task")
                out[int(pid)] = (title, [os.getpriority(os.PRIO_PROCESS, int(t)) for t in tids])
        except OSError:  # gone meanwhile
            pass
    return out


def test_cluster_foreground_keeps_the_learner_at_its_priority_and_lowers_the_rest_for_the_run(cluster, tmp_path):
    """cluster.foreground=actor: while the run goes, the learner's threads stay at nice 0, and so do those of its own
    process (sac.actor_process), while the env worker's and the driver's are at 19; afterwards every one is back at 0
    (the env worker's process is kept for the next run)."""
    import os
    import threading

    seen, stop = [], threading.Event()

    def sample():  # foreground lowers the driver after every other process, and restores it before them
        me = threading.get_native_id()
        while not stop.wait(0.02):
            try:  # foreground lowers this thread too: back at 0, it samples while the run keeps both cores busy
                os.setpriority(os.PRIO_PROCESS, me, 0)
            except PermissionError:  # (only root may raise a priority)
                pass
            before, procs = os.getpriority(os.PRIO_PROCESS, os.getpid()), _nice_by_pid()
            seen.append((min(before, os.getpriority(os.PRIO_PROCESS, os.getpid())), procs))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = train(cfg_for(tmp_path, "fg", "cluster.placement=env,rollout: 0; actor: 1", "cluster.foreground=actor",
                               "sac.max_policy_lag=1", "policy.hidden=[32,32]", "run.steps=192",
                               "sac.parallel_update=true", "sac.actor_process=true",
                               "sac.learning_starts=63", "eval.episodes=0"), cluster)
    finally:
        stop.set()
        sampler.join()
    assert result["iterations"] == 192  # long enough for samples while it runs: 48 gave 2 of 265 on the Xeon
    # the processes by pid: a worker's title is its role's only between calls (with sac.ahead the learner is
    # almost always in one)
    [learner], [env_pid] = ({pid for _, procs in seen for pid, (title, _) in procs.items() if title == name}
                            for name in ("m2flow:actor:0", "m2flow:env:0+rollout:0"))
    during = [procs for driver, procs in seen if driver == 19 and learner in procs and env_pid in procs]
    assert len(during) >= 3, f"{len(seen)} samples, {len(during)} with the driver at nice 19"
    helpers = [[pid for pid, (title, _) in procs.items() if title == f"actor_process of {learner}"] for procs in during]
    assert sum(map(len, helpers)) >= 3, helpers  # the learner's own process, there from its first update
    for procs, helper in zip(during, helpers):
        assert set(procs[learner][1]) == {0}, procs[learner]
        assert set(procs[env_pid][1]) == {19}, procs[env_pid]
        assert all(set(procs[pid][1]) == {0} for pid in helper), [procs[pid] for pid in helper]
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == 0  # the driver's main thread
    after = [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{env_pid}/task")]
    assert set(after) == {0}, after  # kept idle for reuse, at its old priority


def test_cluster_foreground_must_name_components_of_the_flow(tmp_path):
    with pytest.raises(C.ConfigError, match=r"cluster.foreground names critic: expected components of this flow "
                                            r"\(env, rollout, actor\)"):
        cfg_for(tmp_path, "bad", "cluster.foreground=[actor, critic]")
