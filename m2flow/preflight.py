"""What can be checked about a run before Ray starts, so that a mistake costs a second and reads as one line: the
cluster address (something that speaks gRPC answers there), the placement against the devices the local cluster will
have; for the reasoning flow the model (its directory's config and weights' shapes, LoRA's targets, built on the meta
device), the work against the model's positions and the memory here, the data (the file, or the built-in task's
problems), the reward function (called on one record) and the agent's tools; for the embodied flow the env (made,
reset and stepped once), its action space against the algorithm, the envs' split over the env workers and the
memory of a rollout or a replay buffer. Each problem raises `m2flow.config.UserError` naming the config field, what
it holds and what was expected. It starts nothing and writes nothing (a user's reward function runs in a child
process); the flows check the same things again where they use them.
"""

from __future__ import annotations

import os
from pathlib import Path

from m2flow import config as C
from m2flow.embodied.config import EmbodiedClusterConfig, EmbodiedConfig
from m2flow.reasoning.config import ReasoningConfig, reasoning_components, refill_reward_ranks

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def preflight(cfg) -> None:
    """Raise UserError for the first problem found in `cfg` (a ReasoningConfig or EmbodiedConfig)."""
    _cluster_address(cfg.cluster.address)
    _placement(cfg)
    if isinstance(cfg, EmbodiedConfig):
        _env_id(cfg.env.id)
        if cfg.policy.init and not (Path(cfg.policy.init) / "policy.safetensors").is_file():
            raise C.UserError(f"policy.init: '{cfg.policy.init}' holds no policy.safetensors (expected an embodied "
                              f"checkpoint directory, or the output of `m2flow sft CONFIG OUT --demos DIR`)")
        for field, value in (("actor.bc_demos", cfg.actor.bc_demos), ("sac.demos", cfg.sac.demos)):
            for demos in filter(None, value.split(",")):
                if not (Path(demos) / "demos.json").is_file():
                    raise C.UserError(f"{field}: '{demos}' holds no demos.json (expected a demonstration dataset: "
                                      f"`m2flow demos TASK -n N --out DIR` writes one)")
        _env_spaces(cfg)
        return
    model = _model(cfg)
    if cfg.model.lora.r:
        _lora_targets(cfg.model.lora, model)
    _generation_fits(cfg, model.config)
    record = _data_file(cfg.data) if cfg.data.task == "file" else _synthetic_data(cfg)
    _reward_fn(cfg, record)
    if cfg.agent.tools:
        _tools(cfg.agent)


def local_devices(cpu_devices: int | None) -> int | None:
    """The devices the cluster a run starts here will have, counted as `Cluster` counts them: on each node its GPUs,
    else `cpu_devices` or one per core. Ray already started in this process: the nodes it knows of; else this machine.
    None when that depends on a cluster not joined yet (a Ray address given)."""
    import ray

    from m2flow.runtime.cluster import node_devices

    mine = len(os.sched_getaffinity(0))
    if ray.is_initialized():
        here = ray.get_runtime_context().get_node_id()
        total = 0
        for node in (n for n in ray.nodes() if n["Alive"]):
            res = node["Resources"]
            cores = int(res.get("CPU", 0)) or mine
            total += node_devices(int(res.get("GPU", 0)), min(cores, mine) if node["NodeID"] == here else cores,
                                  cpu_devices)
        return total
    return node_devices(_local_gpus(), mine, cpu_devices)


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA: a CPU machine
        return 0


ADDRESS_TIMEOUT_S = 10.0


def _cluster_address(address: str | None) -> None:
    """A cluster to join answers at its address: Ray itself retries an address where nothing listens for minutes."""
    import socket

    if not address:
        return
    given = address
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        try:
            address = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            raise C.UserError("cluster.address=auto: no Ray cluster runs on this machine (none in RAY_ADDRESS or "
                              "/tmp/ray): start one with `ray start --head`, or leave cluster.address empty for a "
                              "local one") from None
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not host or not port.isdigit():
        raise C.UserError(f"cluster.address must be auto, HOST:PORT (a head's GCS, e.g. 10.0.0.5:6379) or "
                          f"ray://HOST:PORT (a head's client server), got {given!r}")
    start = f"--ray-client-server-port={port}" if address.startswith("ray://") else f"--port={port}"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_TIMEOUT_S) as conn:
            reply = _http2_reply(conn)
    except OSError as e:
        why = f"no answer within {ADDRESS_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else e.strerror or str(e)
        raise C.UserError(f"cluster.address: nothing answers at {address} ({why}): start the cluster's head there "
                          f"(`ray start --head {start}`), or leave cluster.address empty to start a local one") from None
    if reply is not True:
        raise C.UserError(f"cluster.address: {address} answers, but not as a Ray cluster (no gRPC server there; "
                          f"it said {reply!r}): give the port `ray start --head {start}` opened, or leave "
                          f"cluster.address empty to start a local one")


def _http2_reply(conn) -> bool | bytes:
    """True if the server on `conn` speaks HTTP/2 (gRPC: what a Ray head's GCS and client server are), else the first
    bytes it sent back: the client preface and an empty SETTINGS frame, answered by a SETTINGS frame (type 4)."""
    conn.settimeout(ADDRESS_TIMEOUT_S / 2)
    conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    head = b""
    try:
        while len(head) < 9 and (chunk := conn.recv(9 - len(head))):
            head += chunk
    except TimeoutError:
        pass
    return True if len(head) == 9 and head[3] == 4 else head


def _placement(cfg) -> None:
    from m2flow.runtime.placement import PlacementError, parse_placement

    spec = cfg.placement()
    sizes, mine = cfg.cluster.cpu_devices, len(os.sched_getaffinity(0))
    if isinstance(sizes, list) and not cfg.cluster.address and sum(sizes) > mine and not _local_gpus():
        raise C.UserError(f"cluster.cpu_devices: {sizes} asks for {sum(sizes)} cores, but this machine gives this "
                          f"process {mine}: give core counts that sum to at most {mine}")
    devices = None if cfg.cluster.address else local_devices(cfg.cluster.cpu_devices)
    if spec == "auto" or devices is None:
        return
    embodied = isinstance(cfg, EmbodiedConfig)
    components = list(EmbodiedClusterConfig.COMPONENTS) if embodied else reasoning_components(cfg)
    try:
        placed = parse_placement(spec, devices, components)
    except PlacementError as e:
        raise C.UserError(f"cluster.placement: {e} (this machine gives {devices} device(s); cluster.cpu_devices "
                          f"sets how many CPU devices)") from None
    if isinstance(cfg, ReasoningConfig):
        refill_reward_ranks(cfg, placed["reward"].world_size)
    else:
        _env_split(cfg.env, placed["env"].world_size)


def _env_split(env, workers: int) -> None:
    """env.num_envs over the placement's env workers: an equal share each, whole seed groups, a stage per env at most
    (what each env worker checks as it starts)."""
    where = f"(the placement gives the env {workers} worker{'s' * (workers > 1)})"
    if env.num_envs % workers:
        raise C.UserError(f"env.num_envs={env.num_envs} must be a multiple of the env workers {where}")
    share = env.num_envs // workers
    if share % env.seed_groups:
        raise C.UserError(f"env.seed_groups={env.seed_groups} must divide the {share} envs per env worker {where}")
    if env.pipeline_stages > share:
        raise C.UserError(f"env.pipeline_stages={env.pipeline_stages} exceeds the {share} envs per env worker: each "
                          f"stage steps one env at least {where}")


def _model(cfg):
    """The run's model built on the meta device (no weight allocated): model.path's, checked (`_model_dir`), or the
    tiny model the flow builds when it is empty."""
    import torch
    from transformers import AutoModelForCausalLM

    if cfg.model.path:
        return _model_dir(cfg.model.path)
    from m2flow.engines.hf import tiny_config

    m = cfg.model
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(m.tiny_arch, m.tiny_hidden, m.tiny_layers))


def _lora_targets(lora, model) -> None:
    """Each of model.lora.target_modules names modules of the model, as PEFT matches them (the name, or its last
    dotted parts)."""
    import torch

    names = [name for name, _ in model.named_modules()]
    for target in lora.target_modules:
        if target != "all-linear" and not any(n == target or n.endswith(f".{target}") for n in names):
            kinds = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules()
                            if isinstance(mod, torch.nn.Linear)})
            raise C.UserError(f"model.lora.target_modules: the model has no module '{target}'; its linear layers: "
                              f"{', '.join(kinds)} (or all-linear)")


def _model_dir(path: str):
    p = Path(path)
    if not p.is_dir():
        raise C.UserError(f"model.path: no directory at '{path}' (expected a local HF model directory with "
                          f"config.json; leave model.path empty for a tiny model)")
    if not (p / "config.json").is_file():
        hint = " (a checkpoint? its model is in model/)" if (p / "model" / "config.json").is_file() else ""
        raise C.UserError(f"model.path: '{path}' has no config.json: not an HF model directory{hint}")
    return _model_files(p)


def _model_files(p: Path):
    """config.json parses and names a causal LM; each safetensors file is whole, and its tensors have the shapes that
    config gives (read from the files' headers and a model built on the meta device: no weight is loaded)."""
    import json

    import torch
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        json.loads((p / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise C.UserError(f"model.path: {p / 'config.json'} is not valid JSON ({e})") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(p))
        expected = model.state_dict()
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise C.UserError(f"model.path: {p / 'config.json'} describes no causal LM transformers can build: "
                          f"{' '.join(str(e).split())[:300]}") from None
    found = 0
    for file in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except (SafetensorError, OSError) as e:
            raise C.UserError(f"model.path: {file} cannot be read as safetensors ({e}): cut short or not a weights "
                              f"file") from None
        for name, shape in shapes.items():
            want = expected.get(name)
            if want is not None and tuple(want.shape) != shape:
                raise C.UserError(f"model.path: {file}: {name} has shape {list(shape)}, but config.json gives "
                                  f"{list(want.shape)}: the weights are not of the model config.json describes")
            found += want is not None
    if any(p.glob("*.safetensors")) and not found:
        raise C.UserError(f"model.path: the safetensors files in {p} hold none of the weights of the model "
                          f"config.json describes ({next(iter(expected))}, ...)")
    return model


# what a step's samples hold per token, about, over the processes they pass through (ids, logprobs of the behaviour,
# old and reference policies, masks, advantages; the rollout's, the channels' and the actor's copies)
SAMPLE_BYTES_PER_TOKEN = 64
RECORD_BYTES = 1024  # a synthetic problem as Python objects (prompt, answer, expression), about


def _generation_fits(cfg, model_config) -> None:
    """The longest sequence a run may decode fits the model's positions; the KV cache of the rollout's concurrent
    sequences (on a machine without GPUs: host memory) and a step's samples fit the memory available here."""
    from m2flow.embodied.sac.replay import FITS, available_bytes

    mc = model_config.to_dict()
    where = f"{cfg.model.path}/config.json" if cfg.model.path else "the tiny model"
    positions = mc.get("max_position_embeddings")
    r = cfg.rollout
    length = cfg.data.max_prompt_len + r.max_new_tokens
    if positions and length > positions:
        raise C.UserError(f"rollout.max_new_tokens: data.max_prompt_len + rollout.max_new_tokens = "
                          f"{cfg.data.max_prompt_len} + {r.max_new_tokens} = {length:,} tokens, more than the "
                          f"{positions:,} positions of {where} (max_position_embeddings); lower them")
    free, gib = available_bytes(), 2**30
    heads = mc.get("num_attention_heads") or 1
    head_dim = mc.get("head_dim") or mc.get("hidden_size", 0) // heads
    slots = min(r.max_slots, r.prompts_per_step * r.n)
    kv = 2 * mc.get("num_hidden_layers", 0) * slots * (mc.get("num_key_value_heads") or heads) * length * head_dim * (
        2 if cfg.model.dtype == "bfloat16" else 4)
    if kv > FITS * free and not _local_gpus():
        raise C.UserError(f"rollout.max_slots: the KV cache of {slots:,} sequences of {length:,} tokens "
                          f"(data.max_prompt_len + rollout.max_new_tokens) needs {kv / gib:.2f} GiB, more than "
                          f"{FITS:.0%} of the {free / gib:.2f} GiB available here; lower rollout.max_slots or the "
                          f"lengths")
    samples = r.prompts_per_step * r.n * length * SAMPLE_BYTES_PER_TOKEN
    if samples > FITS * free:
        raise C.UserError(f"rollout.prompts_per_step: a step's {r.prompts_per_step * r.n:,} samples "
                          f"(rollout.prompts_per_step x rollout.n) of up to {length:,} tokens need about "
                          f"{samples / gib:.2f} GiB, more than {FITS:.0%} of the {free / gib:.2f} GiB available here; "
                          f"lower rollout.prompts_per_step or rollout.n")


def _synthetic_data(cfg) -> dict:
    """The built-in task can draw the distinct problems the run asks for (training, held back for the warm start's
    target, held out), in the memory available here; returns the first training problem."""
    from dataclasses import replace

    from m2flow.embodied.sac.replay import FITS, available_bytes
    from m2flow.reasoning.tasks.datasets import task_records

    d = cfg.data
    held_back = cfg.sft.val_size if cfg.sft.steps and cfg.sft.target_accuracy else 0
    need, free = (d.train_size + held_back + d.eval_size) * RECORD_BYTES, available_bytes()
    if need > FITS * free:
        raise C.UserError(f"data.train_size: {d.train_size + held_back + d.eval_size:,} {d.task} problems "
                          f"(data.train_size, sft.val_size held back, data.eval_size) need about {need / 2**30:.2f} "
                          f"GiB, more than {FITS:.0%} of the {free / 2**30:.2f} GiB available here; lower them")
    try:
        task_records(d, cfg.run.seed, "test")
        return task_records(replace(d, train_size=d.train_size + held_back), cfg.run.seed, "train")[0]
    except ValueError as e:
        raise C.UserError(f"data: {e} (data.train_size={d.train_size:,}, sft.val_size held back={held_back}, "
                          f"data.eval_size={d.eval_size:,})") from None


def _data_file(data) -> dict:
    """The data file reads as the flow will read it; returns its first record."""
    from m2flow.reasoning.tasks.data import LAYOUTS as LAYOUT_KEYS
    from m2flow.reasoning.tasks.data import load_dataset

    p = Path(data.path)
    if not p.is_file():
        raise C.UserError(f"data.path: no file at '{data.path}' (expected a {', '.join(DATA_SUFFIXES)} file)")
    if p.suffix.lower() not in DATA_SUFFIXES:
        raise C.UserError(f"data.path: '{data.path}' is a {p.suffix or 'suffix-less'} file; expected "
                          f"{', '.join(DATA_SUFFIXES)}")
    try:  # read as the flow will: columns present, every record with a prompt and an answer
        return load_dataset(data.path, data.prompt_key or None, data.answer_key or None, layout=data.layout)[0]
    except (ValueError, OSError) as e:
        keys = LAYOUT_KEYS[data.layout]
        raise C.UserError(f"data.path: {' '.join(str(e).split())} (data.layout='{data.layout}', "
                          f"data.prompt_key='{data.prompt_key or keys['prompt_key']}', "
                          f"data.answer_key='{data.answer_key or keys['answer_key']}')") from None


def _reward_fn(cfg, record: dict) -> None:
    """The reward function imported, and a user's own called on `record`, one of the run's training records."""
    from m2flow.reasoning.tasks.datasets import reward_name, reward_timeout
    from m2flow.reasoning.tasks.rewards import REWARD_FNS, load_reward_fn, try_reward_fn

    name = reward_name(cfg.reward.fn, cfg.data.task)  # `auto`: the task's own reward
    try:
        load_reward_fn(name)
        if name not in REWARD_FNS:
            try_reward_fn(name, record, reward_timeout(name, cfg.reward.timeout_s))
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        raise C.UserError(f"reward.fn: {e}") from None


def _tools(agent) -> None:
    from m2flow.reasoning.tasks.tools import Toolbox

    try:
        Toolbox(agent.tools)
    except (ValueError, ImportError, AttributeError) as e:
        raise C.UserError(f"agent.tools: {e}") from None


def _env_spaces(cfg) -> None:
    """The env's action space against what the algorithm drives, and SAC's replay buffer against the memory available
    here: one env made for its spaces (not ManiSkill3's, whose tasks all act in a Box and take seconds to build)."""
    import numpy as np
    from gymnasium import spaces

    from m2flow.embodied.envs import maniskill
    from m2flow.embodied.workers.env import make_env_group

    if maniskill.is_maniskill(cfg.env.id.split(",")[0]):
        return
    try:  # made, reset and stepped once, as an env worker will: env.kwargs reach the env's constructor
        group = make_env_group(cfg, 1, cfg.run.seed)
        obs, act = group.observation_space, group.action_space
        group.reset()
        group.step(np.stack([act.sample()]))
        group.close()
    except Exception as e:  # noqa: BLE001 - whatever the env's own code raises, named in one line
        raise C.UserError(f"env.id={cfg.env.id} with env.kwargs={cfg.env.kwargs}: making, resetting or stepping the "
                          f"env failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    alg = cfg.algorithm.name
    if alg == "sac" and not (isinstance(act, spaces.Box) and np.isfinite(act.low).all() and np.isfinite(act.high).all()):
        raise C.UserError(f"algorithm.name=sac: env.id={cfg.env.id} acts in {act}, but SAC's actor squashes its "
                          f"actions into a bounded Box (continuous actions with finite bounds); use "
                          f"algorithm.name=ppo for this env")
    if not isinstance(act, (spaces.Box, spaces.Discrete)):
        raise C.UserError(f"env.id={cfg.env.id} acts in {act}: the policies act in a Box (Gaussian) or a Discrete "
                          f"(categorical) space only")
    if cfg.policy.init_std_scale != 1.0 and not isinstance(act, spaces.Box):
        raise C.UserError(f"policy.init_std_scale scales a Gaussian policy's std, but env.id={cfg.env.id} acts in "
                          f"{act}")
    if alg == "sac":
        _replay_buffer(cfg, obs.shape, act.shape)
    else:
        _rollout_buffer(cfg, obs, act)


def _rollout_buffer(cfg, obs, act) -> None:
    """An on-policy iteration's trajectories (env.num_envs x rollout.steps steps, each its observation as float32, its
    action, and six numbers: logprob, value, reward, done, advantage, return), held by the env workers, the channel
    and the actor at once, against the memory available here."""
    import numpy as np

    from m2flow.embodied.sac.replay import FITS, available_bytes

    step = 4 * (int(np.prod(obs.shape)) + max(int(np.prod(act.shape or (1,))), 1) + 6)
    steps = cfg.env.num_envs * cfg.rollout.steps
    need, free = 3 * steps * step, available_bytes()
    if need > FITS * free:
        raise C.UserError(f"rollout.steps: an iteration's {steps:,} env steps (env.num_envs x rollout.steps) of "
                          f"{cfg.env.id} need about {need / 2**30:.2f} GiB, more than {FITS:.0%} of the "
                          f"{free / 2**30:.2f} GiB available here; lower env.num_envs or rollout.steps")


def _replay_buffer(cfg, obs: tuple, act: tuple) -> None:
    """SAC's replay buffer against the memory available here."""
    from m2flow.embodied.sac.replay import FITS, ReplayBuffer, available_bytes

    need, free = ReplayBuffer.bytes_needed(cfg.sac.buffer_size, obs, act), available_bytes()
    if need > FITS * free:
        raise C.UserError(f"sac.buffer_size: {cfg.sac.buffer_size:,} transitions of {cfg.env.id} need "
                          f"{need / 2**30:.2f} GiB, more than {FITS:.0%} of the {free / 2**30:.2f} GiB available "
                          f"here; lower it")


def _env_id(env_id: str) -> None:
    import importlib

    import gymnasium as gym

    from m2flow.embodied.envs.group import check_env_id

    if ":" in env_id:
        module, _, name = env_id.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise C.UserError(f"env.id: '{env_id}': cannot import module '{module}': {e}") from None
        if name not in gym.registry:
            raise C.UserError(f"env.id: '{env_id}': module '{module}' registers no env '{name}'")
        return
    try:
        check_env_id(env_id)
    except ValueError as e:
        raise C.UserError(f"env.id: {e}") from None
    from m2flow.embodied.envs import maniskill

    if maniskill.is_maniskill(env_id):  # the package and a Vulkan device, before any worker starts
        try:
            maniskill.check_available()
        except (ImportError, RuntimeError) as e:
            raise C.UserError(f"env.id: {env_id}: {e}") from None
