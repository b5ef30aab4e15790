"""The bad-input table (issue 20, docs/errors.md): each mistake a person can make on the command line gets its own
message, naming the field or file and what was expected, on one line (argparse's usage errors: the usage, then the
error), with exit code 2 — and each is found before Ray starts (the cluster is replaced by one that fails)."""

import re
from pathlib import Path

import pytest
import torch

from m2flow.cli import main
from m2flow.runtime import cluster as cluster_module

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
TINY = ["run.progress=false", "cluster.cpu_devices=2"]

# (name, argv, the start of the message after "m2flow: "); {tmp} is the test's folder
CASES = [
    ("unknown preset", ["train", "nosuch"], "config error: no config file or preset named 'nosuch'; presets: "),
    ("config file missing", ["train", "{tmp}/none.yaml"], "config error: config file '{tmp}/none.yaml' does not exist"),
    ("config file not YAML", ["train", "{tmp}/broken.yaml"], "config error: config file '{tmp}/broken.yaml' is not "
                                                             "valid YAML: "),
    ("config file of no flow", ["train", "{tmp}/badflow.yaml"], "config error: config '{tmp}/badflow.yaml': flow must "
                                                                "be reasoning | embodied, got 'foo'"),
    ("unknown field", ["train", "grpo_arithmetic", "actor.lrr=1"], "config error: unknown config field 'actor.lrr' "
                                                                   "(did you mean 'lr'?)"),
    ("wrong type", ["train", "grpo_arithmetic", "actor.lr=fast"], "config error: config field 'actor.lr' expects "
                                                                  "float, got 'fast'"),
    ("override without =", ["train", "grpo_arithmetic", "actor.lr"], "config error: override 'actor.lr' must look "
                                                                     "like key.sub=value"),
    ("negative steps", ["train", "grpo_arithmetic", "run.steps=-1"], "config error: run.steps must be >= 0, got -1"),
    ("algorithm not built", ["train", "grpo_arithmetic", "algorithm.name=foo"], "config error: algorithm.name: "),
    ("no samples", ["train", "grpo_arithmetic", "rollout.n=0"], "config error: rollout.n must be >= 1, got 0"),
    ("no CPU devices", ["train", "grpo_arithmetic", "cluster.cpu_devices=0"], "config error: cluster.cpu_devices must "
                                                                              "be >= 1, got 0"),
    ("CPU devices beyond the cores", ["train", "grpo_arithmetic", "cluster.cpu_devices=[1,4096]"],
     "error: cluster.cpu_devices: [1, 4096] asks for 4097 cores, but this machine gives this process "),
    ("unknown dtype", ["train", "grpo_arithmetic", "model.dtype=float8"], "config error: model.dtype must be "
                                                                          "'float32' or 'bfloat16', got 'float8'"),
    ("unknown non-finite policy", ["train", "grpo_arithmetic", "actor.nonfinite=maybe"], "config error: "
                                                                                         "actor.nonfinite must be stop "
                                                                                         "| skip"),
    ("resume and overwrite", ["train", "grpo_arithmetic", "run.resume=true", "run.overwrite=true"],
     "config error: run.resume and run.overwrite are both true"),
    ("foreground not a component", ["train", "sac_pendulum", "cluster.foreground=learner"],
     "config error: cluster.foreground names learner: expected components of this flow (env, rollout, actor)"),
    ("file task without a file", ["train", "grpo_arithmetic", "data.task=file"], "config error: data.path is required "
                                                                                 "when data.task=file"),
    ("no envs", ["train", "ppo_cartpole", "env.num_envs=0"], "config error: env.num_envs must be >= 1, got 0"),
    ("negative env timeout", ["train", "ppo_cartpole", "env.step_timeout_s=-1"], "config error: env.step_timeout_s "
                                                                                 "must be >= 0, got -1"),
    ("cluster address where nothing listens", ["train", "grpo_arithmetic", "cluster.address=127.0.0.1:1"],
     "error: cluster.address: nothing answers at 127.0.0.1:1 (Connection refused): start the cluster's head there "
     "(`ray start --head --port=1`), or leave cluster.address empty to start a local one"),
    ("cluster address of a client server where nothing listens", ["train", "ppo_cartpole",
                                                                  "cluster.address=ray://localhost:1"],
     "error: cluster.address: nothing answers at ray://localhost:1 ("),
    ("cluster address without a port", ["train", "grpo_arithmetic", "cluster.address=head-node"],
     "error: cluster.address must be auto, HOST:PORT (a head's GCS, e.g. 10.0.0.5:6379) or ray://HOST:PORT (a "
     "head's client server), got 'head-node'"),
    ("placement syntax", ["train", "grpo_arithmetic", "cluster.placement=rollout: 0-; actor: 1", *TINY],
     "error: cluster.placement: placement 'rollout: 0-; actor: 1': bad devices '0-'"),
    ("placement device missing", ["train", "grpo_arithmetic", "cluster.placement=rollout: 0; reward,inference,actor: 5",
                                  *TINY], "error: cluster.placement: placement 'rollout: 0; reward,inference,actor: 5': "
                                          "device 5 does not exist; the cluster has 2 device(s)"),
    ("placement leaves a component out", ["train", "grpo_arithmetic", "cluster.placement=rollout: 0", *TINY],
     "error: cluster.placement: placement 'rollout: 0': component(s) reward, inference, actor have no devices"),
    ("embodied placement leaves a component out", ["train", "ppo_cartpole", "cluster.placement=env,rollout: 0", *TINY],
     "error: cluster.placement: placement 'env,rollout: 0': component(s) actor have no devices"),
    ("refill without dynamic sampling", ["train", "grpo_arithmetic", "algorithm.refill_rounds=2"],
     "config error: algorithm.refill_rounds refills the groups that dynamic sampling drops: set "
     "algorithm.dynamic_sampling=true"),
    ("refill with several reward ranks", ["train", "grpo_arithmetic", "algorithm.dynamic_sampling=true",
                                          "algorithm.refill_rounds=2",
                                          "cluster.placement=rollout,reward,inference,actor: 0-1", *TINY],
     "error: algorithm.refill_rounds: one reward rank counts the step's groups, but the placement gives the reward "
     "2 ranks"),
    ("tool that cannot be imported", ["train", "grpo_arithmetic", "agent.tools={calc: nomod_xyz:fn}", *TINY],
     "error: agent.tools: tool 'nomod_xyz:fn': cannot import module 'nomod_xyz'"),
    ("tools with the HF engine", ["train", "grpo_arithmetic", "agent.tools={calc: calc}", "rollout.engine=hf"],
     "config error: agent.tools: multi-turn rollouts with tools need rollout.engine=native, got 'hf'"),
    ("arithmetic operand of no digits", ["train", "grpo_arithmetic", "data.digits=0"],
     "config error: data.digits must be >= 1, got 0"),
    ("tool share of the warm start outside [0, 1]", ["train", "agent_add", "sft.tool_fraction=1.5"],
     "config error: sft.tool_fraction must be in [0, 1], got 1.5"),
    ("warm start's target accuracy outside [0, 1]", ["train", "demo", "sft.target_accuracy=30"],
     "config error: sft.target_accuracy must be in [0, 1], got 30"),
    ("warm start's held-back problems none", ["train", "demo", "sft.val_size=0"],
     "config error: sft.val_size must be >= 1, got 0"),
    ("sampling temperature not positive", ["train", "grpo_arithmetic", "rollout.temperature=-1"],
     "config error: rollout.temperature must be > 0, got -1.0"),
    ("learning rate not a number", ["train", "grpo_arithmetic", "actor.lr=nan"],
     "config error: actor.lr must be > 0, got nan"),
    ("an element of a list outside its range", ["train", "ppo_cartpole", "policy.hidden=[64, 0]"],
     "config error: policy.hidden must be >= 1 (each of them), got [64, 0]"),
    ("arithmetic answer width negative", ["train", "demo", "data.answer_width=-3"],
     "config error: data.answer_width must be >= 0, got -3"),
    ("model directory missing", ["train", "grpo_arithmetic", "model.path={tmp}/nope", *TINY],
     "error: model.path: no directory at '{tmp}/nope'"),
    ("model directory without config.json", ["train", "grpo_arithmetic", "model.path={tmp}/empty", *TINY],
     "error: model.path: '{tmp}/empty' has no config.json: not an HF model directory"),
    ("model config not JSON", ["train", "grpo_arithmetic", "model.path={tmp}/model_bad_json", *TINY],
     "error: model.path: {tmp}/model_bad_json/config.json is not valid JSON (Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1))"),
    ("model weights cut short", ["train", "grpo_arithmetic", "model.path={tmp}/model_cut", *TINY],
     "error: model.path: {tmp}/model_cut/model.safetensors cannot be read as safetensors (Error while deserializing "
     "header: incomplete metadata, file not fully covered): cut short or not a weights file"),
    ("model weights of another config", ["train", "grpo_arithmetic", "model.path={tmp}/model_other_shapes", *TINY],
     "error: model.path: {tmp}/model_other_shapes/model.safetensors: model.layers.0.mlp.down_proj.weight has shape "
     "[64, 256], but config.json gives [64, 512]: the weights are not of the model config.json describes"),
    ("model of an architecture transformers does not know", ["train", "grpo_arithmetic",
                                                             "model.path={tmp}/model_unknown_type", *TINY],
     "error: model.path: {tmp}/model_unknown_type/config.json describes no causal LM transformers can build: "),
    ("responses beyond the model's positions", ["train", "demo", "rollout.max_new_tokens=1000000000", *TINY],
     "error: rollout.max_new_tokens: data.max_prompt_len + rollout.max_new_tokens = 64 + 1000000000 = 1,000,000,064 "
     "tokens, more than the 256 positions of the tiny model (max_position_embeddings); lower them"),
    ("a step's samples beyond the memory", ["train", "demo", "rollout.prompts_per_step=100000000", *TINY],
     "error: rollout.prompts_per_step: a step's 800,000,000 samples (rollout.prompts_per_step x rollout.n) of up to "
     "69 tokens need about "),
    ("a KV cache beyond the memory", ["train", "grpo_arithmetic", "rollout.max_slots=100000000", "model.tiny_layers=64",
                                      "model.tiny_hidden=4096", "rollout.prompts_per_step=100000", *TINY],
     "error: rollout.max_slots: the KV cache of 800,000 sequences of 69 tokens (data.max_prompt_len + "
     "rollout.max_new_tokens) needs 53906.25 GiB, more than 80% of the "),
    ("more problems than the task has", ["train", "demo", "data.digits=1", *TINY],
     "error: data: arithmetic: found only 12 distinct test problems of the 500 asked for; the problem space is too "
     "small"),
    ("more problems than the memory holds", ["train", "demo", "data.train_size=100000000000", *TINY],
     "error: data.train_size: 100,000,000,756 arithmetic problems (data.train_size, sft.val_size held back, "
     "data.eval_size) need about 95367.43 GiB, more than 80% of the "),
    ("tiny model of no whole head size", ["train", "grpo_arithmetic", "model.tiny_hidden=6"],
     "config error: model.tiny_hidden must be a multiple of 4 (the tiny model's attention heads), got 6"),
    ("LoRA on a module the model lacks", ["train", "grpo_arithmetic", "model.lora.r=4",
                                          "model.lora.target_modules=[nope_proj]", *TINY],
     "error: model.lora.target_modules: the model has no module 'nope_proj'; its linear layers: down_proj, gate_proj, "
     "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or all-linear)"),
    ("the demo asked for more problems than the task has", ["demo", "data.digits=1", *TINY],
     "error: data: arithmetic: found only 12 distinct test problems of the 500 asked for"),
    ("data file missing", ["train", "grpo_arithmetic", "data.task=file", "data.path={tmp}/nope.jsonl", *TINY],
     "error: data.path: no file at '{tmp}/nope.jsonl'"),
    ("data file of the wrong type", ["train", "grpo_arithmetic", "data.task=file", "data.path={tmp}/data.txt", *TINY],
     "error: data.path: '{tmp}/data.txt' is a .txt file; expected .jsonl, .json, .parquet"),
    ("unknown data layout", ["train", "grpo_arithmetic", "data.task=file", "data.path={tmp}/qa.jsonl",
                             "data.layout=csv"], "config error: data.layout must be plain | gsm8k | math, got 'csv'"),
    ("data file without the columns", ["train", "grpo_arithmetic", "data.task=file", "data.path={tmp}/qa.jsonl",
                                       *TINY],
     "error: data.path: {tmp}/qa.jsonl: missing column(s) ['prompt', 'answer']; columns found: ['a', 'q']"),
    ("empty data file", ["train", "grpo_arithmetic", "data.task=file", "data.path={tmp}/empty.jsonl", *TINY],
     "error: data.path: {tmp}/empty.jsonl: the dataset is empty"),
    ("reward module missing", ["train", "grpo_arithmetic", "reward.fn=nosuchmod:fn", *TINY],
     "error: reward.fn: reward function 'nosuchmod:fn': cannot import module 'nosuchmod'"),
    ("reward function missing", ["train", "grpo_arithmetic", "reward.fn=os:nosuchfn", *TINY],
     "error: reward.fn: reward function 'os:nosuchfn': module 'os' has no attribute 'nosuchfn'"),
    ("reward name unknown", ["train", "grpo_arithmetic", "reward.fn=nosuch", *TINY],
     "error: reward.fn: reward function 'nosuch': not a built-in"),
    ("reward function of the wrong signature", ["train", "grpo_arithmetic", "reward.fn=faulty_rewards:three_args", *TINY],
     "error: reward.fn: reward function 'faulty_rewards:three_args' raised TypeError: three_args() missing 1 required "
     "positional argument: 'extra' (called as fn("),
    ("reward function returning text", ["train", "grpo_arithmetic", "reward.fn=faulty_rewards:text", *TINY],
     "error: reward.fn: reward function 'faulty_rewards:text' returned 'high' (str), not a number (called as fn("),
    ("reward function returning NaN", ["train", "grpo_arithmetic", "reward.fn=faulty_rewards:not_finite", *TINY],
     "error: reward.fn: reward function 'faulty_rewards:not_finite' returned nan, not a finite number"),
    ("reward function raising", ["train", "grpo_arithmetic", "reward.fn=faulty_rewards:raises", *TINY],
     "error: reward.fn: reward function 'faulty_rewards:raises' raised KeyError: 'no such answer'"),
    ("reward function that does not return", ["train", "grpo_arithmetic", "reward.fn=faulty_rewards:sleeps",
                                             "reward.timeout_s=1", *TINY],
     "error: reward.fn: reward function 'faulty_rewards:sleeps' did not return within reward.timeout_s=1s"),
    ("batched reward function returning too few", ["train", "grpo_arithmetic", "reward.fn=faulty_rewards:batched_too_few",
                                                   *TINY],
     "error: reward.fn: reward function faulty_rewards:batched_too_few (batched) returned 0 rewards for 1 completions"),
    ("env id misspelt", ["train", "ppo_cartpole", "env.id=CartPol-v1", *TINY],
     "error: env.id: unknown gymnasium env id 'CartPol-v1'; close matches: CartPole-v1"),
    ("ManiSkill3 task misspelt", ["train", "ppo_pickcube", "env.id=PickCub-v1", *TINY],
     "error: env.id: unknown gymnasium env id 'PickCub-v1'; close matches: PickCube-v1, StackCube-v1, PushCube-v1"),
    ("behaviour-cloning term without its demos", ["train", "ppo_pickcube", "actor.bc_coef=0.1", *TINY],
     "config error: actor.bc_coef > 0 needs actor.bc_demos (a `m2flow demos` directory)"),
    ("behaviour-cloning demos missing", ["train", "ppo_pickcube", "actor.bc_coef=0.1", "actor.bc_demos={tmp}/none",
                                        *TINY],
     "error: actor.bc_demos: '{tmp}/none' holds no demos.json (expected a demonstration dataset: `m2flow demos TASK "
     "-n N --out DIR` writes one)"),
    ("SAC demonstrations missing", ["train", "sac_pendulum", "sac.demos={tmp}/none", *TINY],
     "error: sac.demos: '{tmp}/none' holds no demos.json (expected a demonstration dataset: `m2flow demos TASK -n N "
     "--out DIR` writes one)"),
    ("SAC replay buffer larger than memory", ["train", "sac_pendulum", "sac.buffer_size=100000000000", *TINY],
     "error: sac.buffer_size: 100,000,000,000 transitions of Pendulum-v1 need "),
    ("demos of a task without an expert", ["demos", "PickCub-v1", "-n", "1"],
     "error: demos: no expert for task 'PickCub-v1'; tasks: PickCube-v1, PushCube-v1, StackCube-v1"),
    ("pixel demos of a Meta-World task", ["demos", "metaworld/reach-v3", "-n", "1", "--pixels"],
     "error: demos: --pixels records the ManiSkill3 tasks' camera frames (PickCube-v1, PushCube-v1, StackCube-v1), "
     "not metaworld/reach-v3's"),
    ("VLA without pixel observations", ["train", "ppo_pickcube", "policy.kind=vla", *TINY],
     "config error: policy.kind=vla reads ManiSkill3's pixel observations: it needs env.pixels=true and env.id among "
     "PickCube-v1, PushCube-v1, StackCube-v1 (got env.pixels=False, env.id=PickCube-v1)"),
    ("SAC on an env of discrete actions", ["train", "sac_pendulum", "env.id=CartPole-v1", *TINY],
     "error: algorithm.name=sac: env.id=CartPole-v1 acts in Discrete(2), but SAC's actor squashes its actions into a "
     "bounded Box (continuous actions with finite bounds); use algorithm.name=ppo for this env"),
    ("an iteration's trajectories beyond the memory", ["train", "ppo_cartpole", "rollout.steps=10000000000", *TINY],
     "error: rollout.steps: an iteration's 80,000,000,000 env steps (env.num_envs x rollout.steps) of CartPole-v1 "
     "need about "),
    ("frames too large to render", ["train", "ppo_cartpole", "env.pixels=true", "policy.kind=cnn",
                                    "env.image_size=100000"],
     "config error: env.image_size must be in [36, 2048], got 100000"),
    ("env keyword the env does not take", ["train", "ppo_cartpole", "env.kwargs={nosuch: 1}", *TINY],
     "error: env.id=CartPole-v1 with env.kwargs={'nosuch': 1}: making, resetting or stepping the env failed: "
     "TypeError: "),
    ("env keyword of the wrong type", ["train", "ppo_halfcheetah", "env.kwargs={ctrl_cost_weight: fast}", *TINY],
     "error: env.id=HalfCheetah-v5 with env.kwargs={'ctrl_cost_weight': 'fast'}: making, resetting or stepping the "
     "env failed: "),
    ("more pipeline stages than envs", ["train", "ppo_cartpole", "env.num_envs=8", "env.pipeline_stages=16", *TINY],
     "error: env.pipeline_stages=16 exceeds the 8 envs per env worker: each stage steps one env at least (the "
     "placement gives the env 1 worker)"),
    ("envs that do not split over the env workers", ["train", "ppo_cartpole", "env.num_envs=7",
                                                    "cluster.placement=env: 0-1; rollout,actor: 0", *TINY],
     "error: env.num_envs=7 must be a multiple of the env workers (the placement gives the env 2 workers)"),
    ("env module missing", ["train", "ppo_cartpole", "env.id=nosuchmod:Env-v0", *TINY],
     "error: env.id: 'nosuchmod:Env-v0': cannot import module 'nosuchmod'"),
    ("run name that is a path", ["train", "grpo_arithmetic", "run.name=../../escape"],
     "config error: run.name must be a plain name (no '/' or '\\', not '.' or '..'): the run is written to "
     "run.dir/run.name, got '../../escape'"),
    ("run name that is the run directory itself", ["train", "ppo_cartpole", "run.name=."],
     "config error: run.name must be a plain name"),
    ("run directory holds a run", ["train", "grpo_arithmetic", "run.dir={tmp}", "run.name=old", *TINY],
     "error: run directory {tmp}/old already holds a run (metrics.jsonl); continue it with run.resume=true"),
    ("run directory not writable", ["train", "grpo_arithmetic", "run.dir=/proc/m2flow", *TINY],
     "error: run directory /proc/m2flow/grpo_arithmetic cannot be written"),
    ("eval of a missing path", ["eval", "{tmp}/nope"], "error: model directory '{tmp}/nope' does not exist"),
    ("eval of a folder without a model", ["eval", "{tmp}/empty"], "error: '{tmp}/empty' has no config.json"),
    ("sft from a missing model", ["sft", "{tmp}/nope", "{tmp}/out"], "error: model directory '{tmp}/nope' does not "
                                                                     "exist"),
    ("frame shifts for a policy that sees no frames", ["sft", "ppo_pickcube", "{tmp}/out", "--demos", "{tmp}/empty",
                                                       "--shift", "4"],
     "error: sft --demos: shift=4 moves camera frames, but the config observes states (env.pixels=false)"),
    ("frame shifts past half the frame", ["sft", "vla_pickcube", "{tmp}/out", "--demos", "{tmp}/empty", "--shift",
                                          "32"],
     "error: sft --demos: shift must be in [0, 32) pixels for env.image_size=64, got 32"),
    ("profile file missing", ["plan", "--profile", "{tmp}/nope.json", "--devices", "2"],
     "error: {tmp}/nope.json: no such profile file"),
    ("profile file of the wrong shape", ["plan", "--profile", "{tmp}/qa.jsonl", "--devices", "2"],
     "error: {tmp}/qa.jsonl: "),
    ("negative staleness for a plan", ["plan", "--profile", "{tmp}/nope.json", "--devices", "2", "--max-staleness",
                                       "-1"], "error: --max-staleness must be >= 0 (0: on-policy), got -1"),
    ("unknown command", ["fly"], "error: argument command: invalid choice: 'fly'"),
    ("train without a config", ["train"], "train: error: the following arguments are required: config"),
    ("unknown model architecture", ["init-model", "{tmp}/m", "--arch", "gpt9"],
     "init-model: error: argument --arch: invalid choice: 'gpt9'"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from m2flow.engines.hf import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _model_variants(base: Path, tmp_path: Path) -> None:
    """Model directories that are broken in one way each: config.json not JSON, the weights cut short, weights of
    another config (its MLP twice as wide), a model type transformers does not know."""
    import json
    import shutil

    def variant(name, change):
        shutil.copytree(base, tmp_path / name)
        change(tmp_path / name)

    def edit_config(**changes):
        def change(d):
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **{k: v(cfg) for k, v in changes.items()}}))
        return change

    variant("model_bad_json", lambda d: (d / "config.json").write_text("{oops"))
    variant("model_cut", lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:(d / "model.safetensors").stat().st_size // 2]))
    variant("model_other_shapes", edit_config(intermediate_size=lambda c: 2 * c["intermediate_size"]))
    variant("model_unknown_type", edit_config(model_type=lambda c: "nosuch"))


@pytest.fixture
def inputs(tmp_path, tiny_model):
    _model_variants(tiny_model, tmp_path)
    (tmp_path / "broken.yaml").write_text("run: {steps: [1\n")
    (tmp_path / "badflow.yaml").write_text("flow: foo\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.txt").write_text("1+1=2\n")
    (tmp_path / "qa.jsonl").write_text('{"q": "1+1=", "a": "2"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path


@pytest.fixture
def no_ray(monkeypatch):
    """A Cluster that fails if anything tries to start one: each error must come before Ray starts."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a Cluster was started before the bad input was found")

    monkeypatch.setattr(cluster_module.Cluster, "__init__", refuse)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # main() sets the driver's to 1


@pytest.mark.parametrize("name,argv,message", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_gets_its_message_and_exit_code_2(name, argv, message, inputs, no_ray, capsys):
    fill = lambda s: s.replace("{tmp}", str(inputs))  # noqa: E731
    try:
        code = main([fill(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(err) == 1 or err[0].startswith("usage: "), err  # one line, or argparse's usage and then the error
    assert err[-1].startswith("m2flow") and fill(message) in err[-1], err


@pytest.mark.parametrize("name", ["placement syntax", "placement device missing", "placement leaves a component out",
                                  "embodied placement leaves a component out"])
def test_a_bad_placement_is_found_before_the_run_when_ray_is_already_running(name, cluster, inputs, no_ray, capsys):
    """In a process that already runs Ray (a notebook, this test session), the placement is checked against the
    devices of the nodes Ray knows, as the run's Cluster would count them."""
    _, argv, message = next(c for c in CASES if c[0] == name)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_every_case_is_listed_in_docs_errors_md():
    doc = DOC.read_text()
    rows = re.findall(r"^\| (.+?) \|", doc, re.M)
    missing = [name for name, _, _ in CASES if name not in rows]
    assert len(CASES) >= 30 and not missing, missing


@pytest.fixture
def servers():
    """Two local TCP servers that are no Ray cluster: one answers as a web server does, one accepts and says
    nothing."""
    import socket
    import threading

    def serve(reply: bytes | None):
        sock = socket.create_server(("127.0.0.1", 0))
        def run():
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                if reply is not None:
                    conn.recv(64)
                    conn.sendall(reply)
                threading.Timer(30, conn.close).start()
        threading.Thread(target=run, daemon=True).start()
        return sock

    socks = [serve(b"HTTP/1.1 400 Bad Request\r\n\r\n"), serve(None)]
    yield [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()


def test_a_cluster_address_that_answers_but_not_as_ray_is_refused_in_seconds(servers, cluster, no_ray, capsys):
    """Ray retries such an address for minutes (a web server's port once hung `m2flow train` past 180 s); a Ray
    head's GCS (this session's own) passes the check."""
    import time

    import ray

    from m2flow.preflight import _cluster_address

    web, silent = servers
    for port, said in ((web, "it said b'HTTP/1.1 '"), (silent, "it said b''")):
        t0 = time.monotonic()
        assert main(["train", "grpo_arithmetic", f"cluster.address=127.0.0.1:{port}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"m2flow: error: cluster.address: 127.0.0.1:{port} answers, but not as a Ray cluster (no gRPC "
                       f"server there; {said}): give the port `ray start --head --port={port}` opened, or leave "
                       f"cluster.address empty to start a local one"), err
        assert time.monotonic() - t0 < 30
    _cluster_address(ray.get_runtime_context().gcs_address)  # a Ray cluster's GCS: no error
