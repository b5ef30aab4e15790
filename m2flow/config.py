"""Typed dataclass configs: YAML presets, dotted `a.b=c` overrides, validation with clear errors; the sections
every flow has (run, cluster). Each recipe's own sections live in its wing (`reasoning/config.py`,
`embodied/config.py`). Each field carries a one-line description (`opt(default, help)`); defaults run on a laptop.
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
    placement: Any = opt("auto", "component -> devices[:ranks], 'NAMES: DEVICES[:RANKS]; ...' (each flow's section "
                                 "gives its components and default), or 'auto' (profile, then the fastest predicted "
                                 "plan)")
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
    COMPONENTS: ClassVar[tuple[str, ...]] = ()  # the flow's components: each flow's cluster section names them

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
    trace: bool = opt(True, "write trace.json (and with run.plots, plots/timeline.png)")
    plots: bool = opt(True, "draw plots/*.png at the end (about a second; metrics.jsonl and TensorBoard hold the same "
                            "curves)")
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


# ---------------------------------------------------------------------- what both recipes' sections use

CHECK_SYNC_HELP = ("verify that the receivers' weights equal the actor's (a hash of every weight on both sides): "
                   "first = at the run's first two syncs (the start and after its first update), true = after every "
                   "sync, false = never")


def validate_check_sync(section_cfg, where: str) -> None:
    value = section_cfg.check_weight_sync
    if isinstance(value, str) and value != "first":
        raise ConfigError(f"{where}.check_weight_sync must be first | true | false, got '{value}'")


def checks_sync(section_cfg, syncs_done: int) -> bool:
    """Whether the weight sync after `syncs_done` earlier syncs of this run is verified (`check_weight_sync`)."""
    return section_cfg.check_weight_sync is True or (section_cfg.check_weight_sync == "first" and syncs_done < 2)


def nonfinite_opt() -> Any:
    """An actor section's `nonfinite` field (both recipes' actors guard their updates alike)."""
    return opt("stop", "a non-finite (NaN/inf) loss or gradient: stop (the update is not applied; the run ends with an "
                       "error naming the component and the first non-finite tensor) | skip (drop that update, count "
                       "it in actor/nonfinite_skipped)")


def max_weight_growth_opt() -> Any:
    """An actor section's `max_weight_growth` field."""
    return opt(2.0, "stop when one training step multiplies the norm of the weights by more than this (a learning "
                    "rate far too high wrecks a model without any NaN); 0: off", within="[0, inf)")


def validate_nonfinite(actor, where: str) -> None:
    if actor.nonfinite not in ("stop", "skip"):
        raise ConfigError(f"{where}.nonfinite must be stop | skip, got '{actor.nonfinite}'")
