"""The reasoning flow's config: its sections (model, data, rollout, reward, algorithm, actor, critic, agent, sft)
and `ReasoningConfig`, each field with its default, range and a line of help (`m2flow train --help-config`).
The machinery that loads and checks them is `m2flow/config.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from m2flow.config import (CHECK_SYNC_HELP, ClusterConfig, RunConfig, checks_sync, max_weight_growth_opt,
                           nonfinite_opt, opt, section, validate_check_sync, validate_nonfinite)
from m2flow.errors import ConfigError, UserError
from m2flow.runtime.placement import place_beside

@dataclass
class ReasoningClusterConfig(ClusterConfig):
    placement: Any = opt("rollout,reward,inference,actor: all:0",
                         "component -> devices[:ranks]: 'rollout,reward,inference,actor: all:0' (collocated: one "
                         "process over every device, the stages take turns), 'rollout: 0; reward,inference,actor: 1' "
                         "(pipelined), 'auto' (profile, then the fastest predicted plan)")
    COMPONENTS: ClassVar[tuple[str, ...]] = ("rollout", "reward", "inference", "actor", "critic", "tool")


@dataclass
class LoRAConfig:
    r: int = opt(0, "LoRA rank (PEFT adapters; the actor trains only them); 0: full fine-tuning", within="[0, inf)")
    alpha: float = opt(16.0, "LoRA alpha: the adapters' update is scaled by alpha / r", within="(0, inf)")
    dropout: float = opt(0.0, "dropout on the adapters' input while training", within="[0, 1)")
    target_modules: list = opt(["all-linear"], "modules to adapt, e.g. [q_proj, v_proj]; [all-linear]: every linear "
                                               "layer but the output head")
    sync: str = opt("adapters", "what a weight sync sends: adapters (each receiver applies them to its frozen base) "
                                "| merged (the full merged weights)")

    def validate(self, where: str) -> None:
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ConfigError(f"{where}.target_modules must be a non-empty list of module names (e.g. [q_proj, "
                              f"v_proj], or [all-linear]), got {self.target_modules!r}")
        if self.sync not in ("adapters", "merged"):
            raise ConfigError(f"{where}.sync must be adapters | merged, got '{self.sync}'")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


@dataclass
class ModelConfig:
    path: str = opt("", "local HF model directory (Qwen2/Llama style); empty: the flow builds a tiny model into the run dir")
    dtype: str = opt("float32", "parameter dtype: float32 | bfloat16 (the rollout's and inference's weights; the "
                                "actor's and critic's compute, see mixed_precision)")
    mixed_precision: bool = opt(True, "with dtype=bfloat16: the actor and critic keep float32 master weights and "
                                      "optimizer state and compute in bf16 (autocast), and weight syncs send the "
                                      "weights rounded to bf16; false: they train bf16 weights directly")
    tiny_hidden: int = opt(64, "hidden size of the tiny model built when path is empty", within="[1, inf)")
    tiny_layers: int = opt(2, "layers of the tiny model built when path is empty", within="[1, inf)")
    tiny_arch: str = opt("qwen2", "architecture of the tiny model built when path is empty: qwen2 | llama | qwen2_moe "
                                  "(4 experts, 2 per token, and a shared expert)")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters for the actor (model.lora.r > 0)")

    def validate(self, where: str) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{where}.dtype must be 'float32' or 'bfloat16', got '{self.dtype}'")
        if self.tiny_hidden % 4:
            raise ConfigError(f"{where}.tiny_hidden must be a multiple of 4 (the tiny model's attention heads), got "
                              f"{self.tiny_hidden}")
        if self.tiny_arch not in ("qwen2", "llama", "qwen2_moe"):
            raise ConfigError(f"{where}.tiny_arch must be qwen2 | llama | qwen2_moe, got '{self.tiny_arch}'")


@dataclass
class DataConfig:
    task: str = opt("arithmetic", "arithmetic | countdown (built-in, generated from the seed) | file")
    path: str = opt("", "JSONL or Parquet file when task=file")
    layout: str = opt("plain", "the file's layout: plain (prompt, answer columns) | gsm8k (question; the answer "
                               "after the solution's last '####') | math (problem; the answer in the solution's last "
                               "\\boxed{}); with gsm8k and math the full solution is kept for SFT")
    prompt_key: str = opt("", "prompt column of the file (empty: the layout's: prompt | question | problem)")
    answer_key: str = opt("", "answer column of the file (empty: the layout's: answer | answer | solution)")
    digits: int = opt(2, "operand digits of the arithmetic task", within="[1, inf)")
    digits_b: int = opt(0, "digits of the arithmetic task's second operand (0: data.digits); 3 and 2 give 123*45",
                        within="[0, inf)")
    ops: str = opt("+", "operators of the arithmetic task, e.g. '+-'")
    answer_width: int = opt(0, "arithmetic: answers shorter than this many digits are written with leading zeros "
                               "(3: 37+45=082), so that each answer digit has one place; 0: as they are",
                            within="[0, inf)")
    train_size: int = opt(5000, "synthetic training problems", within="[1, inf)")
    eval_size: int = opt(200, "held-out problems for evaluation", within="[1, inf)")
    max_prompt_len: int = opt(64, "prompts longer than this (in tokens) are dropped, with a count", within="[1, inf)")

    def validate(self, where: str) -> None:
        if self.task not in ("arithmetic", "countdown", "file"):
            raise ConfigError(f"{where}.task must be arithmetic | countdown | file, got '{self.task}'")
        if self.layout not in ("plain", "gsm8k", "math"):
            raise ConfigError(f"{where}.layout must be plain | gsm8k | math, got '{self.layout}'")
        if self.task == "file" and not self.path:
            raise ConfigError(f"{where}.path is required when {where}.task=file")


@dataclass
class RolloutConfig:
    engine: str = opt("native", "generation engine: native (batched KV-cache engine) | hf (transformers generate)")
    prompts_per_step: int = opt(32, "prompts per training step", within="[1, inf)")
    n: int = opt(8, "samples per prompt (the GRPO group size)", within="[1, inf)")
    max_new_tokens: int = opt(8, "longest response, in tokens", within="[1, inf)")
    temperature: float = opt(1.0, "sampling temperature", within="(0, inf)")
    top_p: float = opt(1.0, "nucleus sampling threshold", within="(0, 1]")
    top_k: int = opt(0, "top-k sampling (0: off)", within="[0, inf)")
    max_slots: int = opt(256, "native engine: concurrent sequences (continuous batching slots)", within="[1, inf)")
    check_weight_sync: bool | str = opt("first", CHECK_SYNC_HELP)
    cohost: bool = opt(True, "collocated plans (every component on the same devices, rank by rank): build reward, "
                             "inference and actor inside the rollout's processes, one process per rank taking the "
                             "stages in turn, instead of four processes taking turns on the device")

    def validate(self, where: str) -> None:
        if self.engine not in ("native", "hf"):
            raise ConfigError(f"{where}.engine must be native | hf, got '{self.engine}'")
        validate_check_sync(self, where)

    checks_sync = checks_sync


@dataclass
class RewardConfig:
    fn: str = opt("auto", "exact_match | math_verify | countdown | pkg.mod:fn | auto (by task)")
    timeout_s: float = opt(5.0, "seconds per reward call; a call past it scores 0 and is counted", within="(0, inf)")
    max_error_fraction: float = opt(0.5, "stop the run when more than this share of a step's samples could not be "
                                         "scored (the function raised, returned no finite number, or timed out), "
                                         "naming the first error; 1: never stop", within="[0, 1]")


@dataclass
class AlgorithmConfig:
    name: str = opt("grpo", "grpo (group-relative advantages, no critic) | ppo (a critic component values every "
                            "response token; token-level GAE; set advantage=gae)")
    advantage: str = opt("grpo", "advantage estimator: grpo | dr_grpo | rloo | reinforce_pp (REINFORCE++ with a "
                                 "group baseline: the group-centred score whitened over the step's tokens) | gae "
                                 "(name=ppo: the critic's token-level GAE, whitened over the step's tokens)")
    gamma: float = opt(1.0, "name=ppo: discount per response token in GAE", within="[0, 1]")
    lam: float = opt(1.0, "name=ppo: GAE lambda", within="[0, 1]")
    clip_low: float = opt(0.2, "PPO clip epsilon below 1", within="[0, 1)")
    clip_high: float = opt(0.28, "PPO clip epsilon above 1 (clip-higher)", within="[0, inf)")
    dual_clip: float | None = opt(None, "dual-clip constant c (> 1), None: off", within="(1, inf)")
    policy_loss: str = opt("ppo", "ppo (a ratio per token) | gspo (GSPO: one ratio per response, the exp of the mean "
                                  "token log-ratio; pair it with the paper's clip_low=3e-4 clip_high=4e-4 "
                                  "loss_agg=seq-mean-token-mean)")
    loss_agg: str = opt("token-mean", "token-mean | seq-mean-token-sum | seq-mean-token-mean")
    kl_coef: float = opt(0.0, "KL penalty against the reference (initial) policy, in the loss", within="[0, inf)")
    kl_estimator: str = opt("k3", "k1 | k2 | k3")
    entropy_coef: float = opt(0.0, "entropy bonus", within="[0, inf)")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal")
    refill_rounds: int = opt(0, "DAPO dynamic sampling with refill: up to N more rounds of rollout.prompts_per_step "
                                "prompts while fewer groups with unequal rewards than prompts_per_step were kept; the "
                                "step trains on at most prompts_per_step groups (0: train on the groups kept)",
                             within="[0, inf)")
    overlong_buffer: int = opt(0, "DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens - "
                                  "N tokens loses up to overlong_penalty of reward, linearly to the limit (0: off)",
                               within="[0, inf)")
    overlong_penalty: float = opt(1.0, "the reward a response at the length limit loses (overlong_buffer > 0)",
                                  within="[0, inf)")
    overlong_filter: bool = opt(False, "DAPO's overlong filtering: responses cut at rollout.max_new_tokens (no eos) "
                                       "get no gradient")
    old_logprobs: str = opt("auto", "old-policy logprobs of the PPO ratio: recompute (an inference forward pass) | "
                                    "rollout (the engine's behaviour logprobs) | auto (rollout when each sample is "
                                    "trained on once, 1 epoch and 1 mini-batch, so the ratio is 1; else recompute)")
    max_staleness: int = opt(0, "bounded off-policy: the rollout of the next N steps runs while the actor trains, on "
                                "weights at most N versions old (0: on-policy, rollout and training take turns)",
                             within="[0, inf)")
    behaviour_weight_cap: float = opt(2.0, "max_staleness >= 1: cap on the behaviour importance weight "
                                           "pi_prox / pi_behaviour of each token (truncated importance sampling)",
                                      within="[1, inf)")


@dataclass
class ActorConfig:
    lr: float = opt(1e-4, "the AdamW learning rate of the actor (docs/limitations.md: the tiny models want 2e-4 or "
                          "less)", within="(0, inf)")
    lr_schedule: str = opt("constant", "constant | cosine")
    warmup_steps: int = opt(0, "linear warm-up steps", within="[0, inf)")
    weight_decay: float = opt(0.0, "AdamW weight decay", within="[0, inf)")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas [beta1, beta2]", within="[0, 1)")
    eps: float = opt(1e-8, "AdamW epsilon (added to the root of the second moment)", within="(0, inf)")
    grad_clip: float = opt(1.0, "max gradient norm", within="(0, inf)")
    mini_batches: int = opt(1, "optimizer steps per training step (the batch is split into this many)",
                            within="[1, inf)")
    epochs: int = opt(1, "passes over the batch per training step", within="[1, inf)")
    micro_batch: int = opt(32, "samples per message between stages when pipelined (the streaming granularity); "
                                "also samples per forward/backward when micro_batch_tokens is 0", within="[1, inf)")
    micro_batch_tokens: int = opt(8192, "padded tokens per forward/backward: streamed micro-batches are merged "
                                        "until they hold at least this many (or the step's data has all arrived), "
                                        "then cut into equal parts of at most this many (veRL's dynamic batch size); "
                                        "0: micro_batch samples per part, each message on its own", within="[0, inf)")
    share_prompts: bool = opt(True, "forward each distinct prompt once per pass and every response against its "
                                    "cached keys and values (the n responses of a group share their prompt): fewer "
                                    "tokens through the model in training and logprob passes, the same logprobs to "
                                    "float rounding; backend torch only (fsdp2 ranks run the plain pass)")
    backend: str = opt("torch", "torch: one rank | fsdp2: sharded over the actor's ranks (FSDP2, gloo/NCCL)")
    nonfinite: str = nonfinite_opt()
    max_weight_growth: float = max_weight_growth_opt()

    def validate(self, where: str) -> None:
        if self.backend not in ("torch", "fsdp2"):
            raise ConfigError(f"{where}.backend must be torch | fsdp2, got '{self.backend}'")
        if len(self.betas) != 2:
            raise ConfigError(f"{where}.betas must be two numbers [beta1, beta2], got {self.betas}")
        validate_nonfinite(self, where)


@dataclass
class CriticConfig:
    lr: float = opt(1e-5, "algorithm.name=ppo: the critic's AdamW learning rate (betas, eps: actor's)",
                    within="(0, inf)")
    weight_decay: float = opt(0.0, "the critic's AdamW weight decay", within="[0, inf)")
    value_clip: float = opt(0.5, "PPO value clipping: a new value counts at most this far from the one the "
                                 "advantages were made of", within="(0, inf)")
    grad_clip: float = opt(1.0, "the critic's max gradient norm", within="(0, inf)")
    warmup_steps: int = opt(0, "steps at the start in which only the critic learns (the actor's weights stay)",
                            within="[0, inf)")


@dataclass
class AgentConfig:
    tools: dict = opt({}, "multi-turn rollouts with tools: tag name -> calc | python | pkg.mod:fn, e.g. {calc: calc} "
                          "(the model writes <calc>12*34</calc>, the answer comes back as <result>408</result>); "
                          "empty: one completion per prompt")
    max_turns: int = opt(2, "tool calls answered per response; later calls get no answer", within="[1, inf)")
    timeout_s: float = opt(5.0, "seconds per python or user tool call; past it the model gets an error string",
                           within="(0, inf)")
    memory_mb: int = opt(256, "address space of a python tool call, in MB", within="[16, inf)")

    def validate(self, where: str) -> None:
        if not isinstance(self.tools, dict):
            raise ConfigError(f"{where}.tools must map tag names to tools, e.g. {{calc: calc}}, got {self.tools!r}")


@dataclass
class SFTConfig:
    steps: int = opt(0, "supervised warm-start steps on the task's reference answers before RL (0: none)",
                     within="[0, inf)")
    batch_size: int = opt(64, "SFT batch size", within="[1, inf)")
    lr: float = opt(3e-3, "SFT learning rate (cosine decay over sft.steps)", within="(0, inf)")
    target_accuracy: float = opt(0.0, "stop the warm start early once its greedy exact match on sft.val_size "
                                      "held-back training problems (checked every sft.val_every steps) reaches "
                                      "this; 0: run all sft.steps", within="[0, 1]")
    val_size: int = opt(256, "sft.target_accuracy: training-split problems held back from the warm start to "
                             "measure it on (never trained on by the warm start nor, for synthetic tasks, by RL)",
                        within="[1, inf)")
    val_every: int = opt(25, "sft.target_accuracy: steps between two measurements on the held-back problems",
                         within="[1, inf)")
    tool_fraction: float = opt(1.0, "with a calc tool (agent.tools): the share of the warm start's references that "
                                    "call it; the others answer directly (a seeded draw per problem)", within="[0, 1]")


def refill_reward_ranks(cfg, ranks: int) -> None:
    """DAPO's refill counts a step's kept groups in one place: the reward stage must have one rank (checked against
    the placement before Ray starts, and against an auto plan by the flow)."""
    if cfg.algorithm.refill_rounds and ranks > 1:
        raise UserError(f"algorithm.refill_rounds: one reward rank counts the step's groups, but the placement "
                        f"gives the reward {ranks} ranks; place reward on one device (e.g. "
                        f"'rollout,reward,inference,actor: 0-1:0'), or set algorithm.refill_rounds=0")


def with_critic(placement):
    """A reasoning placement with the critic placed: as given where it names `critic`, else beside the actor."""
    return place_beside(placement, "critic", "actor")


def reasoning_components(cfg) -> list[str]:
    """The reasoning flow's components, in data order: rollout, reward, inference, actor; the critic (before the
    actor) with `algorithm.name=ppo`; the tool component (answering the rollout's tool calls) with `agent.tools`."""
    names = ["rollout", "reward", "inference", *(["critic"] if cfg.algorithm.name == "ppo" else []), "actor"]
    return names + (["tool"] if cfg.agent.tools else [])


@dataclass
class ReasoningConfig:
    FLOW: ClassVar[str] = "reasoning"
    run: RunConfig = section(RunConfig, "run name, seed, steps, checkpoints")
    cluster: ReasoningClusterConfig = section(ReasoningClusterConfig, "Ray cluster and placement")
    model: ModelConfig = section(ModelConfig, "the policy model")
    data: DataConfig = section(DataConfig, "prompts and answers")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    reward: RewardConfig = section(RewardConfig, "scoring")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and losses")
    actor: ActorConfig = section(ActorConfig, "policy training (epochs and mini-batches: the critic's too)")
    critic: CriticConfig = section(CriticConfig, "algorithm.name=ppo: the value model")
    agent: AgentConfig = section(AgentConfig, "multi-turn rollouts with tool calls")
    sft: SFTConfig = section(SFTConfig, "supervised warm start")

    def validate(self, where: str) -> None:
        alg = self.algorithm
        if alg.name not in ("grpo", "ppo"):
            raise ConfigError(f"algorithm.name: must be grpo | ppo for the reasoning flow, got '{alg.name}'")
        if alg.name == "ppo" and alg.advantage != "gae":
            raise ConfigError(f"algorithm.name=ppo learns from the critic's token-level GAE: set "
                              f"algorithm.advantage=gae (got '{alg.advantage}')")
        if alg.advantage not in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae") or (
                alg.advantage == "gae" and alg.name != "ppo"):
            raise ConfigError(f"algorithm.advantage must be grpo | dr_grpo | rloo | reinforce_pp (gae with "
                              f"name=ppo) for the reasoning flow, got '{alg.advantage}'")
        if self.algorithm.name == "grpo" and self.rollout.n < 2:
            raise ConfigError("rollout.n must be >= 2 for grpo (advantages are relative within a group)")
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer must be in [0, rollout.max_new_tokens = "
                              f"{self.rollout.max_new_tokens}], got {self.algorithm.overlong_buffer}")
        if self.algorithm.policy_loss not in ("ppo", "gspo"):
            raise ConfigError(f"algorithm.policy_loss must be ppo | gspo, got '{self.algorithm.policy_loss}'")
        if self.algorithm.old_logprobs not in ("auto", "recompute", "rollout"):
            raise ConfigError(f"algorithm.old_logprobs must be auto | recompute | rollout, "
                              f"got '{self.algorithm.old_logprobs}'")
        if alg.refill_rounds and not alg.dynamic_sampling:
            raise ConfigError("algorithm.refill_rounds refills the groups that dynamic sampling drops: set "
                              "algorithm.dynamic_sampling=true, or refill_rounds=0")
        if alg.refill_rounds and alg.max_staleness:
            raise ConfigError(f"algorithm.refill_rounds needs on-policy rollouts (max_staleness=0), got "
                              f"max_staleness={alg.max_staleness}: a step's refill rounds run before it trains")
        if self.agent.tools and self.rollout.engine != "native":
            raise ConfigError("agent.tools: multi-turn rollouts with tools need rollout.engine=native, "
                              f"got '{self.rollout.engine}'")
        if alg.max_staleness and alg.old_logprobs == "recompute":
            raise ConfigError("algorithm.old_logprobs=recompute needs on-policy rollouts (max_staleness=0): with "
                              f"max_staleness={alg.max_staleness} the actor computes the proximal logprobs itself "
                              "(decoupled PPO); use auto, or rollout for a plain PPO ratio against the behaviour policy")

    def placement(self):
        """The placement a plan is made from (validation leaves `cluster.placement` as given): with PPO the critic
        beside the actor and with `agent.tools` the tool component beside the reward, where it names neither;
        `auto` as is."""
        spec = self.cluster.placement
        if spec == "auto":
            return spec
        if self.algorithm.name == "ppo":
            spec = with_critic(spec)
        return place_beside(spec, "tool", "reward") if self.agent.tools else spec

    def recompute_old_logprobs(self) -> bool:
        """Whether the inference stage runs a forward pass for the old-policy logprobs. Without it the ratio uses the
        rollout engine's behaviour logprobs (temperature-scaled, untruncated: equal to the trainer's to ~1e-5). `auto`
        skips the pass when every sample is trained on once by the policy that generated it (1 epoch, 1 mini-batch,
        weights synced after every step), where the ratio is 1 anyway, as TRL does. Off-policy (`max_staleness` >= 1)
        the actor computes the proximal logprobs itself, so the inference stage never does."""
        if self.algorithm.max_staleness:
            return False
        if self.algorithm.old_logprobs == "auto":
            return self.actor.epochs > 1 or self.actor.mini_batches > 1
        return self.algorithm.old_logprobs == "recompute"
