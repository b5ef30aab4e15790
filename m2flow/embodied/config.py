"""The embodied flow's config: its sections (env, policy, rollout, algorithm, actor, sac, eval) and
`EmbodiedConfig`, each field with its default, range and a line of help (`m2flow train --help-config`).
The machinery that loads and checks them is `m2flow/config.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from m2flow.config import (CHECK_SYNC_HELP, ClusterConfig, RunConfig, checks_sync, max_weight_growth_opt,
                           nonfinite_opt, opt, section, validate_check_sync, validate_nonfinite)
from m2flow.errors import ConfigError

@dataclass
class EmbodiedRunConfig(RunConfig):
    name: str = opt("ppo", "run name, a plain name (no /): outputs go to <dir>/<name>/")
    steps: int = opt(50, "training iterations: one rollout of rollout.steps per env, then one update",
                     within="[0, inf)")
    stop_return: float | None = opt(None, "stop early once the mean return of the last stop_window episodes reaches this",
                                    within="(-inf, inf)")
    stop_window: int = opt(20, "episodes averaged for stop_return (and for the progress bar)", within="[1, inf)")
    trace_every: int = opt(50, "per-stage env/policy spans on the first two iterations and every N-th (0: first two)",
                           within="[0, inf)")


@dataclass
class EmbodiedClusterConfig(ClusterConfig):
    placement: Any = opt("env,rollout,actor: 0", "component -> devices: 'env,rollout,actor: 0' (collocated, lockstep), "
                         "'env: 0; rollout: 1; actor: 0-1:0' (hybrid), 'env: 0-1; rollout,actor: 0' (two env workers), "
                         "'auto' (profile, then the fastest predicted placement and env.pipeline_stages)")
    profile_steps: int = opt(20, "auto placement and `m2flow profile`: steps of each profiled rollout (as rollout.steps "
                                 "counts them; at most the horizon), its times scaled to the horizon", within="[1, inf)")
    compress_frames: bool = opt(False, "frames (uint8 observations) that cross nodes travel compressed (Zstandard, "
                                       "lossless, ~2x on ManiSkill3's): the env workers' requests to policy workers "
                                       "on other nodes and the trajectories where env and actor ranks span nodes; "
                                       "on one node nothing changes")
    COMPONENTS: ClassVar[tuple[str, ...]] = ("env", "rollout", "actor")

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.offload is not False:
            raise ConfigError(f"{where}.offload: the embodied flow keeps its small policies resident (offload is "
                              f"built for the reasoning flow); set {where}.offload=false")


@dataclass
class EnvConfig:
    id: str = opt("CartPole-v1", "gymnasium env id (classic control, MuJoCo, or 'module:Env-v0'), or ManiSkill3's "
                                 "PickCube-v1 | PushCube-v1 | StackCube-v1 (several, comma-separated, with instruct "
                                 "or pixels: env i of each env worker runs task (i // env.seed_groups) % n)")
    num_envs: int = opt(8, "envs in total, split evenly over the env workers", within="[1, inf)")
    pipeline_stages: int = opt(1, "env groups per env worker: the policy infers for one while the simulator steps "
                               "another (1: lockstep)", within="[1, inf)")
    seed_groups: int = opt(1, "consecutive envs that share a reset seed (the groups of embodied GRPO)",
                           within="[1, inf)")
    norm_obs: bool = opt(False, "normalize observations by running mean/std (saved in checkpoints)")
    norm_reward: bool = opt(False, "scale rewards by the running std of discounted returns (saved in checkpoints)")
    clip_obs: float = opt(10.0, "clip normalized observations to [-c, c]", within="(0, inf)")
    clip_reward: float = opt(10.0, "clip scaled rewards to [-c, c]", within="(0, inf)")
    chunk: int = opt(1, "actions per policy call (action chunks): one learner step of up to `chunk` env steps",
                     within="[1, inf)")
    pixels: bool = opt(False, "observe rendered frames [3, image_size, image_size] uint8: gymnasium's envs (with "
                              "policy.kind=cnn), or ManiSkill3's task camera with the robot's proprioception and "
                              "the instruction beside it (with policy.kind=vla)")
    image_size: int = opt(64, "side of the pixel observations (36 at least: the CNN encoder's three convolutions "
                              "leave nothing of a smaller frame)", within="[36, 2048]")
    render_triangles: int = opt(1000, "ManiSkill3 pixels: the visual meshes keep about this many triangles per body "
                                "(the robot's links; quadric decimation, untextured meshes only), as small frames "
                                "need; the software renderer's time per frame is in the triangles (0: as shipped)",
                                within="[0, inf)")
    wrist_camera: bool = opt(False, "ManiSkill3 pixels: a second frame from a camera on the robot's hand (ManiSkill's "
                                    "panda_wristcam), after the task camera's: it shows how far the gripper is from "
                                    "the cube along the task camera's axis, which that camera's frame hides")
    max_episode_steps: int | None = opt(None, "override the env's time limit (None: the registered one)",
                                        within="[1, inf)")
    instruct: bool = opt(False, "ManiSkill3: observations carry the task's instruction (word ids, then the state "
                                "padded to 48) for policy.kind=instruct; needed when env.id lists several tasks "
                                "('PickCube-v1,PushCube-v1,StackCube-v1': env i runs task i % 3)")
    kwargs: dict = opt({}, "extra keyword arguments for gymnasium.make, e.g. {ctrl_cost_weight: 0.1}")
    step_timeout_s: float = opt(60.0, "an env step or reset that has not returned after this many seconds stops the "
                                      "run, naming the env worker (0: no limit)", within="[0, inf)")

    def validate(self, where: str) -> None:
        if self.num_envs % self.seed_groups:
            raise ConfigError(f"{where}.seed_groups={self.seed_groups} must divide {where}.num_envs={self.num_envs}")


@dataclass
class PolicyConfig:
    kind: str = opt("mlp", "mlp (state obs) | cnn (pixel obs, Nature-CNN encoder) | instruct (env.instruct obs: the "
                           "instruction's words embedded and averaged, beside the state, into the MLPs) | vla "
                           "(ManiSkill3 pixel obs: a tiny vision-language-action model, the vla section)")
    hidden: list[int] = opt([64, 64], "MLP hidden sizes (separate actor and critic networks)", within="[1, inf)")
    activation: str = opt("tanh", "MLP activation: tanh | relu | gelu | elu")
    log_std_init: float = opt(0.0, "initial log std of Gaussian actions", within="(-inf, inf)")
    ortho_init: bool = opt(True, "orthogonal init (False: torch's default init, as SB3's ortho_init=False)")
    features_dim: int = opt(512, "CNN encoder output width", within="[1, inf)")
    init: str = opt("", "start from this checkpoint's policy (a directory holding policy.safetensors: an embodied "
                        "run's checkpoint, or behaviour cloning's `m2flow sft CONFIG OUT --demos DIR`); empty: random "
                        "init")
    init_std_scale: float = opt(1.0, "with policy.init: multiply the loaded Gaussian policy's std by this before RL "
                                     "starts (a cloned policy's std fits the demonstrations' residuals; sampling at it "
                                     "can fail where the mean succeeds)", within="(0, inf)")
    init_critic: bool = opt(True, "with policy.init: load the checkpoint's value function too (the modules named "
                                  "critic*); false: it starts from its initialization, as where RL's reward is not "
                                  "the one a clone's value regressed (its demonstrations' dense returns)")

    def validate(self, where: str) -> None:
        if self.kind not in ("mlp", "cnn", "instruct", "vla"):
            raise ConfigError(f"{where}.kind must be mlp | cnn | instruct | vla, got '{self.kind}'")
        if self.activation not in ("tanh", "relu", "gelu", "elu"):
            raise ConfigError(f"{where}.activation must be tanh | relu | gelu | elu, got '{self.activation}'")


@dataclass
class VLAConfig:
    """policy.kind=vla: a small Llama over the frame's patches, the proprioception and the instruction's words."""
    head: str = opt("gaussian", "gaussian (continuous actions, as PPO/SAC policies) | tokens (OpenVLA's discrete "
                                "action tokens: `bins` per action dimension, decoded one after another)")
    bins: int = opt(32, "with head=tokens: bins per action dimension over the action space's bounds",
                    within="[2, 4096]")
    dim: int = opt(64, "the LM's hidden size (and the patch and word embeddings')", within="[8, inf)")
    layers: int = opt(2, "the LM's decoder layers", within="[1, inf)")
    heads: int = opt(4, "attention heads (dim must be a multiple)", within="[1, inf)")
    patch: int = opt(16, "the frame's patch side in pixels: (image_size / patch)^2 frame tokens; a multiple of 4 "
                         "dividing env.image_size", within="[4, inf)")
    value_hidden: list[int] = opt([], "a tanh MLP of these sizes over the proprioception and the episode's "
                                      "progress, added to the linear value head on the readout token (a value "
                                      "that knows the steps left); []: the linear head alone", within="[1, inf)")

    def validate(self, where: str) -> None:
        if self.head not in ("gaussian", "tokens"):
            raise ConfigError(f"{where}.head must be gaussian | tokens, got '{self.head}'")
        if self.dim % self.heads:
            raise ConfigError(f"{where}.dim={self.dim} must be a multiple of {where}.heads={self.heads}")
        if self.patch % 4:
            raise ConfigError(f"{where}.patch must be a multiple of 4, got {self.patch}")


@dataclass
class EmbodiedRolloutConfig:
    steps: int = opt(128, "policy steps per env per iteration (SB3's n_steps)", within="[1, inf)")
    deterministic: bool = opt(False, "act with the distribution's mode instead of sampling (for tests)")
    cohost: bool = opt(True, "lockstep (env.pipeline_stages 1) with env and policy workers on the same devices: run "
                             "each policy worker inside its env worker's process, so a step's hand-over is a "
                             "function call instead of a Ray call")
    check_weight_sync: bool | str = opt("first", CHECK_SYNC_HELP)

    def validate(self, where: str) -> None:
        validate_check_sync(self, where)

    checks_sync = checks_sync


@dataclass
class EmbodiedAlgorithmConfig:
    name: str = opt("ppo", "ppo (GAE) | grpo (group-relative outcome advantages over envs sharing a reset seed) | "
                           "sac (off-policy soft actor-critic with a replay buffer: the sac section)")
    gamma: float = opt(0.99, "discount", within="[0, 1]")
    lam: float = opt(0.95, "GAE lambda", within="[0, 1]")
    clip: float = opt(0.2, "PPO clip range", within="(0, 1)")
    anneal_clip: bool = opt(False, "decay the clip range linearly to 0 over the run")
    clip_vf: float | None = opt(None, "value clip range around the rollout values (None: off)", within="(0, inf)")
    vf_coef: float = opt(0.5, "weight of the value MSE, mean((V - R)^2), in the loss", within="[0, inf)")
    ent_coef: float = opt(0.0, "entropy bonus", within="[0, inf)")
    norm_adv: bool = opt(True, "normalize advantages per minibatch")
    target_kl: float | None = opt(None, "stop the epochs once a minibatch's approx KL exceeds 1.5 x this (None: off)",
                                  within="(0, inf)")
    score: str = opt("auto", "grpo outcome per env: success (success_once) | return | auto (success if reported)")

    def validate(self, where: str) -> None:
        if self.name not in ("ppo", "grpo", "sac"):
            raise ConfigError(f"{where}.name must be ppo | grpo | sac, got '{self.name}'")
        if self.score not in ("auto", "success", "return"):
            raise ConfigError(f"{where}.score must be auto | success | return, got '{self.score}'")


@dataclass
class EmbodiedActorConfig:
    lr: float = opt(3e-4, "Adam learning rate", within="(0, inf)")
    critic_lr: float | None = opt(None, "PPO: the learning rate of the value function's own parameters (the critic "
                                        "network and the value head; with an encoder shared by both heads, as a "
                                        "VLA's or a CNN's, the value head alone); null: actor.lr. A clone's small "
                                        "actor.lr leaves its value head where cloning put it", within="(0, inf)")
    anneal_lr: bool = opt(False, "decay the learning rate(s) linearly to 0 over the run")
    adam_eps: float = opt(1e-5, "Adam epsilon", within="(0, inf)")
    epochs: int = opt(10, "passes over each rollout", within="[1, inf)")
    minibatch_size: int = opt(64, "samples per gradient step (SB3's batch_size)", within="[1, inf)")
    grad_clip: float = opt(0.5, "max gradient norm", within="(0, inf)")
    compile: bool = opt(False, "torch.compile the minibatch loss (forward + backward), compiled at the first update "
                                  "(inductor needs a C++ compiler)")
    nonfinite: str = nonfinite_opt()
    max_weight_growth: float = max_weight_growth_opt()
    critic_warmup: int = opt(0, "the first N iterations train the value function only, the policy held as it is "
                                "(its std too where algorithm.ent_coef is 0): a cloned policy's critic learns the RL "
                                "returns before its advantages steer the policy", within="[0, inf)")
    bc_coef: float = opt(0.0, "a behaviour-cloning term beside the RL loss, as DAPG: bc_coef x the negative "
                              "log-likelihood of a minibatch of demonstrated actions (actor.bc_demos) in every "
                              "update; 0: off", within="[0, inf)")
    bc_decay: float = opt(1.0, "bc_coef is multiplied by this after every iteration (DAPG decays it: RL takes over)",
                          within="(0, 1]")
    bc_demos: str = opt("", "the demonstrations of actor.bc_coef (`m2flow demos` directories; comma-separated, one "
                            "per task of a multi-task env.id)")

    def validate(self, where: str) -> None:
        if self.bc_coef > 0 and not self.bc_demos:
            raise ConfigError(f"{where}.bc_coef > 0 needs {where}.bc_demos (a `m2flow demos` directory)")
        validate_nonfinite(self, where)


@dataclass
class SACConfig:
    """Stable-Baselines3's SAC options, with its names and defaults; the learning rate is actor.lr (the actor's,
    the critics' and the temperature's), the discount algorithm.gamma, the networks' sizes policy.hidden."""
    buffer_size: int = opt(1_000_000, "replay buffer capacity in transitions (checked against free memory at start)",
                           within="[1, inf)")
    learning_starts: int = opt(100, "env steps (all envs together) of uniform random actions; the updates start once "
                                    "more were collected (as SB3's)", within="[0, inf)")
    batch_size: int = opt(256, "transitions per gradient step", within="[1, inf)")
    logp_eps: float = opt(0.0, "eps in the actor's log-density log(1 - tanh(u)^2 + eps): 0 exact, 1e-6 SB3's",
                          within="[0, 1)")
    tau: float = opt(0.005, "Polyak coefficient of the target critics' update", within="(0, 1]")
    train_freq: int = opt(1, "env steps per env between updates: the rollout of one iteration", within="[1, inf)")
    gradient_steps: int = opt(1, "gradient steps per iteration (-1: as many as env steps collected, all envs)",
                              within="[-1, inf)")
    utd: float | None = opt(None, "update-to-data ratio: gradient steps per env step collected (all envs), e.g. 0.5, "
                                  "or 20 for RLPD's; set, it replaces gradient_steps", within="(0, inf)")
    ent_coef: float | str = opt("auto", "entropy temperature alpha: a number (fixed), 'auto' (tuned, from 1) or "
                                        "'auto_X' (tuned, from X)", within="(0, inf)")
    target_entropy: float | str = opt("auto", "the entropy 'auto' tuning aims at: 'auto' (-action dims) or a number",
                                      within="(-inf, inf)")
    target_update_interval: int = opt(1, "gradient steps between target-critic updates", within="[1, inf)")
    max_policy_lag: int = opt(0, "0: an iteration's updates see its own env steps (SB3's order: collect, then "
                                 "update); 1: the learner updates on the steps before while the envs collect the "
                                 "next (overlapped when the plan puts them on different devices)", within="[0, 1]")
    parallel_update: bool = opt(False, "the critics' and the actor's gradient steps run at once, in two threads "
                                       "with half the learner's cores each; the actor's loss then reads the critics "
                                       "before this step's update (as the original SAC implementation does) instead "
                                       "of after it (SB3). Pays off when the learner has 2+ cores")
    actor_process: bool = opt(False, "with parallel_update and grad=manual: the actor's side of the step runs in a "
                                     "process of its own (spawned at the first iteration; the actor's and critics' "
                                     "weights in shared memory) instead of a thread, so that the two sides never "
                                     "wait on one Python lock; the same numbers")
    demos: str = opt("", "RLPD: `m2flow demos` directories (comma-separated, one per task) whose successful episodes "
                         "fill a second buffer; each minibatch draws demo_fraction of its rows from it")
    demo_fraction: float = opt(0.5, "with sac.demos: the share of every minibatch drawn from the demonstrations",
                               within="(0, 1)")
    demo_episodes: int | None = opt(None, "with sac.demos: use the first N episodes of each dataset (None: all)",
                                    within="[1, inf)")
    bc_coef: float = opt(0.0, "with sac.demos: adds bc_coef x the squared error of the actor's deterministic action "
                              "to the demonstrated one, on each minibatch's demonstration rows, to the actor's loss "
                              "(as DDPG/TD3 + BC); 0: off", within="[0, inf)")
    critic_layernorm: bool = opt(False, "a LayerNorm after every hidden layer of the critics (RLPD's critic: "
                                        "bounded features keep Q from running away at high update-to-data ratios "
                                        "and with demonstrations)")
    n_critics: int = opt(2, "critics (SB3's n_critics; RLPD's ensemble has 10)", within="[1, inf)")
    min_qs: int | None = opt(None, "the TD target takes the min over a random subset of this many target critics, "
                                   "drawn every gradient step (RLPD's num_min_qs, REDQ's M; 2 of 10); None: all "
                                   "of them (SB3)", within="[1, inf)")
    actor_q: str = opt("min", "the actor's loss scores its actions with the critics' min (SB3) or mean (REDQ, RLPD)")
    grad: str = opt("auto", "how a gradient step differentiates its losses: manual (SAC's gradients written out for "
                            "ReLU MLPs, with or without the critics' LayerNorm and the BC term: no autograd graph, "
                            "equal to autograd's to float rounding) | autograd | "
                            "auto (manual where the networks allow it: a ReLU SquashedGaussian MLP actor)")
    ahead: bool = opt(True, "at max_policy_lag=1: the driver queues the learner's next iteration while it still runs "
                            "this one, and the learner hands its weights back with its result, so that it goes on to "
                            "its next gradient steps at once while the driver logs and the policy workers load the "
                            "weights (the same numbers; not where the learner shares the env workers' process); "
                            "false: one iteration after the other")
    save_buffer: str = opt("latest", "which checkpoints hold the replay buffer: latest (the newest complete one; an "
                                     "older one's is removed once a newer checkpoint is complete) | all | none (a "
                                     "resumed run refills an empty buffer, as SB3 without save_replay_buffer)")

    def validate(self, where: str) -> None:
        if self.save_buffer not in ("latest", "all", "none"):
            raise ConfigError(f"{where}.save_buffer must be latest | all | none, got '{self.save_buffer}'")
        if self.grad not in ("auto", "manual", "autograd"):
            raise ConfigError(f"{where}.grad must be auto | manual | autograd, got '{self.grad}'")
        if self.actor_q not in ("min", "mean"):
            raise ConfigError(f"{where}.actor_q must be min | mean, got '{self.actor_q}'")
        if self.min_qs is not None and self.min_qs > self.n_critics:
            raise ConfigError(f"{where}.min_qs must be null or in [1, n_critics = {self.n_critics}], got "
                              f"{self.min_qs}")
        if self.bc_coef > 0 and not self.demos:
            raise ConfigError(f"{where}.bc_coef > 0 needs {where}.demos (the demonstrations it imitates), got "
                              f"{self.bc_coef} with demos '{self.demos}'")
        if self.gradient_steps == 0:
            raise ConfigError(f"{where}.gradient_steps must be >= 1 or -1 (as many as env steps collected), got 0")
        self.alpha_init()
        self.target(1)

    def alpha_init(self) -> tuple[float, bool]:
        """(initial alpha, whether it is tuned) from ent_coef."""
        text = str(self.ent_coef)
        tuned = text.startswith("auto")
        value = text[5:] if text.startswith("auto_") else ("1.0" if tuned else text)
        try:
            alpha = float(value)
        except ValueError:
            raise ConfigError(f"sac.ent_coef must be a number, 'auto' or 'auto_X', got '{self.ent_coef}'") from None
        if not alpha > 0:
            raise ConfigError(f"sac.ent_coef must be > 0, got '{self.ent_coef}'")
        return alpha, tuned

    def target(self, action_dims: int) -> float:
        """The target entropy for actions of `action_dims` numbers."""
        if str(self.target_entropy) == "auto":
            return -float(action_dims)
        try:
            return float(self.target_entropy)
        except ValueError:
            raise ConfigError(f"sac.target_entropy must be 'auto' or a number, got '{self.target_entropy}'") from None


@dataclass
class EmbodiedEvalConfig:
    episodes: int = opt(10, "deterministic evaluation episodes on the final checkpoint (0: none)", within="[0, inf)")
    num_envs: int = opt(8, "envs stepped together during evaluation", within="[1, inf)")
    seed: int = opt(10_000, "reset seed of the evaluation episodes", within="[0, 2147483647]")


@dataclass
class EmbodiedConfig:
    FLOW: ClassVar[str] = "embodied"
    run: EmbodiedRunConfig = section(EmbodiedRunConfig, "run name, seed, iterations, checkpoints")
    cluster: EmbodiedClusterConfig = section(EmbodiedClusterConfig, "Ray cluster and placement of env, rollout, actor")
    env: EnvConfig = section(EnvConfig, "gymnasium envs, normalization, pipeline stages")
    policy: PolicyConfig = section(PolicyConfig, "the actor-critic")
    vla: VLAConfig = section(VLAConfig, "the vision-language-action policy (policy.kind=vla)")
    rollout: EmbodiedRolloutConfig = section(EmbodiedRolloutConfig, "rollout length")
    algorithm: EmbodiedAlgorithmConfig = section(EmbodiedAlgorithmConfig, "advantages and losses")
    actor: EmbodiedActorConfig = section(EmbodiedActorConfig, "optimization")
    sac: SACConfig = section(SACConfig, "off-policy SAC (algorithm.name=sac): replay buffer, update schedule")
    eval: EmbodiedEvalConfig = section(EmbodiedEvalConfig, "evaluation after training")

    def placement(self):
        """The placement a plan is made from: `cluster.placement` as given (the three components are always named)."""
        return self.cluster.placement

    @property
    def steps_per_rollout(self) -> int:
        """Policy steps per env in one iteration's rollout: sac.train_freq off-policy, rollout.steps on-policy."""
        return self.sac.train_freq if self.algorithm.name == "sac" else self.rollout.steps

    def sac_grad_blockers(self) -> list[str]:
        """Why sac.grad=manual cannot take this run's networks (none: a ReLU MLP actor and critics, each with a
        hidden layer)."""
        return [text for bad, text in (
            (self.policy.activation != "relu", f"policy.activation is '{self.policy.activation}', not relu"),
            (not self.policy.hidden, "policy.hidden is empty")) if bad]

    def validate(self, where: str) -> None:
        if self.policy.kind == "cnn" and not self.env.pixels:
            raise ConfigError("policy.kind=cnn needs env.pixels=true (frames as observations)")
        from m2flow.embodied.envs.maniskill import TASKS, is_maniskill  # the env package: only when validated

        maniskill = is_maniskill(self.env.id)
        if self.policy.kind == "vla" and not (self.env.pixels and maniskill):
            raise ConfigError(f"policy.kind=vla reads ManiSkill3's pixel observations: it needs env.pixels=true and "
                              f"env.id among {', '.join(TASKS)} (got env.pixels={self.env.pixels}, "
                              f"env.id={self.env.id})")
        if self.env.pixels and maniskill:
            if self.policy.kind != "vla":
                raise ConfigError(f"env.pixels=true on ManiSkill3 gives the frame with the proprioception and the "
                                  f"instruction, which policy.kind=vla reads (got policy.kind={self.policy.kind})")
            if self.env.norm_obs or self.env.instruct:
                raise ConfigError("env.pixels=true on ManiSkill3 takes env.norm_obs=false and env.instruct=false "
                                  "(the frame is not normalized; the instruction is always in the observation)")
            if self.env.image_size % self.vla.patch:
                raise ConfigError(f"env.image_size={self.env.image_size} must be a multiple of "
                                  f"vla.patch={self.vla.patch}")
        if self.env.wrist_camera and not (self.env.pixels and maniskill):
            raise ConfigError(f"env.wrist_camera=true adds a hand camera's frames to ManiSkill3's pixel observations: "
                              f"it needs env.pixels=true and a ManiSkill3 env.id (got env.pixels={self.env.pixels}, "
                              f"env.id={self.env.id})")
        if (self.policy.kind == "instruct") != self.env.instruct:
            raise ConfigError("policy.kind=instruct and env.instruct=true go together (the policy reads the "
                              "instruction the observations carry)")
        if self.actor.bc_coef > 0 and self.env.norm_obs:
            raise ConfigError("actor.bc_coef with env.norm_obs=true is not supported yet (the demonstrations' "
                              "observations are not normalized); set env.norm_obs=false")
        if self.algorithm.name == "sac":
            if self.policy.kind != "mlp" or self.env.chunk != 1 or self.env.seed_groups != 1:
                raise ConfigError("algorithm.name=sac needs policy.kind=mlp, env.chunk=1 and env.seed_groups=1 "
                                  f"(got {self.policy.kind}, {self.env.chunk}, {self.env.seed_groups})")
            if self.actor.bc_coef > 0:
                raise ConfigError("actor.bc_coef is PPO's behaviour-cloning term; algorithm.name=sac does not use it")
            if self.sac.actor_process and (not self.sac.parallel_update or self.sac.grad == "autograd"
                                           or self.sac_grad_blockers()):
                raise ConfigError("sac.actor_process runs the actor's side of sac.parallel_update's step under "
                                  "sac.grad=manual in its own process: it needs sac.parallel_update=true and the "
                                  f"manual gradients (got parallel_update={self.sac.parallel_update}, "
                                  f"grad={self.sac.grad}{'; ' if self.sac_grad_blockers() else ''}"
                                  f"{'; '.join(self.sac_grad_blockers())})")
            if self.sac.grad == "manual" and self.sac_grad_blockers():
                raise ConfigError(f"sac.grad=manual writes out the gradients of ReLU MLPs only, but "
                                  f"{'; '.join(self.sac_grad_blockers())}: use sac.grad=auto or autograd")
        if self.actor.critic_lr is not None and self.algorithm.name != "ppo":
            raise ConfigError(f"actor.critic_lr is the learning rate of PPO's value function; algorithm.name="
                              f"{self.algorithm.name} trains none with the actor's optimizer (leave it null)")
        if self.algorithm.name == "grpo" and self.env.seed_groups < 2:
            raise ConfigError("algorithm.name=grpo needs env.seed_groups >= 2 (advantages are relative within a group)")
