"""Scale-out (issue 8): the FSDP2 actor on 2 ranks against one process, sharded checkpoints across rank counts, and
the reasoning flow with data-parallel rollout/reward/inference groups and a sharded actor.

Tolerance: FSDP2 reduces gradients in a different order than one process sums them (fp32), and Adam's first step
(g / sqrt(g^2 + eps)) magnifies that for tiny gradients: weights after a step agree to 1e-5 absolute (observed 8.7e-7)
while the step moves them by 1e-3 (lr 1e-3). Adam ignores the gradient's scale, so the gradient norm is compared too
(relative 1e-4): a wrongly scaled gradient fails there."""

import json
import random

import pytest
import torch

from m2flow import config as C
from m2flow.engines.hf import init_tiny_model, load_model
from m2flow.engines.train import collate, token_logprobs
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train
from m2flow.reasoning.workers.actor import ActorWorker
from m2flow.runtime import Channel, parse_placement, release_all, wait_all
from m2flow.runtime.stream import finish, route
from m2flow.runtime.weights import fetch
from m2flow.types import Batch

TOL = 1e-5


def make_cfg(tmp_path, *overrides, name="scale", micro_batch=2):
    return C.load(ReasoningConfig, None, [
        f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.steps=4", "actor.lr=1e-3",
        f"actor.micro_batch={micro_batch}", "algorithm.loss_agg=seq-mean-token-mean", *overrides])


def make_batch(model, n: int, seed: int) -> Batch:
    """n samples of random prompts/responses with advantages and the model's own (old) logprobs."""
    rng = random.Random(seed)
    pairs = [([rng.randrange(4, 60) for _ in range(rng.randint(3, 6))],
              [rng.randrange(4, 60) for _ in range(rng.randint(1, 5))]) for _ in range(n)]
    batch = Batch(dict(collate(pairs, pad_id=0)))
    batch["advantages"] = torch.tensor([rng.uniform(-1, 1) for _ in range(n)])
    with torch.no_grad():
        batch["old_logprobs"] = token_logprobs(model, batch.tensors)
    return batch


def feed(channel, micro_batches: list[Batch], ranks: int) -> None:
    """What the inference group does: each micro-batch to the actor (split per rank when there are several)."""
    for b in micro_batches:
        if ranks > 1:
            route(channel, b, ranks)
        else:
            channel.put(b)
    finish(channel, ranks, keyed=ranks > 1)


def weights_of(group) -> dict[str, torch.Tensor]:
    refs = group.publish_weights().wait()
    assert all(r is None for r in refs[1:]), "only rank 0 publishes"
    return {k: v.clone() for k, v in fetch(refs[0]).items()}, refs[0].digest


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def actors(cluster, tmp_path_factory):
    """A 2-rank FSDP2 actor (one rank per device) and a 1-rank plain actor, from the same tiny model."""
    tmp = tmp_path_factory.mktemp("scale")
    init_tiny_model(tmp / "model", seed=3)
    model = load_model(str(tmp / "model"))
    two = ActorWorker.launch(cluster, parse_placement("actor: 0-1", 2)["actor"],
                             make_cfg(tmp, "actor.backend=fsdp2"), str(tmp / "model"))
    one = ActorWorker.launch(cluster, parse_placement("actor: 0", 2)["actor"], make_cfg(tmp), str(tmp / "model"))
    yield {"two": two, "one": one, "model": model, "tmp": tmp}
    release_all([two, one])


def train_both(actors, micro_batches, step):
    chans = [Channel.create(f"scale-{step}-{i}-{random.random()}") for i in range(2)]
    feed(chans[0], micro_batches, 2)
    feed(chans[1], micro_batches, 1)
    m2, m1 = wait_all([actors["two"].train(chans[0], step), actors["one"].train(chans[1], step)])
    for ch in chans:
        ch.destroy()
    return m2, m1


def test_fsdp2_step_on_two_ranks_equals_one_process(actors):
    """Micro-batches of 9 (split 5/4: 3 vs 2 micro-batches of 2, so rank 1 pads) and 1 (rank 1 gets a zero-weight
    share) samples: the same global gradient, hence the same update, as one process on the same batch."""
    before, _ = weights_of(actors["one"])
    two_before, _ = weights_of(actors["two"])
    assert max_diff(before, two_before) == 0.0
    batch = make_batch(actors["model"], 10, seed=0)
    m2, m1 = train_both(actors, [batch.select(slice(0, 9)), batch.select(slice(9, 10))], step=0)
    assert [m["actor/samples"] for m in m2] == [10, 10] and m1[0]["actor/samples"] == 10
    assert abs(m2[0]["actor/grad_norm"] - m1[0]["actor/grad_norm"]) < 1e-4 * m1[0]["actor/grad_norm"]
    after2, _ = weights_of(actors["two"])
    after1, _ = weights_of(actors["one"])
    moved = max_diff(before, after1)
    assert moved > 1e-4, f"one step barely moved the weights ({moved})"
    print(f"\nFSDP2 vs one process: max |dw| {max_diff(after1, after2):.2e}, step moved {moved:.2e}")
    assert max_diff(after1, after2) < TOL, max_diff(after1, after2)


def test_sharded_checkpoint_resumes_on_another_rank_count(actors):
    """2 ranks save -> 1 rank loads (bit-identical weights; the optimizer state too: the next steps agree) -> 1 rank
    saves -> 2 ranks load."""
    two, one, tmp = actors["two"], actors["one"], actors["tmp"]
    two.save_checkpoint(str(tmp / "ckpt2")).wait()
    assert sorted(p.name for p in (tmp / "ckpt2" / "actor_dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    exported = load_model(str(tmp / "ckpt2" / "model"))  # the single HF directory export
    w2, d2 = weights_of(two)
    assert max_diff({k: v for k, v in exported.state_dict().items()}, w2) == 0.0
    version = one.load_checkpoint(str(tmp / "ckpt2")).wait()[0]
    _, d1 = weights_of(one)
    assert d1 == d2 and version == two.publish_weights().wait()[0].version
    batch = make_batch(actors["model"], 8, seed=1)
    train_both(actors, [batch], step=1)
    a2, _ = weights_of(two)
    a1, _ = weights_of(one)
    assert max_diff(a1, a2) < TOL  # Adam moments restored: a fresh optimizer would differ by ~lr
    one.save_checkpoint(str(tmp / "ckpt1")).wait()
    two.load_checkpoint(str(tmp / "ckpt1")).wait()
    assert weights_of(two)[1] == weights_of(one)[1]


def test_torch_backend_refuses_several_ranks(cluster, actors):
    from m2flow.runtime import WorkerError

    with pytest.raises(WorkerError, match="set actor.backend=fsdp2"):
        ActorWorker.launch(cluster, parse_placement("actor: 0-1", 2)["actor"], make_cfg(actors["tmp"]),
                           str(actors["tmp"] / "model"))


def test_flow_with_data_parallel_groups_and_sharded_actor_resumes_on_one_rank(cluster, tmp_path):
    """Every component with 2 ranks (rollout shards prompts, reward and inference share queues, the FSDP2 actor gets a
    share of every micro-batch); then the run resumes from its sharded checkpoint with a 1-rank actor."""
    common = ["run.save_every=2", "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4",
              "data.train_size=200", "data.eval_size=20", "run.trace=false"]
    cfg = make_cfg(tmp_path, *common, "run.steps=2", "actor.backend=fsdp2",
                   "cluster.placement=rollout,reward,inference,actor: 0-1", name="dp", micro_batch=8)
    out = train(cfg, cluster)
    assert {c: len(r) for c, r in out["plan"]["placement"].items()} == {"rollout": 2, "reward": 2, "inference": 2,
                                                                       "actor": 2}
    rows = [json.loads(x) for x in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/samples"] == 32 and r["inference/samples"] == 16 for r in rows)  # per-rank mean of 32
    assert sorted(p.name for p in (tmp_path / "dp" / "checkpoints" / "step_2" / "actor_dcp").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    resumed = make_cfg(tmp_path, *common, "run.steps=3", "run.resume=true",
                       "cluster.placement=rollout,reward,inference: 0; actor: 1", name="dp", micro_batch=8)
    out = train(resumed, cluster)
    rows = [json.loads(x) for x in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["actor/samples"] == 32


def test_two_epochs_on_two_ranks_equal_one_process(cluster, actors):
    """The whole-batch path (epochs > 1): with one mini-batch each epoch sees the whole global batch, so 2 ranks (each
    with its share, 7 and 6 samples) and one process take the same two optimizer steps."""
    tmp = actors["tmp"]
    overrides = ("actor.epochs=2", "actor.micro_batch=4")
    two = ActorWorker.launch(cluster, parse_placement("actor: 0-1", 2)["actor"],
                             make_cfg(tmp, "actor.backend=fsdp2", *overrides), str(tmp / "model"))
    one = ActorWorker.launch(cluster, parse_placement("actor: 0", 2)["actor"], make_cfg(tmp, *overrides),
                             str(tmp / "model"))
    try:
        batch = make_batch(actors["model"], 13, seed=2)
        m2, m1 = train_both({"two": two, "one": one}, [batch], step=0)
        assert m1[0]["actor/samples"] == 26 and [m["actor/samples"] for m in m2] == [26, 26]  # 2 epochs x 13
        a2, a1 = weights_of(two)[0], weights_of(one)[0]
        assert max_diff(a1, a2) < 2 * TOL, max_diff(a1, a2)
    finally:
        release_all([two, one])
