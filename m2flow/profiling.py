"""`m2flow profile CONFIG`: profile the config's flow with its own profiler and print the table."""

from __future__ import annotations

import time

from m2flow.runtime import Cluster


def profile_command(config: str, overrides: list[str], out: str | None = None, batches: str | None = None,
                    repeats: int = 3) -> str:
    """`m2flow profile CONFIG [overrides] [--out P.json] [--batches 8,16,32]`: profile the config's flow (reasoning or
    embodied; embodied batches are env counts), write the table, return a summary."""
    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.reasoning.config import ReasoningConfig

    data = C.read_yaml(C.resolve_path(config))
    flow = data.get("flow", "reasoning")
    if flow not in ("reasoning", "embodied"):
        raise C.ConfigError(f"config '{config}': flow must be reasoning | embodied, got '{flow}'")
    cfg = C.load(ReasoningConfig if flow == "reasoning" else EmbodiedConfig, data, overrides)
    cluster = Cluster(cfg.cluster.address, cfg.cluster.cpu_devices, reuse_processes=cfg.cluster.reuse_processes)
    try:
        sizes = [int(s) for s in batches.split(",")] if batches else None
        start = time.perf_counter()
        if flow == "embodied":  # batches are env counts
            from m2flow.embodied.profiler import profile_embodied

            p = profile_embodied(cfg, cluster, sizes, out, repeats=repeats)
        else:
            from m2flow.reasoning.profiler import profile_reasoning

            p = profile_reasoning(cfg, cluster, sizes, out, repeats=repeats)
    finally:
        cluster.shutdown()
    lines = [f"profiled {len(p.measurements)} (component, batch, devices) cells on {p.machine.devices} x "
             f"{p.machine.kind} in {time.perf_counter() - start:.0f} s: {p.source}",
             f"{'component':10s} {'batch':>6s} {'devices':>7s} {'seconds':>9s} {'peak MB':>8s}"]
    lines += [f"{m.component:10s} {m.batch:6d} {m.devices:7d} {m.seconds:9.4f} {m.peak_bytes / 1e6:8.0f}"
              for m in p.measurements]
    for name, c in p.components.items():
        lines.append(f"{name}: state {c.state_bytes / 1e6:.2f} MB, offload {c.offload_seconds:.3f} s, "
                     f"onload {c.onload_seconds:.3f} s, fixed {c.fixed_seconds:.3f} s/step"
                     + ("" if c.streams else ", waits for the whole batch")
                     + (f", merges what streams in into passes of {c.merge_samples} samples" if c.merge_samples else ""))
    t = p.transfer
    lines.append(f"channel: {t.latency_seconds * 1e3:.2f} ms per message, {t.seconds_per_gb:.3f} s/GB, "
                 f"{t.bytes_per_sample} bytes per sample")
    lines.append(f"next: m2flow plan --profile {p.source} --devices N")
    return "\n".join(lines)
