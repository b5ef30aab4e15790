"""Start-up of the reasoning flow's four groups (rollout, reward, inference, actor; pipelined placement on 2 CPU
devices): one `Group.launch` after another vs `launch_all` in new processes vs `launch_all` in the idle processes
that `release_all` kept (the cluster's `reuse_processes`), side by side, a few repeats. Prints; asserts nothing.

    python benchmarks/launch.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.warm_start import prepare_model
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.reasoning.workers.inference import InferenceWorker
from m2flow.reasoning.workers.reward import RewardWorker
from m2flow.reasoning.workers.rollout import RolloutWorker
from m2flow.runtime import Cluster, launch_all, parse_placement, release_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="m2flow-launch-"))
    cfg = C.load(ReasoningConfig, "grpo_arithmetic", [f"run.dir={work}"])
    model = prepare_model(cfg, work)
    cluster = Cluster(cpu_devices=2)
    plan = parse_placement("rollout: 0; reward,inference,actor: 1", cluster.num_devices)
    specs = [(RolloutWorker, plan["rollout"], (cfg, model)), (RewardWorker, plan["reward"], (cfg,)),
             (InferenceWorker, plan["inference"], (cfg, model)), (ActorWorker, plan["actor"], (cfg, model))]
    for _ in range(args.repeats):
        t = time.perf_counter()
        groups = [cls.launch(cluster, placement, *a) for cls, placement, a in specs]
        one_by_one = time.perf_counter() - t
        for g in groups:
            g.kill()
        t = time.perf_counter()
        groups = launch_all(cluster, specs)
        together = time.perf_counter() - t
        release_all(groups)
        t = time.perf_counter()
        groups = launch_all(cluster, specs)
        reused = time.perf_counter() - t
        for g in groups:
            g.kill()
        print(f"one after another {one_by_one:.1f} s, launch_all {together:.1f} s ({one_by_one / together:.2f}x), "
              f"launch_all in reused processes {reused:.1f} s ({together / reused:.1f}x faster than new ones)")
    cluster.shutdown()


if __name__ == "__main__":
    main()
