"""HF model directory, HFEngine generation contract, and the training-side logprobs/collate/SFT."""

import json
import random
import time

import pytest
import torch

from m2flow.engines import train as train_mod
from m2flow.engines.base import SamplingParams
from m2flow.engines.hf import HFEngine, init_tiny_model, load_model, load_tokenizer
from m2flow.engines.train import collate, sft, token_logprobs, token_logprobs_and_entropy
from m2flow.reasoning.tasks.synthetic import arithmetic


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far more steadily on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture()
def model(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "moe", arch="qwen2_moe", seed=0)


def _prompts(tok):
    return [tok(p)["input_ids"] for p in ("12+34=", "5*6=", "1234567+89=")]  # different lengths: left padding


# ---------------------------------------------------------------------------------------------- model directory


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_moe"])
def test_tiny_model_dir_round_trips(tmp_path, arch):
    d = init_tiny_model(tmp_path / arch, arch=arch, hidden_size=32, num_heads=4, num_kv_heads=2)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (d / name).is_file(), name
    tok, model = load_tokenizer(d), load_model(d)
    ids = tok("12+34=")["input_ids"]
    assert len(ids) == 6 and tok.convert_ids_to_tokens(ids) == list("12+34=")
    text = "Q: 12 + 34 = ?\nA: 46."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == model.config.eos_token_id == 2
    assert tok.pad_token_id == model.config.pad_token_id == 0
    assert tok.decode([tok.eos_token_id]) == "<eos>"
    assert tok.chat_template is None
    assert json.loads((d / "config.json").read_text())["model_type"] == arch
    out = HFEngine(model, tok).generate([ids], SamplingParams(max_new_tokens=4, temperature=0))
    assert len(out[0][0].response_ids) == 4


def test_same_seed_same_weights(tmp_path):
    a = load_model(init_tiny_model(tmp_path / "a", seed=3))
    b = load_model(init_tiny_model(tmp_path / "b", seed=3))
    c = load_model(init_tiny_model(tmp_path / "c", seed=4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(empty)


# ---------------------------------------------------------------------------------------------- HFEngine


def test_greedy_is_deterministic(model, tok):
    engine = HFEngine(model, tok)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0)
    a = engine.generate(_prompts(tok), params)
    b = engine.generate(_prompts(tok), params)
    assert [[g.response_ids for g in grp] for grp in a] == [[g.response_ids for g in grp] for grp in b]
    assert all(grp[0].response_ids == grp[1].response_ids for grp in a)


def test_seeded_sampling_is_reproducible(model, tok):
    engine = HFEngine(model, tok)
    params = lambda seed: SamplingParams(n=2, max_new_tokens=8, seed=seed)
    ids = lambda seed: [g.response_ids for grp in engine.generate(_prompts(tok), params(seed)) for g in grp]
    assert ids(1) == ids(1)
    assert ids(1) != ids(2)
    assert ids(None) != ids(None)  # unseeded calls keep drawing from the global RNG


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_training_forward(model, tok, temperature):
    engine = HFEngine(model, tok)
    params = SamplingParams(n=2, max_new_tokens=10, temperature=temperature, seed=0, stop_token_ids=[tok.eos_token_id])
    gens = [g for grp in engine.generate(_prompts(tok), params) for g in grp]
    batch = collate([(g.prompt_ids, g.response_ids) for g in gens], tok.pad_token_id)
    with torch.no_grad():
        train_lp = token_logprobs(model, batch, temperature=temperature)
    for b, g in enumerate(gens):
        P, R = len(g.prompt_ids), len(g.response_ids)
        assert len(g.logprobs) == R
        diff = (train_lp[b, P : P + R] - torch.tensor(g.logprobs)).abs().max().item()
        assert diff < 1e-4, (b, diff)


def test_stop_tokens_end_responses(model, tok):
    engine = HFEngine(model, tok)
    vocab = list(range(len(tok)))
    everything = engine.generate(_prompts(tok), SamplingParams(n=2, max_new_tokens=8, stop_token_ids=vocab, seed=0))
    for grp in everything:
        for g in grp:
            assert len(g.response_ids) == 1 and g.finish_reason == "stop"
    stops = vocab[::3]  # a third of the vocabulary: some samples stop early, some may not
    gens = [g for grp in engine.generate(_prompts(tok), SamplingParams(n=4, max_new_tokens=8, stop_token_ids=stops, seed=0)) for g in grp]
    assert any(g.finish_reason == "stop" and len(g.response_ids) < 8 for g in gens)
    for g in gens:
        assert not any(t in stops for t in g.response_ids[:-1])  # cut right after the first stop token
        assert g.finish_reason == ("stop" if g.response_ids[-1] in stops else "length")
        assert g.finish_reason == "stop" or len(g.response_ids) == 8
        assert len(g.logprobs) == len(g.response_ids)
    free = engine.generate(_prompts(tok), SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=0))
    assert all(grp[0].finish_reason == "length" and len(grp[0].response_ids) == 8 for grp in free)


def test_groups_and_callback_per_prompt(model, tok):
    engine = HFEngine(model, tok, chunk_size=2)
    prompts = _prompts(tok)
    seen = []
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=5, seed=0), on_group_done=lambda i, grp: seen.append((i, grp)))
    assert [i for i, _ in seen] == [0, 1, 2]
    assert len(out) == 3
    for i, grp in enumerate(out):
        assert seen[i][1] is grp
        assert [g.sample_index for g in grp] == [0, 1, 2]
        assert all(g.prompt_index == i and g.prompt_ids == list(prompts[i]) for g in grp)


def test_update_weights_in_place(tmp_path, model, tok):
    engine = HFEngine(model, tok)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=0)
    flat = lambda out: [(g.response_ids, g.logprobs) for grp in out for g in grp]
    before = flat(engine.generate(_prompts(tok), params))
    other_model = load_model(init_tiny_model(tmp_path / "other", seed=123))
    ptr = model.model.embed_tokens.weight.data_ptr()
    engine.update_weights(other_model.state_dict())
    assert engine.model is model and model.model.embed_tokens.weight.data_ptr() == ptr
    after = flat(engine.generate(_prompts(tok), params))
    assert after != before
    assert after == flat(HFEngine(other_model, tok).generate(_prompts(tok), params))
    embed_only = {"model.embed_tokens.weight": torch.zeros_like(model.model.embed_tokens.weight)}
    engine.update_weights(embed_only)  # a partial dict updates only its keys; the tied lm_head follows
    assert torch.equal(model.lm_head.weight, embed_only["model.embed_tokens.weight"])
    assert torch.equal(model.model.norm.weight, other_model.model.norm.weight)
    with pytest.raises(KeyError, match="unknown keys \\['bogus'\\]"):
        engine.update_weights({"bogus": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------- training side


def test_collate_alignment_by_hand():
    batch = collate([([5, 6], [7, 8, 9]), ([4], [3])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    with pytest.raises(ValueError, match="empty prompt"):
        collate([([], [1])], pad_id=0)


def test_token_logprobs_and_entropy_vs_naive_loop(model):
    samples = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13])]
    batch = collate(samples, pad_id=0)
    T = 0.7
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(model, batch, temperature=T)
        assert torch.allclose(lp, token_logprobs(model, batch, temperature=T))
        for b, (prompt, response) in enumerate(samples):
            seq = prompt + response
            assert lp[b, : len(prompt)].abs().sum() == 0 and lp[b, len(seq) :].abs().sum() == 0
            for t in range(len(prompt), len(seq)):
                logits = model(torch.tensor([seq[:t]])).logits[0, -1] / T
                dist = torch.log_softmax(logits, -1)
                assert abs(lp[b, t].item() - dist[seq[t]].item()) < 1e-5
                assert abs(ent[b, t].item() + (dist.exp() * dist).sum().item()) < 1e-5


class WithoutLogitsToKeep(torch.nn.Module):
    """An HF-style causal LM whose forward has no `logits_to_keep`: the full logits, sliced afterwards."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)


def test_logits_of_the_prompt_prefix_are_never_computed_and_change_nothing(model):
    """Prompts of 4 and 3 tokens: the logits start at position 2 (the first that predicts a response token); the
    result equals the full-logits computation, with and without `logits_to_keep` in the model's forward."""
    samples = [([5, 6, 7, 4], [8, 9]), ([10, 3, 2], [11, 12, 13])]
    batch = collate(samples, pad_id=0)
    assert train_mod._first_needed(batch) == 2
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), -1)
        want = torch.zeros_like(batch["response_mask"])
        want[:, 1:] = full[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        want *= batch["response_mask"]
        assert train_mod._logits(model, batch, 2).shape[1] == batch["input_ids"].shape[1] - 2
        torch.testing.assert_close(token_logprobs(model, batch), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(token_logprobs(WithoutLogitsToKeep(model), batch), want, rtol=0, atol=1e-5)
    lp, ent = token_logprobs_and_entropy(model, batch, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    assert token_logprobs_and_entropy(model, batch)[1].requires_grad


def _groups(seed: int, prompts: int, max_n: int, vocab: int = 50) -> list:
    """`prompts` random prompts of 1..7 tokens, each with 1..max_n responses of 0..5 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randint(3, vocab) for _ in range(rng.randint(1, 7))]
        out += [(prompt, [rng.randint(3, vocab) for _ in range(rng.randint(0, 5))]) for _ in range(rng.randint(1, max_n))]
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_prompts_shared_in_one_pass_give_the_plain_logprobs_entropy_and_gradients(arch, request):
    """Groups of responses to one prompt (prompts of 1..7 tokens, empty responses among them): forwarding each distinct
    prompt once and the responses against its cached keys/values gives the plain pass's logprobs, entropy and
    gradients (to float rounding), and sends fewer tokens through the model: the shared part once per prompt. A
    mixture of experts too (its router picks experts per token, whichever pass the token is in)."""
    model = request.getfixturevalue("model") if arch == "qwen2" else load_model(request.getfixturevalue("moe_dir"))
    samples = _groups(seed=0, prompts=6, max_n=5)
    batch = collate(samples, pad_id=0)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    params = list(model.parameters())
    for T in (1.0, 0.7):
        seen.clear()
        plain = token_logprobs_and_entropy(model, batch, T)
        plain_tokens = sum(seen)
        seen.clear()
        shared = token_logprobs_and_entropy(model, batch, T, share_prompts=True)
        shared_tokens = sum(seen)
        for a, b in zip(plain, shared):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        for ga, gb in zip(torch.autograd.grad((plain[0] * 3 + plain[1]).sum(), params),
                          torch.autograd.grad((shared[0] * 3 + shared[1]).sum(), params)):
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(token_logprobs(model, batch, T, share_prompts=True), plain[0], rtol=0, atol=1e-5)
    hook.remove()
    prompts = {tuple(p) for p, _ in samples}
    shared_width = max(len(p) for p in prompts) - 1
    own = sorted(1 + len(r) for _, r in samples)  # the prompt's last token and the response, per row
    ends = train_mod.length_buckets(own)
    assert shared_tokens == len(prompts) * shared_width + sum((hi - lo) * own[hi - 1]
                                                              for lo, hi in zip([0, *ends], ends))
    assert plain_tokens == len(samples) * batch["input_ids"].shape[1]
    assert shared_tokens < 0.75 * plain_tokens


def test_length_buckets_by_hand():
    """Rows sorted by width go into passes padded to their widest row; one more pass costs 5% of the one-pass tokens."""
    assert train_mod.length_buckets([]) == []
    assert train_mod.length_buckets([3, 3, 3, 3]) == [4]
    # one pass: 12 x 9 = 108 (+5.4); two: 10 x 2 + 2 x 9 = 38 (+10.8)
    assert train_mod.length_buckets([2] * 10 + [9] * 2) == [10, 12]
    # one pass: 6 x 20 = 120 (+6); two: 3 x 19 + 3 x 20 = 117 (+12) saves less than the pass costs
    assert train_mod.length_buckets([19] * 3 + [20] * 3) == [6]
    assert train_mod.length_buckets([4, 4, 5, 5]) == [2, 4]  # 20 (+1) against 18 (+2)
    # a width is never split between passes
    assert train_mod.length_buckets([2, 2, 2, 9, 9, 9]) == [3, 6]
    assert train_mod.length_buckets([2] * 10 + [9] * 2, pass_cost=1.0) == [12]


def test_prompt_sharing_steps_aside_where_it_saves_nothing_or_the_model_takes_no_cache(model):
    """No prompt repeated, or only one-token prompts: the plain pass. A model whose forward takes no KV cache: the
    plain pass too, with the same results."""
    distinct = collate([([5, 6, 7], [8, 9]), ([10, 4], [11, 12, 13])], pad_id=0)
    one_token = collate([([5], [8, 9]), ([5], [11])], pad_id=0)
    assert train_mod.shared_prompt_logits(model, distinct) is None
    assert train_mod.shared_prompt_logits(model, one_token) is None
    grouped = collate(_groups(seed=1, prompts=3, max_n=4), pad_id=0)
    assert train_mod.shared_prompt_logits(model, grouped) is not None
    assert train_mod.shared_prompt_logits(WithoutLogitsToKeep(model), grouped) is None
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(WithoutLogitsToKeep(model), grouped, share_prompts=True),
                                   token_logprobs(model, grouped), rtol=0, atol=1e-5)
    # responses of one length: one pass over them, against the cache's own rows
    even = collate([([5, 6, 7], [8, 9]), ([5, 6, 7], [10, 11]), ([4, 3], [12, 13]), ([4, 3], [9, 9])], pad_id=0)
    parts = train_mod.shared_prompt_logits(model, even)
    assert len(parts) == 1 and parts[0].rows.tolist() == [0, 1, 2, 3]
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, even, share_prompts=True), token_logprobs(model, even),
                                   rtol=0, atol=1e-5)


def test_logprob_math_gives_the_same_values_in_one_piece_and_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, 11, generator=g)
    ids = torch.randint(0, 11, (5, 6), generator=g)
    one = train_mod._shifted_stats(logits, ids, 0.7, True)                      # 5 x 6 x 11 floats: one chunk
    rows = train_mod._shifted_stats(logits, ids, 0.7, True, chunk_bytes=1)     # one row at a time
    for a, b in zip(one, rows):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    naive = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(one[0][:, 1:], naive)


def test_sft_lowers_loss_on_arithmetic(model, tok):
    pairs = [(r["prompt"], r["solution"]) for r in arithmetic(500, seed=0)]
    start = time.time()
    losses = sft(model, tok, pairs, steps=60, batch_size=32, lr=3e-3, seed=0, progress=False, warmup_steps=5)
    assert len(losses) == 60 and time.time() - start < 60
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)


def test_batch_exact_match_counts_rows_whose_every_response_token_is_the_argmax():
    batch = collate([([1, 2], [3, 4]), ([1], [5, 6, 7]), ([1, 2, 3], [8])], pad_id=0)  # L = 4; row 2 ends padded
    L, V = batch["input_ids"].shape[1], 10
    logits = torch.zeros(3, L, V)
    logits[:, :-1].scatter_(-1, batch["input_ids"][:, 1:, None], 1.0)  # logits at t predict the token at t + 1
    assert train_mod.batch_exact_match(logits, batch) == 1.0
    logits[0, 0, 9] = 2.0  # a prompt position of row 0 (predicts the prompt's 2): not scored
    logits[2, 3, 9] = 2.0  # row 2's padding: not scored
    assert train_mod.batch_exact_match(logits, batch) == 1.0
    logits[1, 2, 9] = 2.0  # row 1's last answer token (7, predicted at 2) is not the argmax
    assert train_mod.batch_exact_match(logits, batch) == pytest.approx(2 / 3)
    assert train_mod.batch_exact_match(logits[:, 1:], batch, start=1) == pytest.approx(2 / 3)  # from `_logits(.., 1)`


def test_sft_stops_at_its_target_accuracy_where_greedy_decoding_answers_as_often(model, tok):
    """A target accuracy ends the warm start early; the exact match it reads off the training pass is what greedy
    decoding answers exactly."""
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    losses = sft(model, tok, pairs, steps=400, batch_size=32, lr=3e-3, seed=0, progress=False, target_accuracy=0.3)
    assert 10 <= len(losses) < 400
    encoded = [(tok(p)["input_ids"], tok(a)["input_ids"] + [tok.eos_token_id]) for p, a in pairs]
    with torch.no_grad():
        teacher_forced = train_mod.batch_exact_match(train_mod._logits(model, collate(encoded, tok.eos_token_id)),
                                                     collate(encoded, tok.eos_token_id))
    out = HFEngine(model, tok).generate([p for p, _ in encoded], SamplingParams(max_new_tokens=3, temperature=0))
    greedy = sum(g[0].response_ids[:len(a)] == a for g, (_, a) in zip(out, encoded)) / len(pairs)  # answer, eos
    assert teacher_forced == pytest.approx(greedy, abs=1e-6) and 0.2 <= greedy < 1, (greedy, teacher_forced)
    with pytest.raises(ValueError, match="target_accuracy must be in \\[0, 1\\], got 1.5"):
        sft(model, tok, pairs, steps=1, target_accuracy=1.5, progress=False)


def test_sft_stops_when_greedy_decoding_answers_the_held_back_pairs_as_often(model, tok):
    """With `val_pairs` the target is read every `val_every` steps off the held-back pairs (which it never trains
    on), and `exact_match` is what greedy decoding answers exactly on them."""
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    train, held_back = pairs[::2] + pairs[1::4], pairs[3::4]
    losses = sft(model, tok, train, steps=400, batch_size=32, lr=3e-3, seed=0, progress=False, target_accuracy=0.3,
                 val_pairs=held_back, val_every=5)
    assert 5 <= len(losses) < 400 and len(losses) % 5 == 0
    reached = train_mod.exact_match(model, tok, held_back)
    encoded = [(tok(p)["input_ids"], tok(a)["input_ids"] + [tok.eos_token_id]) for p, a in held_back]
    out = HFEngine(model, tok).generate([p for p, _ in encoded], SamplingParams(max_new_tokens=3, temperature=0))
    greedy = sum(g[0].response_ids[:len(a)] == a for g, (_, a) in zip(out, encoded)) / len(held_back)
    assert reached == pytest.approx(greedy, abs=1e-6) and 0.3 <= greedy < 1, (greedy, reached)


def test_the_native_engine_hands_a_mixture_of_experts_to_hf_generate(moe_dir):
    """The native engine runs dense Qwen2 and Llama: for another model HF generate takes over with a warning, except
    where multi-turn tool rollouts need the native engine (an error naming why)."""
    from m2flow.reasoning.workers.rollout import build_engine

    model, tok = load_model(moe_dir).eval(), load_tokenizer(moe_dir)
    with pytest.warns(UserWarning, match="this one is 'qwen2_moe': generating with HF generate instead"):
        assert isinstance(build_engine("native", model, tok, 64, 32), HFEngine)
    with pytest.raises(ValueError, match="agent.tools needs it: multi-turn tool rollouts cannot fall back"):
        build_engine("native", model, tok, 64, 32, tools=True)
