"""Profiler for the reasoning flow (`m2flow profile CONFIG`): runs each component alone, on one device and on two
(one process spanning both), at a few batch sizes, and writes the profile table the planner reads (docs/planner.md).

Inputs are real: real prompts through the real rollout, whose groups are scored, turned into logprob batches and
trained on by the real workers, through Channels. It measures; it does not plan (`auto.py` does).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from m2flow.engines.hf import load_tokenizer
from m2flow.planner.profile import ComponentInfo, Machine, Profile, Transfer, Weights, median_rows
from m2flow.reasoning.config import reasoning_components
from m2flow.reasoning.tasks.datasets import build_datasets
from m2flow.reasoning.warm_start import prepare_model
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.reasoning.workers.critic import CriticWorker
from m2flow.reasoning.workers.inference import InferenceWorker
from m2flow.reasoning.workers.reward import RewardWorker
from m2flow.reasoning.workers.rollout import RolloutWorker
from m2flow.reasoning.workers.tool import ToolWorker
from m2flow.runtime import Channel, Cluster, launch_cohosted, parse_placement, running
from m2flow.runtime.probe import Probe
from m2flow.runtime.stream import END, drain
from m2flow.runtime.sync import sync_weights


def components_of(cfg) -> tuple[str, ...]:
    """The components of the reasoning flow for `cfg` that a profile measures, in data order
    (`config.reasoning_components`: the critic with `algorithm.name=ppo`), the tool component aside."""
    return tuple(c for c in reasoning_components(cfg) if c != "tool")


BURST_SHARE = 0.5  # rollout "does not stream" when its first output came after this share of its work


class RolloutProbe(Probe, RolloutWorker):
    pass


class RewardProbe(Probe, RewardWorker):
    pass


class InferenceProbe(Probe, InferenceWorker):
    pass


class ActorProbe(Probe, ActorWorker):
    pass


class CriticProbe(Probe, CriticWorker):
    pass


def default_batches(batch: int, group: int) -> list[int]:
    """Samples per profiled call: one prompt group, a quarter, half and all of the step's batch, in whole groups."""
    sizes = {max(group, batch * k // 4 // group * group) for k in (1, 2, 4)} | {group, batch}
    return sorted(s for s in sizes if s <= batch)


def profile_reasoning(cfg, cluster: Cluster, batches: list[int] | tuple[int, ...] | None = None,
                      out_path: str | Path | None = None, repeats: int = 3, devices: tuple[int, ...] | None = None,
                      run_dir: str | Path | None = None) -> Profile:
    """Profile the reasoning flow of `cfg` on `cluster`; write the table to `out_path` (default
    `run_dir/profile.json`) and the raw timings to `profile_details.json` beside it.

    `batches`: samples per call (whole prompt groups; default `default_batches`); `devices`: device counts to run
    each component on (default 1 and 2 where the cluster has 2): 1 = `comp: 0`, d = one rank over devices 0..d-1.
    Each row is the median of `repeats` calls after a warm-up call."""
    run_dir = Path(run_dir or cfg.run.path)
    out_path = Path(out_path or run_dir / "profile.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work_dir = run_dir / "profile_work"
    model_path = prepare_model(cfg, run_dir)
    group = cfg.rollout.n
    batch = cfg.rollout.prompts_per_step * group
    batches = sorted(set(batches or default_batches(batch, group)))
    bad = [b for b in batches if b % group or b < 1]
    if bad:
        raise ValueError(f"profile: batch sizes {bad} are not whole prompt groups of rollout.n={group}")
    devices = devices or tuple(d for d in (1, 2) if d <= cluster.num_devices)
    names = components_of(cfg)
    train_set, _ = build_datasets(cfg.data, load_tokenizer(model_path), cfg.run.seed)
    prompts = train_set.next_batch(max(batches) // group)

    rows: dict[tuple[str, int, int], list[dict]] = {}
    details: dict = {"batches": batches, "devices": list(devices), "repeats": repeats, "calls": []}
    info: dict = {}
    step = [0]
    # two channels for the whole run (each channel is a Ray actor: a process), reused by every call
    tag = f"{out_path.resolve()}:{time.time_ns()}"
    inp, out = Channel.create(f"{tag}/in"), Channel.create(f"{tag}/out")

    tools = None  # agent.tools: the tool component, in the rollout's process (as a collocated plan places it)

    def call(g, method, items, *args) -> tuple[dict, list]:
        """Feed `items` (+ END) into `inp`, run the call, return its measurements and what it put into `out`."""
        if items is not None:
            inp.put_many(list(items) + [END])
        t = time.perf_counter()
        r = g.timed(method, *args).wait()[0]
        info.setdefault("rpc", []).append(time.perf_counter() - t - r["seconds"])
        step[0] += 1
        return r, (list(drain(out)) if method != "train" else [])

    def chain(groups, b: int, record: int | None) -> None:
        """Run b samples through rollout -> reward -> inference (-> critic) -> actor, one stage at a time; record the
        rows."""
        rollout, reward, inference, *critic, actor = groups
        # the actor's latest weights first, as every step gets them: samples generated by older weights would be
        # over max_staleness, and the actor would time the dropping of them instead of training
        sync_weights(actor, [rollout, inference] if cfg.recompute_old_logprobs() else [rollout], check=False)
        got = {}
        got["rollout"], samples = call(rollout, "generate", None, prompts[: b // group], out, step[0], 1, 1, 0, tools)
        got["reward"], scored = call(reward, "score", samples, inp, out, step[0], 1)
        got["inference"], ready = call(inference, "logprobs", scored, inp, out, step[0], b, 1)
        if critic:  # values and GAE, then its own update: all of it the critic's work on the batch
            got["critic"], ready = call(critic[0], "values", ready, inp, out, step[0], 1, 1)
        got["actor"], _ = call(actor, "train", ready, inp, step[0], 1)
        dropped = (got["actor"]["result"] or {}).get("actor/stale_dropped", 0)
        if dropped:  # its row would time no training
            raise RuntimeError(f"profiling: the actor dropped {dropped} samples as stale (generated by old weights)")
        info["items"] = dict(samples=samples, scored=scored, ready=ready)
        if record is None:
            return
        if tools is not None:  # the rollout's time includes its waits for the tools' answers; these are their calls
            calls = [sp["end"] - sp["start"] for sp in tools.spans(clear=True) if sp["phase"] == "tool"]
            details.setdefault("tool_calls", []).append(dict(batch=b, devices=record, calls=len(calls),
                                                            seconds=sum(calls)))
        sizes = {"rollout": b, "reward": b, "inference": sum(len(g["responses"]) for g in scored),
                 "critic": sum(len(x) for x in ready), "actor": sum(len(x) for x in ready)}
        for name, r in got.items():
            seconds = r["seconds"]
            if name == "actor":  # the optimizer step is once-per-step work (fixed_seconds), not per sample
                seconds -= r["spans"].get("optimizer", 0.0)
            n = sizes[name]
            rows.setdefault((name, n, record), []).append(dict(seconds=seconds, peak_bytes=r["peak_bytes"]))
            details["calls"].append(dict(component=name, batch=n, devices=record, seconds=r["seconds"],
                                         spans=r["spans"], peak_bytes=r["peak_bytes"]))
        if record == min(devices):
            info.setdefault("optimizer", []).append(got["actor"]["spans"].get("optimizer", 0.0))
        if b == max(batches):
            # how far into its work (the call less its own puts) the rollout put its first output
            r = got["rollout"]
            work = r["seconds"] - sum(b - a for a, b in r["puts"])
            info.setdefault("rollout_first_out", []).append(min((a for a, _ in r["puts"]), default=work) / work)

    try:
        for d in devices:
            groups = _launch(cluster, cfg, model_path, d, work_dir)
            with running(list(groups)) as held:  # released after it (their processes host the next probes or the
                # run), killed on a raise
                rollout, reward, inference, *_, actor = groups
                if cfg.agent.tools:
                    beside = dataclasses.replace(rollout.placement, component="tool")
                    tools = ToolWorker.launch(cluster, beside, cfg, run_dir=str(work_dir), host_with=rollout)
                    held.append(tools)  # released with the others
                receivers = [rollout, inference] if cfg.recompute_old_logprobs() else [rollout]
                chain(groups, min(batches), None)  # warm-up: first calls allocate, import and connect
                for b in batches:
                    for _ in range(repeats):
                        chain(groups, b, d)
                for _ in range(repeats):
                    t = time.perf_counter()
                    sync_weights(actor, receivers, check=cfg.rollout.checks_sync(2))  # as in a run's steady state
                    info.setdefault("sync", []).append(time.perf_counter() - t)
                if d == min(devices):
                    info["state"] = {name: g.state_bytes().wait()[0] for name, g in zip(names, groups)}
                    info["weights"] = actor.model_bytes().wait()[0]
                    info["machine"] = rollout.machine(len(cluster.nodes[0]["devices"])).wait()[0]
                    info["transfer"] = _transfer(reward, inp, info["items"])
                    info["switch"] = {name: _switch(g, repeats) for name, g in zip(names, groups)
                                      if name != "reward"}
        if cfg.rollout.cohost:  # the flow's collocated plan runs every component in one process
            info["cohosted"] = _cohosted_steps(cluster, cfg, model_path, max(devices), work_dir,
                                               prompts[: batch // group], repeats)
    finally:
        inp.destroy()
        out.destroy()
        shutil.rmtree(work_dir, ignore_errors=True)

    profile = _table(cfg, cluster, rows, info, batch)
    details.update(sync_seconds=info["sync"], optimizer_seconds=info["optimizer"], call_overhead_seconds=info["rpc"],
                   rollout_first_out=info["rollout_first_out"], transfer=info["transfer"], switch=info["switch"],
                   state_bytes=info["state"], cohosted_step_seconds=info.get("cohosted", []))
    profile.save(out_path)
    profile.source = str(out_path)
    (out_path.parent / "profile_details.json").write_text(json.dumps(details, indent=1) + "\n")
    return profile


def _launch(cluster: Cluster, cfg, model_path: str, d: int, work_dir: Path, cohost: bool = False) -> list:
    """The probe groups, one per component, each one rank over devices 0..d-1, started in parallel; with `cohost`,
    every component in the rollout's process (as the flow runs a collocated plan)."""
    names = components_of(cfg)
    spec = "; ".join(f"{c}: 0" if d == 1 else f"{c}: 0-{d - 1}:0" for c in names)
    placement = parse_placement(spec, cluster.num_devices, list(names))
    for i in range(d):
        cluster.device_lock(i)  # create the locks before launching from several threads
    kinds = {"rollout": (RolloutProbe, (cfg, model_path)), "reward": (RewardProbe, (cfg,)),
             "inference": (InferenceProbe, (cfg, model_path)), "critic": (CriticProbe, (cfg, model_path)),
             "actor": (ActorProbe, (cfg, model_path))}
    if cohost:
        specs = [(kinds[c][0], placement[c], kinds[c][1]) for c in names]
        return launch_cohosted(cluster, specs, run_dir=str(work_dir))
    with ThreadPoolExecutor(len(names)) as pool:
        futures = [pool.submit(kinds[c][0].launch, cluster, placement[c], *kinds[c][1], run_dir=str(work_dir))
                   for c in names]
        groups, errors = [], []
        for f in futures:
            try:
                groups.append(f.result())
            except Exception as e:  # noqa: BLE001 - kill what started, then raise the first error
                errors.append(e)
    if errors:
        for g in groups:
            g.kill()
        raise errors[0]
    return groups


def _cohosted_steps(cluster: Cluster, cfg, model_path: str, d: int, work_dir: Path, prompts: list,
                    repeats: int) -> list[float]:
    """Seconds of whole steps on `prompts` with every component in one process over devices 0..d-1, as the flow runs
    a collocated plan (`rollout.cohost`: stages hand over in-process, weights are published in place): the weight
    sync, then rollout -> reward -> inference (-> critic) -> actor, stage after stage, timed by the driver. The
    first of `repeats` + 1 steps warms up and is left out."""
    groups = _launch(cluster, cfg, model_path, d, work_dir, cohost=True)
    tag, batch = f"{work_dir.resolve()}:cohosted:{time.time_ns()}", len(prompts) * cfg.rollout.n
    seconds = []
    with running(list(groups)) as held:
        rollout, reward, inference, *critic, actor = groups
        tools = None
        if cfg.agent.tools:  # in the same process, as the collocated flow hosts it
            beside = dataclasses.replace(rollout.placement, component="tool")
            tools = ToolWorker.launch(cluster, beside, cfg, run_dir=str(work_dir), host_with=rollout)
            held.append(tools)
        receivers = [rollout, inference] if cfg.recompute_old_logprobs() else [rollout]
        # created once, as the flow does (each channel is a Ray actor, whose start would load the cores)
        hops = [Channel.create(f"{tag}/{i}") for i in range(4 if critic else 3)]
        try:
            for k in range(repeats + 1):
                t = time.perf_counter()
                sync_weights(actor, receivers, check=False, local=True)
                rollout.generate(prompts, hops[0], k, 1, batch, 0, tools).wait()
                reward.score(hops[0], hops[1], k, 1).wait()
                inference.logprobs(hops[1], hops[2], k, batch, 1).wait()
                if critic:
                    critic[0].values(hops[2], hops[3], k, 1, 1).wait()
                actor.train(hops[-1], k, 1).wait()
                seconds.append(time.perf_counter() - t)
        finally:
            for ch in hops:
                ch.destroy()
    return seconds[1:]


def _switch(g, repeats: int) -> tuple[float, float]:
    """Median seconds of offload() and onload() of one rank."""
    off, on = [], []
    for _ in range(repeats):
        h = g.offload()
        h.wait()
        off.append(h.wall_times[0])
        h = g.onload()
        h.wait()
        on.append(h.wall_times[0])
    return statistics.median(off), statistics.median(on)


def _transfer(consumer, ch: Channel, items: dict) -> dict:
    """Channel cost between processes: per-message latency (small items) and seconds per GB (4 MB tensors), as the
    driver's put plus the consumer's get; bytes per sample averaged over the flow's three channels."""
    def hop(payload) -> float:
        t = time.perf_counter()
        ch.put_many(list(payload) + [END])
        put = time.perf_counter() - t
        return put + consumer.consume(ch).wait()[0][1]

    small = [{"i": i, "reward": 0.5} for i in range(50)]
    latency = statistics.median(hop(small) for _ in range(3)) / len(small)
    big = [torch.randn(1 << 20) for _ in range(8)]  # 8 x 4 MB
    seconds = statistics.median(hop(big) for _ in range(3))
    per_gb = max(0.0, seconds - latency * len(big)) / (len(big) * 4 * (1 << 20)) * 1e9
    per_sample = []
    for name in ("samples", "scored", "ready"):
        objs = items[name]
        n = sum(len(x["responses"]) if isinstance(x, dict) else len(x) for x in objs)
        per_sample.append(sum(len(pickle.dumps(x)) for x in objs) / max(n, 1))
    return dict(latency_seconds=latency, seconds_per_gb=per_gb, bytes_per_sample=int(statistics.mean(per_sample)))


def _table(cfg, cluster: Cluster, rows: dict, info: dict, batch: int) -> Profile:
    kind, memory = info["machine"]
    machine = Machine(kind, cluster.num_devices, int(memory))
    names = components_of(cfg)
    measurements = median_rows(rows, names)
    # once per step in every plan of this flow: the weight sync (each component is its own process, so even
    # collocated peers receive weights through the object store) and one round trip of the step's calls
    per_step = statistics.median(info["sync"]) + statistics.median(info["rpc"])
    # the actor merges the micro-batches streamed to it into passes of actor.micro_batch_tokens padded tokens: at
    # the profiled rows' width, this many samples per pass
    width = max((x["input_ids"].shape[1] for x in info["items"]["ready"]), default=0)
    merge = cfg.actor.micro_batch_tokens // width if cfg.actor.micro_batch_tokens and width else 0
    components = {}
    for name in names:
        off, on = info["switch"].get(name, (0.0, 0.0))
        components[name] = ComponentInfo(
            state_bytes=info["state"][name],
            shard_state=True,  # one process spans the component's devices: its state is held once over them
            offload_seconds=off, onload_seconds=on,
            # the actor streams with one mini-batch and one epoch (it accumulates gradients per micro-batch); the
            # critic never does (GAE and the whitening need the whole step)
            streams=name != "critic" and not (name == "actor" and (cfg.actor.mini_batches > 1
                                                                  or cfg.actor.epochs > 1)),
            # once per step: the optimizer step (timed on the fewest devices) + the per-step costs above
            fixed_seconds=statistics.median(info["optimizer"]) + per_step if name == "actor" else 0.0,
            merge_samples=merge if name == "actor" else 0)
    if statistics.median(info["rollout_first_out"]) > BURST_SHARE:
        # the rollout emits its outputs in a burst at the end of its call (e.g. every request fits in the engine's
        # batch): nothing after it can overlap with it, so the rest is a tail on the whole batch
        components["reward"] = dataclasses.replace(components["reward"], streams=False)
    scale = None
    if info.get("cohosted"):  # a co-hosted step against the sum of the rows it is made of, at the same size
        d = max(m.devices for m in measurements)
        rows_at = {m.component: m.seconds for m in measurements if m.devices == d and m.batch == batch}
        if set(rows_at) == set(names):
            scale = statistics.median(info["cohosted"]) / (sum(rows_at.values()) + components["actor"].fixed_seconds)
    t = info["transfer"]
    return Profile(flow="reasoning", stages=names, batch=batch, machine=machine, components=components,
                   measurements=measurements,
                   transfer=Transfer(t["bytes_per_sample"], t["seconds_per_gb"], t["latency_seconds"]),
                   weights=Weights(info["weights"], "actor", ("rollout", "inference")), cohosted_scale=scale)
