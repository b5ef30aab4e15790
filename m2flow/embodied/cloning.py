"""`m2flow sft --demos`: behaviour cloning of the config's policy from `m2flow demos` datasets, in this process, into
a checkpoint an RL run starts from (`policy.init`) and `m2flow eval` evaluates. The fit itself is `bc.py`'s."""

from __future__ import annotations

import json
from pathlib import Path

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.evaluation import evaluate_checkpoint
from m2flow.embodied.workers.env import make_env_group
from m2flow.embodied.workers.policy import make_policy
from m2flow.run_dir import progress


def behaviour_clone(cfg: EmbodiedConfig, demos: str | Path, out: str | Path, steps: int = 2000,
                    episodes: int | None = None, batch_size: int = 256, lr: float = 1e-3, shift: int = 0,
                    show: bool = True) -> dict:
    """Fit `cfg`'s policy to the demonstrations in `demos` (`m2flow demos`; several datasets comma-separated, one per
    task of a multi-task env.id; the first `episodes` of each, successful ones only: fewer leave RL room to improve)
    and write `out/`: policy.safetensors and config.yaml, which
    `policy.init=OUT` starts an RL run from and `evaluate_checkpoint` evaluates, plus bc.json (the fit's metrics, the
    demos used) and eval.json (`cfg.eval.episodes` deterministic episodes from held-out seeds). `shift`: with pixel
    observations, each minibatch's frames moved by up to this many pixels at random (`bc.shift_frames`). In this
    process."""
    from safetensors.torch import save_file

    from m2flow.embodied.bc import demo_data, fit, shift_frames
    from m2flow.embodied.envs.maniskill import pixel_layout

    if shift and not cfg.env.pixels:
        raise ValueError(f"shift={shift} moves camera frames, but the config observes states (env.pixels=false)")
    if not 0 <= shift < cfg.env.image_size // 2:
        raise ValueError(f"shift must be in [0, {cfg.env.image_size // 2}) pixels for env.image_size="
                         f"{cfg.env.image_size}, got {shift}")
    if cfg.env.norm_obs:
        raise ValueError("behaviour cloning with env.norm_obs=true is not supported yet (the RL run would normalize "
                         "observations the cloned policy never saw normalized); set env.norm_obs=false")
    data = demo_data(str(demos), cfg.env.id, cfg.env.instruct, cfg.env.chunk, cfg.algorithm.gamma, episodes,
                     pixels=cfg.env.pixels, image_size=cfg.env.image_size,
                     render_triangles=cfg.env.render_triangles, wrist_camera=cfg.env.wrist_camera)
    group = make_env_group(cfg, 1, cfg.run.seed)
    policy = make_policy(cfg, group.observation_space, group.action_space)
    group.close()
    layout = pixel_layout(cfg.env.image_size, cfg.env.wrist_camera) if shift else None
    augment = (lambda obs, gen: shift_frames(obs, layout, shift, gen)) if shift else None
    with progress(show) as bar:
        task = bar.add_task("behaviour cloning", total=steps, info="")
        metrics = fit(policy, data, steps, batch_size=batch_size, lr=lr, vf_coef=cfg.algorithm.vf_coef,
                      seed=cfg.run.seed, augment=augment,
                      on_step=lambda i, m: bar.update(task, completed=i, info=f"nll {m['bc/nll']:.3f}"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, str(out / "policy.safetensors"))
    C.save_yaml(cfg, out / "config.yaml")
    result = {**metrics, "demos": str(demos), "demo_episodes": int(data["episodes"]), "demo_steps": len(data["obs"]),
              "steps": steps, "shift": shift}
    (out / "bc.json").write_text(json.dumps(result, indent=1) + "\n")
    if cfg.eval.episodes:
        result["eval"] = evaluate_checkpoint(out, cfg.eval.episodes, show=show)
        (out / "eval.json").write_text(json.dumps(result["eval"], indent=1) + "\n")
    return result
