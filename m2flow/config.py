"""Typed dataclass configs: YAML presets, dotted `a.b=c` overrides, validation with clear errors.

Each config field carries a one-line description (`opt(default, help)`); defaults run on a laptop.
This module only parses and checks configs; it never starts anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from m2flow.errors import ConfigError, MissingFileError, UserError  # noqa: F401 - re-exported: m2flow.config's errors

CONFIG_DIR = Path(str(importlib.resources.files("m2flow") / "configs"))  # the presets: package data (configs/ links here)


class Interval:
    """A numeric field's range in interval notation, e.g. '[0, 1)', '(0, inf)', '[1, inf)': a value must lie in it,
    and so be finite (NaN lies in none). A list field's range holds for each of its numbers."""

    def __init__(self, text: str):
        lo, comma, hi = text[1:-1].partition(",")
        if text[:1] not in "[(" or text[-1:] not in "])" or not comma:
            raise ValueError(f"an interval looks like '[0, 1)' or '(0, inf)', got {text!r}")
        self.text, self.lo, self.hi = text, float(lo), float(hi)
        self.lo_closed, self.hi_closed = text[0] == "[", text[-1] == "]"

    def __contains__(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        above = v >= self.lo if self.lo_closed else v > self.lo
        below = v <= self.hi if self.hi_closed else v < self.hi
        return above and below

    def __str__(self) -> str:
        """'>= 0', '> 0', 'in [0, 1)', or 'a finite number': how an error message and --help-config say it."""
        lo, hi = math.isinf(self.lo), math.isinf(self.hi)
        if lo and hi:
            return "a finite number"
        if hi:
            return f"{'>=' if self.lo_closed else '>'} {self.lo:g}"
        if lo:
            return f"{'<=' if self.hi_closed else '<'} {self.hi:g}"
        return f"in {self.text}"

    def check(self, name: str, value: Any) -> None:
        """Raise ConfigError naming `name` if a number in `value` (a number, a list of them, or None) lies outside."""
        numbers = value if isinstance(value, (list, tuple)) else [value]
        for v in numbers:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in self:
                each = " (each of them)" if numbers is value else ""
                raise ConfigError(f"{name} must be {self}{each}, got {value}")


FINITE = Interval("(-inf, inf)")


def opt(default: Any, help: str, *, within: str | None = None, factory: bool = False) -> Any:
    """A dataclass field with a one-line description (shown by `m2flow train --help-config`); a numeric field
    declares the interval its values must lie in (`within='[0, 1)'`), which validation enforces."""
    meta = {"help": help, **({"within": Interval(within)} if within else {})}
    if factory:
        return field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A nested config section."""
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class ClusterConfig:
    address: str | None = opt(None, "Ray address to join (e.g. 'auto' or 'ray://head:10001'); None starts a local Ray instance")
    cpu_devices: int | list[int] | None = opt(None, "CPU devices per node when there are no GPUs: a count (equal "
                                              "slices of the cores), or each device's cores, e.g. [1, 3] (a "
                                              "1-core device 0 and a 3-core device 1); default: one per core",
                                              within="[1, inf)")
    placement: Any = opt("rollout,reward,inference,actor: all:0",
                         "component -> devices[:ranks]: 'rollout,reward,inference,actor: all:0' (collocated: one "
                         "process over every device, the stages take turns), 'rollout: 0; reward,inference,actor: 1' "
                         "(pipelined), 'auto' (profile, then the fastest predicted plan)")
    reuse_processes: bool = opt(True, "keep the worker processes of a finished run (or profile) for the next one on "
                                      "this cluster: no new Python, no re-import of torch/transformers")
    offload: bool | str = opt(False, "context switching of components that share a device: true (each moves its "
                                     "weights and optimizer state off the device when its turn ends, back when its "
                                     "next begins: disk on CPU devices) | false | auto (when the state of a device's "
                                     "components exceeds cluster.device_memory_gb, or the auto plan offloads)")
    device_memory_gb: float = opt(0.0, "memory of one device, for offload=auto (0: unknown, offload only where the "
                                       "auto plan does)", within="[0, inf)")
    foreground: str | list[str] | None = opt(None, "components whose processes keep their CPU priority while every "
                                                   "other process of the run on the driver's node (the other workers, "
                                                   "the driver, the Ray daemons m2flow started) runs at nice 19, e.g. "
                                                   "'actor' or [env, actor]; None: all alike")
    COMPONENTS: ClassVar[tuple[str, ...]] = ("rollout", "reward", "inference", "actor", "critic", "tool")

    def foreground_components(self) -> list[str]:
        """`foreground` as a list of component names ([] when off)."""
        if self.foreground is None:
            return []
        names = self.foreground.split(",") if isinstance(self.foreground, str) else self.foreground
        return [n.strip() for n in names if n.strip()]

    def validate(self, where: str) -> None:
        unknown = [n for n in self.foreground_components() if n not in self.COMPONENTS]
        if unknown:
            raise ConfigError(f"{where}.foreground names {', '.join(unknown)}: expected components of this flow "
                              f"({', '.join(self.COMPONENTS)})")
        if self.offload not in (True, False, "auto"):
            raise ConfigError(f"{where}.offload must be true | false | auto, got {self.offload!r}")
        if self.cpu_devices == []:
            raise ConfigError(f"{where}.cpu_devices must be a count >= 1 or a list of each device's cores (e.g. "
                              f"[1, 3]), got []")
        if not isinstance(self.placement, (str, dict)):
            raise ConfigError(f"{where}.placement must be a string or a mapping, got {type(self.placement).__name__}")


@dataclass
class RunConfig:
    name: str = opt("run", "run name, a plain name (no /): outputs go to <dir>/<name>/")
    dir: str = opt("runs", "parent folder of run directories")
    seed: int = opt(0, "global seed (data order, sampling, init)", within="[0, 2147483647]")
    steps: int = opt(20, "training steps", within="[0, inf)")
    save_every: int = opt(0, "write a checkpoint every N steps (0: only at the end)", within="[0, inf)")
    eval_every: int = opt(0, "evaluate on the held-out split every N steps (reasoning: greedy pass@1 from step 0 on, "
                                "eval/pass@1; embodied: eval.episodes, eval/return_mean); 0: off", within="[0, inf)")
    resume: bool = opt(False, "continue from the newest checkpoint in the run directory")
    overwrite: bool = opt(False, "start over in a run directory that holds a run: remove everything in it first "
                                 "(metrics, checkpoints, plots, warm-start model, profile); without it such a "
                                 "directory is refused unless run.resume")
    trace: bool = opt(True, "write trace.json and plots/timeline.png")
    progress: bool = opt(True, "show a progress bar")

    def validate(self, where: str) -> None:
        if not self.name or self.name in (".", "..") or any(c in self.name for c in "/\\\0"):
            raise ConfigError(f"{where}.name must be a plain name (no '/' or '\\', not '.' or '..'): the run is "
                              f"written to {where}.dir/{where}.name, got {self.name!r}")
        if self.resume and self.overwrite:
            raise ConfigError(f"{where}.resume and {where}.overwrite are both true: continue the run (resume) or "
                              f"remove it and start over (overwrite), not both")

    @property
    def path(self) -> Path:
        return Path(self.dir) / self.name


# ---------------------------------------------------------------------------------------------- loading


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Check (and gently coerce: int -> float) a YAML value against a type hint."""
    if hint is Any:
        return True, value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if hint is type(None):
        return value is None, value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if args:
            out = []
            for item in value:
                ok, v = _type_ok(item, args[0])
                if not ok:
                    return False, value
                out.append(v)
            value = out
        return True, origin(value)
    if origin is dict:
        return isinstance(value, dict), value
    if hint is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 leaves '2e-3' and 'nan' as text inside lists
            try:
                return True, float(value)
            except ValueError:
                pass
        return False, value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def from_dict(cls: type, data: dict | None, where: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking every key and type; `where` is the dotted prefix."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config field '{name}'{hint}; valid fields here: {', '.join(fields)}")
        hint_t = hints[key]
        if dataclasses.is_dataclass(hint_t):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"config field '{name}' is a section; expected a mapping, got {value!r}")
            kwargs[key] = from_dict(hint_t, value, name)
            continue
        ok, coerced = _type_ok(value, hint_t)
        if not ok:
            raise ConfigError(f"config field '{name}' expects {_type_name(hint_t)}, got {value!r}")
        kwargs[key] = coerced
    obj = cls(**kwargs)
    validate(obj, where)
    return obj


def validate(obj: Any, where: str = "") -> None:
    """Check every number against its field's declared interval (a float without one must be finite), then run
    `validate(where)` on every section that defines it."""
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            validate(value, name)
        else:
            f.metadata.get("within", FINITE).check(name, value)
    if hasattr(obj, "validate"):
        obj.validate(where or "config")


def parse_overrides(overrides: list[str]) -> dict:
    """['a.b=3', 'c=x'] -> {'a': {'b': 3}, 'c': 'x'}; values are parsed as YAML scalars."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        value = _scalar(raw)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
        node[parts[-1]] = Replaces(value) if isinstance(value, dict) else value
    return out


class Replaces(dict):
    """A mapping written as an override's value (`agent.tools={}`): it replaces the mapping underneath, where the
    mappings that dotted keys build merge into it."""


def _scalar(raw: str) -> Any:
    """A YAML scalar, plus the numbers YAML 1.1 leaves as strings ('2e-3'); text YAML can't parse
    (e.g. a placement 'rollout: 0; actor: 1') stays a string."""
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return raw.strip()
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def merge(base: dict, extra: dict) -> dict:
    """Recursive dict merge; `extra` wins (a `Replaces` mapping replaces, whole)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Replaces):
            out[k] = merge({}, v)
        elif isinstance(v, dict):  # plain dicts all the way down
            out[k] = merge(out[k] if isinstance(out.get(k), dict) else {}, v)
        else:
            out[k] = v
    return out


def resolve_path(config: str | Path) -> Path:
    """A YAML path, or a preset name from configs/ (e.g. 'grpo_arithmetic')."""
    p = Path(config)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"config file '{p}' does not exist")
        return p
    preset = CONFIG_DIR / f"{config}.yaml"
    if preset.exists():
        return preset
    names = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"no config file or preset named '{config}'; presets: {', '.join(names) or '(none)'}")


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        where = " ".join(str(e).split())  # one line: the parser's message and its line/column
        raise ConfigError(f"config file '{path}' is not valid YAML: {where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    return data


def load(cls: type, config: str | Path | dict | None = None, overrides: list[str] | None = None) -> Any:
    """Resolve a config: a YAML file or preset (or a dict), then dotted overrides, then validation."""
    data = {} if config is None else config if isinstance(config, dict) else read_yaml(resolve_path(config))
    data = merge(data, parse_overrides(overrides or []))
    data.pop("flow", None)  # which flow a YAML is for; chosen by the CLI
    return from_dict(cls, data)


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def save_yaml(obj: Any, path: str | Path) -> None:
    """`obj` (a config or a dict) as YAML; a whole config leads with its `flow:`, so that the file loads back as the
    same kind of config (`m2flow train RUN/config.yaml`)."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else obj
    if flow := getattr(type(obj), "FLOW", None):
        data = {"flow": flow, **data}
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def describe(cls: type, where: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, default, help) for every field, the help led by a numeric field's range: what `--help-config`
    prints."""
    rows = []
    for f in dataclasses.fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            rows += describe(hint, name)
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            within = f.metadata.get("within")
            rows.append((name, default, f"[{within}] " * bool(within) + f.metadata.get("help", "")))
    return rows


# ---------------------------------------------------------------------------------------------- reasoning


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


CHECK_SYNC_HELP = ("verify that the receivers' weights equal the actor's (a hash of every weight on both sides): "
                   "first = at the run's first two syncs (the start and after its first update), true = after every "
                   "sync, false = never")


def _validate_check_sync(section_cfg, where: str) -> None:
    value = section_cfg.check_weight_sync
    if isinstance(value, str) and value != "first":
        raise ConfigError(f"{where}.check_weight_sync must be first | true | false, got '{value}'")


def _checks_sync(section_cfg, syncs_done: int) -> bool:
    """Whether the weight sync after `syncs_done` earlier syncs of this run is verified (`check_weight_sync`)."""
    return section_cfg.check_weight_sync is True or (section_cfg.check_weight_sync == "first" and syncs_done < 2)


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
        _validate_check_sync(self, where)

    checks_sync = _checks_sync


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
    nonfinite: str = opt("stop", "a non-finite (NaN/inf) loss or gradient: stop (the update is not applied; the run "
                                 "ends with an error naming the component and the first non-finite tensor) | skip "
                                 "(drop that update, count it in actor/nonfinite_skipped)")
    max_weight_growth: float = opt(2.0, "stop when one training step multiplies the norm of the weights by more than "
                                        "this (a learning rate far too high wrecks a model without any NaN); 0: off",
                                   within="[0, inf)")

    def validate(self, where: str) -> None:
        if self.backend not in ("torch", "fsdp2"):
            raise ConfigError(f"{where}.backend must be torch | fsdp2, got '{self.backend}'")
        if len(self.betas) != 2:
            raise ConfigError(f"{where}.betas must be two numbers [beta1, beta2], got {self.betas}")
        _validate_nonfinite(self, where)


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


def place_beside(placement, name: str, beside: str):
    """A placement with component `name` placed: as given where it names `name`, else beside `beside` (its entry
    gains `name`: with_critic's `rollout: 0; reward,inference,actor: 1` -> `...,actor,critic: 1`)."""
    spec = "; ".join(f"{k}: {v}" for k, v in placement.items()) if isinstance(placement, dict) else placement
    entries = [e.strip() for e in str(spec).split(";") if e.strip()]
    named = [[n.strip() for n in e.partition(":")[0].split(",")] for e in entries]
    if any(name in names for names in named) or not any(beside in names for names in named):
        return placement  # placed already; or no `beside`: the placement check names what is missing
    return "; ".join(",".join(names + [name] if beside in names else names) + ":" + e.partition(":")[2]
                     for names, e in zip(named, entries))


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
    cluster: ClusterConfig = section(ClusterConfig, "Ray cluster and placement")
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
        if alg.name == "ppo" and self.cluster.placement != "auto":
            self.cluster.placement = with_critic(self.cluster.placement)
        if self.agent.tools and self.cluster.placement != "auto":  # beside the reward, unless the placement names it
            self.cluster.placement = place_beside(self.cluster.placement, "tool", "reward")
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


# ---------------------------------------------------------------------------------------------- embodied


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
    COMPONENTS: ClassVar[tuple[str, ...]] = ("env", "rollout", "actor")

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.offload is not False:
            raise ConfigError(f"{where}.offload: the embodied flow keeps its small policies resident (offload is "
                              f"built for the reasoning flow); set {where}.offload=false")


@dataclass
class EnvConfig:
    id: str = opt("CartPole-v1", "gymnasium env id (classic control, MuJoCo, or 'module:Env-v0'), or ManiSkill3's "
                                 "PickCube-v1 | PushCube-v1 | StackCube-v1 (several, comma-separated, with instruct)")
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
    pixels: bool = opt(False, "observe rendered frames [3, image_size, image_size] uint8 (with policy.kind=cnn)")
    image_size: int = opt(64, "side of the pixel observations (36 at least: the CNN encoder's three convolutions "
                              "leave nothing of a smaller frame)", within="[36, 2048]")
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
                           "instruction's words embedded and averaged, beside the state, into the MLPs)")
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

    def validate(self, where: str) -> None:
        if self.kind not in ("mlp", "cnn", "instruct"):
            raise ConfigError(f"{where}.kind must be mlp | cnn | instruct, got '{self.kind}'")
        if self.activation not in ("tanh", "relu", "gelu", "elu"):
            raise ConfigError(f"{where}.activation must be tanh | relu | gelu | elu, got '{self.activation}'")


@dataclass
class EmbodiedRolloutConfig:
    steps: int = opt(128, "policy steps per env per iteration (SB3's n_steps)", within="[1, inf)")
    deterministic: bool = opt(False, "act with the distribution's mode instead of sampling (for tests)")
    cohost: bool = opt(True, "lockstep (env.pipeline_stages 1) with env and policy workers on the same devices: run "
                             "each policy worker inside its env worker's process, so a step's hand-over is a "
                             "function call instead of a Ray call")
    check_weight_sync: bool | str = opt("first", CHECK_SYNC_HELP)

    def validate(self, where: str) -> None:
        _validate_check_sync(self, where)

    checks_sync = _checks_sync


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
    anneal_lr: bool = opt(False, "decay the learning rate linearly to 0 over the run")
    adam_eps: float = opt(1e-5, "Adam epsilon", within="(0, inf)")
    epochs: int = opt(10, "passes over each rollout", within="[1, inf)")
    minibatch_size: int = opt(64, "samples per gradient step (SB3's batch_size)", within="[1, inf)")
    grad_clip: float = opt(0.5, "max gradient norm", within="(0, inf)")
    compile: bool = opt(False, "torch.compile the minibatch loss (forward + backward), compiled at the first update "
                                  "(inductor needs a C++ compiler)")
    nonfinite: str = opt("stop", "a non-finite (NaN/inf) loss or gradient: stop (the update is not applied; the run "
                                 "ends with an error naming the component and the first non-finite tensor) | skip "
                                 "(drop that update, count it in actor/nonfinite_skipped)")
    max_weight_growth: float = opt(2.0, "stop when one training step multiplies the norm of the weights by more than "
                                        "this (a learning rate far too high wrecks a model without any NaN); 0: off",
                                   within="[0, inf)")
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
        _validate_nonfinite(self, where)


def _validate_nonfinite(actor, where: str) -> None:
    if actor.nonfinite not in ("stop", "skip"):
        raise ConfigError(f"{where}.nonfinite must be stop | skip, got '{actor.nonfinite}'")


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
    rollout: EmbodiedRolloutConfig = section(EmbodiedRolloutConfig, "rollout length")
    algorithm: EmbodiedAlgorithmConfig = section(EmbodiedAlgorithmConfig, "advantages and losses")
    actor: EmbodiedActorConfig = section(EmbodiedActorConfig, "optimization")
    sac: SACConfig = section(SACConfig, "off-policy SAC (algorithm.name=sac): replay buffer, update schedule")
    eval: EmbodiedEvalConfig = section(EmbodiedEvalConfig, "evaluation after training")

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
        if "," in self.env.id and self.env.seed_groups > 1:
            raise ConfigError("env.seed_groups > 1 with several tasks in env.id is not supported yet (a group of envs "
                              "sharing a reset seed would mix tasks)")
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
        if self.algorithm.name == "grpo" and self.env.seed_groups < 2:
            raise ConfigError("algorithm.name=grpo needs env.seed_groups >= 2 (advantages are relative within a group)")
