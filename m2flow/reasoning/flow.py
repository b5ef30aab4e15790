"""Reasoning RL (GRPO / PPO on a causal LM): the macro flow, one driver for every plan.

rollout -> reward -> inference (old/ref logprobs) -> actor, connected by channels. Whether the stages
take turns on shared devices or stream micro-batches between devices lives in the plan, not here. With
`algorithm.max_staleness: N` the rollout of the next N steps runs while the actor trains (docs/algorithms.md).
"""

from __future__ import annotations

from m2flow.engines.hf import load_tokenizer
from m2flow.planner.plan import ExecutionPlan, make_plan
from m2flow.reasoning.config import ReasoningConfig, reasoning_components, refill_reward_ranks
from m2flow.reasoning.steps import Steps, launch, merge_metrics, restore_driver_state, save_checkpoint
from m2flow.reasoning.tasks.datasets import build_datasets
from m2flow.reasoning.warm_start import prepare_model
from m2flow.run import Run
from m2flow.run_dir import run_dir_claimed
from m2flow.runtime import Cluster, foreground, running, wait_all
from m2flow.runtime.sync import WeightSync

COMPONENTS = ["rollout", "reward", "inference", "actor"]  # + "critic" (algorithm.name=ppo), "tool" (agent.tools)
PLOTS = {
    "reward": ["reward/mean", "reward/accuracy"],
    "response_length": ["response/length_mean"],
    "loss": ["actor/pg_loss", "actor/kl", "actor/entropy"],
    "step_seconds": ["time/step", "time/rollout", "time/weight_sync"],
    "idle": ["time/idle_fraction"],
    "heldout_accuracy": ["eval/pass@1"],
    "tool_calls": ["agent/calls", "agent/ok"],  # agent.tools: calls per response, and those the tool answered
}


def train(cfg: ReasoningConfig, cluster: Cluster | None = None, plan: ExecutionPlan | None = None) -> dict:
    """Run `cfg.run.steps` RL steps under `plan` (default: the one `cluster.placement` names); returns the last
    step's metrics, the run directory, the plan and the final model directory. `cluster.placement: auto` is resolved
    before a flow runs (`m2flow.train`, the `m2flow` command), which pass the chosen plan."""
    with run_dir_claimed(cfg.run.path, cfg.run.resume, cfg.run.overwrite):  # one run at a time; an old run is kept
        return _train(cfg, cluster, plan)


def _train(cfg: ReasoningConfig, cluster: Cluster | None, plan: ExecutionPlan | None) -> dict:
    """The flow, in its claimed run directory."""
    cluster = cluster or Cluster(cfg.cluster.address, cfg.cluster.cpu_devices, reuse_processes=cfg.cluster.reuse_processes)
    names = components(cfg)
    plan = plan or make_plan(cfg.placement(), cluster.num_devices, names,
                             cfg.rollout.prompts_per_step * cfg.rollout.n, cfg.actor.micro_batch)
    refill_reward_ranks(cfg, len(plan["reward"].rank_devices))  # an auto plan's too
    run = Run(cfg, plan, PLOTS, cfg.algorithm.name)
    model_path = prepare_model(cfg, run.path)
    train_set, test_set = build_datasets(cfg.data, load_tokenizer(model_path), cfg.run.seed)
    c = launch(cfg, cluster, plan, names, model_path, run.path)
    groups, trainers = list(c.groups.values()), [g for g in (c.actor, c.critic) if g]
    run.write_plan(offload=bool(c.switched), cohosted=c.cohost)
    run.watch(groups, switched=c.switched, state_bytes=c.state_bytes)
    start, ckpt = run.resume_point()
    steps = Steps(cfg, plan, c, train_set, test_set, run.path, start)
    try:
        # released after a run that went well, killed if a step raises; cluster.foreground's components get the CPU first
        with running(groups), foreground(cluster, groups, cfg.cluster.foreground_components()):
            if ckpt:
                for g in trainers:
                    g.load_checkpoint(str(ckpt)).wait()
                restore_driver_state(ckpt, train_set)
            # who holds the current policy; co-hosted, every receiver in the actor's process
            receivers = [c.rollout, c.inference] if cfg.recompute_old_logprobs() else [c.rollout]
            sync = WeightSync(c.actor, receivers, cfg.rollout.checks_sync,
                              local=c.cohost and all(g.world_size == 1 for g in receivers))
            sync.first()
            if cfg.run.eval_every and start == 0:  # the curve's first point: the start model
                run.write(0, {}, steps.evaluate(0))
            last = {}
            for step in run.steps(start):
                work = steps.next(step)  # and the rollout of up to max_staleness steps after it
                handles = [*work.handles, c.actor.train(work.ready, step)]
                run.write_held()  # the last step's held-out evaluation ran while this step's work was handed out
                results = wait_all(handles)
                last = merge_metrics(results) | work.drawn | sync.after(step - start + 1)
                last.update({"time/rollout": last.get("rollout/seconds", 0.0),
                             "throughput/tokens_per_s": last.get("rollout/tokens", 0) / run.elapsed()})
                every = cfg.run.eval_every and ((step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.run.steps)
                evaluation = steps.evaluate(step + 1) if every else None  # queued on the rollout before it generates
                save = run.checkpoint_due(step)  # the row is written first: the metrics never run behind a checkpoint
                last = run.end_step(step, last, evaluation, hold=not save,
                                    info=f"reward {last['reward/mean']:.3f}  acc {last['reward/accuracy']:.2f}")
                if save:
                    save_checkpoint(run.dir, cfg, step + 1, trainers, steps.data_state())
            run.finish()
    finally:
        run.close()
        steps.destroy()
    return {"metrics": last, "run_dir": str(run.path), "plan": plan.to_dict(),
            "final_model": str(run.path / "checkpoints" / f"step_{cfg.run.steps}" / "model")}


def components(cfg: ReasoningConfig) -> list[str]:
    """The flow's components: rollout, reward, inference, actor; the critic with `algorithm.name=ppo`; the tool
    component with `agent.tools`."""
    return reasoning_components(cfg)
