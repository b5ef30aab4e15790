"""NativeEngine vs HF: greedy token identity, logprobs vs the training forward, sampling, stops, continuous batching."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from m2flow.engines.base import SamplingParams
from m2flow.engines.native import NativeEngine, sample_tokens

VOCAB = 96


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads, and on a shared CPU thread barriers cost more than the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(arch: str, seed: int = 0):
    """A tiny random model; a large init range makes logits peaked, so greedy has no near-ties."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
    if arch == "qwen2":  # q/k/v bias, tied embeddings
        cfg = transformers.Qwen2Config(hidden_size=32, tie_word_embeddings=True, rope_theta=1000.0, **common)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    # llama: no bias, untied head, head_dim * heads != hidden_size
    cfg = transformers.LlamaConfig(hidden_size=48, head_dim=16, tie_word_embeddings=False, **common)
    return transformers.LlamaForCausalLM(cfg).eval()


def make_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


MIXED = (5, 1, 9, 3, 12, 7)


def hf_greedy(model, prompts, new):
    """HF generate on the whole batch, left-padded with an attention mask."""
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[:, T:].tolist()


def hf_logprobs(model, prompt, response, temperature=1.0):
    """The training forward's logprobs of `response` given `prompt` (one unpadded sequence)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def tokens(results):
    return [[g.response_ids for g in group] for group in results]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_hf_generate(arch):
    model = make_model(arch)
    prompts = make_prompts(MIXED)
    expected = hf_greedy(model, prompts, new=12)
    # fewer slots than requests: continuous batching and slot compaction are on the path
    results = NativeEngine(model, max_slots=4).generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=0))
    for i, group in enumerate(results):
        assert [g.response_ids for g in group] == [expected[i], expected[i]]
        assert all(g.finish_reason == "length" and g.prompt_ids == prompts[i] for g in group)
    # greedy logprobs are those of the temperature-1 policy
    g = results[2][0]
    torch.testing.assert_close(torch.tensor(g.logprobs), hf_logprobs(model, g.prompt_ids, g.response_ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,temperature", [("qwen2", 1.0), ("llama", 0.7)])
def test_logprobs_match_training_forward(arch, temperature):
    model = make_model(arch)
    prompts = make_prompts(MIXED, seed=2)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=temperature, seed=0)
    # a small prefill budget splits the admitted prompts into several prefill forwards
    results = NativeEngine(model, max_slots=5, prefill_tokens=16).generate(prompts, params)
    worst = 0.0
    for group in results:
        for g in group:
            assert len(g.logprobs) == len(g.response_ids) == 10
            ref = hf_logprobs(model, g.prompt_ids, g.response_ids, temperature)
            worst = max(worst, (torch.tensor(g.logprobs) - ref).abs().max().item())
    assert worst < 1e-4


def test_sampler_matches_the_distribution():
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(0)).repeat(100_000, 1)
    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        toks, logprobs = sample_tokens(logits, SamplingParams(temperature=temperature), g)
        probs = (logits[0] / temperature).softmax(-1)
        assert (torch.bincount(toks, minlength=8) / len(toks) - probs).abs().max() < 0.01
        torch.testing.assert_close(logprobs, probs.log()[toks])
    toks, logprobs = sample_tokens(logits, SamplingParams(top_k=3), g)
    assert set(toks.tolist()) == set(logits[0].topk(3).indices.tolist())
    torch.testing.assert_close(logprobs, logits[0].log_softmax(-1)[toks])  # untruncated policy


def test_seeded_sampling_is_reproducible():
    engine = NativeEngine(make_model("qwen2"), max_slots=4)
    prompts = make_prompts(MIXED)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=123)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert tokens(a) == tokens(b)
    assert [[g.logprobs for g in grp] for grp in a] == [[g.logprobs for g in grp] for grp in b]
    c = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=124))
    assert tokens(c) != tokens(a)
    assert tokens(a)[0][0] != tokens(a)[0][1] or tokens(a)[1][0] != tokens(a)[1][1]  # samples differ


def test_top_k_1_and_tiny_top_p_equal_greedy():
    engine = NativeEngine(make_model("llama"), max_slots=3)
    prompts = make_prompts(MIXED)
    greedy = tokens(engine.generate(prompts, SamplingParams(n=2, max_new_tokens=10, temperature=0)))
    top_k = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=10, temperature=1.3, top_k=1, seed=5))
    top_p = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=5))
    assert tokens(top_k) == greedy
    assert tokens(top_p) == greedy


def test_stop_tokens_end_sequences():
    model = make_model("qwen2")
    engine = NativeEngine(model, max_slots=8)
    prompts = make_prompts(MIXED)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    stop = free[0][0].response_ids[3]
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop]))
    for f, s in zip(free, stopped):
        full, got = f[0].response_ids, s[0]
        if stop in full:  # ends at (and includes) the first stop token
            assert got.response_ids == full[: full.index(stop) + 1] and got.finish_reason == "stop"
            assert len(got.logprobs) == len(got.response_ids)
        else:
            assert got.response_ids == full and got.finish_reason == "length"
    assert stopped[0][0].response_ids == free[0][0].response_ids[: free[0][0].response_ids.index(stop) + 1]
    # sampling: a stop token only ever appears last
    stops = list(range(1, 20))
    sampled = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, stop_token_ids=stops, seed=0))
    for group in sampled:
        for g in group:
            assert not set(g.response_ids[:-1]) & set(stops)
            assert g.finish_reason == ("stop" if g.response_ids[-1] in stops else "length")
            assert g.finish_reason == "stop" or len(g.response_ids) == 12


def test_continuous_batching_returns_every_request_once_and_streams_groups():
    engine = NativeEngine(make_model("llama"), max_slots=4)
    steps = []  # count decode steps, to see that groups stream out while others still decode
    decode = engine._decode
    engine._decode = lambda *a: steps.append(1) or decode(*a)
    prompts = make_prompts((4, 2, 8, 1, 6, 3, 5))
    n = 3
    calls = []

    def on_group_done(i, group):
        calls.append((i, list(group), len(steps), torch.is_inference_mode_enabled()))

    params = SamplingParams(n=n, max_new_tokens=9, stop_token_ids=list(range(1, 12)), seed=7)
    results = engine.generate(prompts, params, on_group_done=on_group_done)
    assert len(results) == len(prompts)
    seen = [(g.prompt_index, g.sample_index) for group in results for g in group]
    assert sorted(seen) == [(i, j) for i in range(len(prompts)) for j in range(n)]
    for i, group in enumerate(results):
        assert [g.sample_index for g in group] == list(range(n)) and all(g.prompt_index == i for g in group)
    lengths = {len(g.response_ids) for group in results for g in group}
    assert len(lengths) > 1  # stop tokens made sequences finish at different steps
    assert sorted(i for i, *_ in calls) == list(range(len(prompts)))  # each group streamed exactly once
    for i, group, _, inference_mode in calls:
        assert group == results[i] and not inference_mode
    assert calls[0][2] < len(steps) // 2  # the first group left early, not at the end of generate


def test_update_weights_in_place():
    model, other = make_model("qwen2", seed=0), make_model("qwen2", seed=1)
    engine = NativeEngine(model, max_slots=4)
    prompts = make_prompts(MIXED)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = tokens(engine.generate(prompts, params))
    ptrs = [p.data_ptr() for p in model.parameters()]
    engine.update_weights(other.state_dict())
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # same tensors, new values
    after = tokens(engine.generate(prompts, params))
    assert after != before
    assert after == tokens(NativeEngine(other).generate(prompts, params))
    with pytest.raises(KeyError):
        engine.update_weights({"not.a.weight": torch.zeros(1)})


def test_rejects_too_long_requests():
    engine = NativeEngine(make_model("qwen2"), max_len=16)
    with pytest.raises(ValueError, match="max_len"):
        engine.generate(make_prompts((10,)), SamplingParams(max_new_tokens=8))


class EchoTool:
    """A ToolHook for tests: after each `trigger` token it inserts `answer` (up to `max_turns` times per sequence)
    and records its calls."""

    def __init__(self, trigger: int, answer: list[int], max_turns: int = 2):
        self.triggers, self.answer, self.max_turns, self.calls = [[trigger]], answer, max_turns, []

    def __call__(self, i, j, response):
        self.calls.append((i, j, list(response)))
        turns = sum(1 for t in response if t == self.triggers[0][0])
        return list(self.answer) if turns <= self.max_turns else None


def hf_greedy_with_tool(model, prompt, new, tool):
    """The reference: HF greedy one token at a time; after a trigger token, the tool's answer is appended."""
    response, mask, turns = [], [], 0
    while len(response) < new:
        with torch.no_grad():
            token = int(model(torch.tensor([prompt + response])).logits[0, -1].argmax())
        response.append(token)
        mask.append(1)
        if token == tool.triggers[0][0]:
            turns += 1
            if turns <= tool.max_turns:
                answer = tool.answer[: new - len(response)]
                response += answer
                mask += [0] * len(answer)
    return response, mask


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_multi_turn_greedy_with_a_tool_equals_a_step_by_step_reference(arch):
    """A tool's answer is fed into the sequence after each trigger (loss mask 0, logprob 0) while the other
    sequences decode on; the tokens equal HF greedy run step by step with the answer appended."""
    model = make_model(arch)
    prompts = make_prompts(MIXED)
    plain = NativeEngine(model, max_slots=4).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0))
    trigger = max({t for g in plain for t in g[0].response_ids[:8]}, key=lambda t: sum(
        t in g[0].response_ids[:8] for g in plain))  # a token most sequences write early
    tool = EchoTool(trigger, [t for t in range(3, 9) if t != trigger][:5])  # no trigger inside the answer
    got = NativeEngine(model, max_slots=4).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0),
                                                    tool_hook=tool)
    called = 0
    for p, group in zip(prompts, got):
        want, mask = hf_greedy_with_tool(model, p, 24, tool)
        g = group[0]
        assert g.response_ids == want and g.loss_mask == mask
        assert all(lp == 0.0 for lp, m in zip(g.logprobs, mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(g.logprobs, mask) if m == 1)
        called += mask.count(0) > 0
    assert called >= 3 and tool.calls  # the tool answered in several sequences


def test_a_tool_answer_is_cut_at_the_token_budget_and_plain_generation_has_no_mask():
    model = make_model("qwen2")
    prompts = make_prompts((4,))
    first = NativeEngine(model).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))[0][0]
    assert first.loss_mask is None
    tool = EchoTool(first.response_ids[0], list(range(10, 40)))
    got = NativeEngine(model).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0), tool_hook=tool)[0][0]
    assert got.response_ids == [first.response_ids[0], *range(10, 15)] and got.loss_mask == [1, 0, 0, 0, 0, 0]
    assert got.finish_reason == "length"


class SlowEcho(EchoTool):
    """EchoTool whose answers come `delay` seconds later, from threads (as a tool in its own process would)."""

    def __init__(self, trigger, answer, delay: float):
        super().__init__(trigger, answer)
        self.delay, self.pool = delay, ThreadPoolExecutor(max_workers=16)

    def __call__(self, i, j, response):
        answer = super().__call__(i, j, response)
        return self.pool.submit(lambda: (time.sleep(self.delay), answer)[1])


def test_answers_that_come_later_give_the_same_sequences_while_the_others_decode_on():
    """A hook that returns futures: each sequence waits for its answer (feeding nothing new) while the others
    decode; the tokens, masks and logprobs equal those of answers given at once, and the waits overlap."""
    model = make_model("qwen2")
    prompts = make_prompts(MIXED)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    plain = NativeEngine(model, max_slots=4).generate(prompts, params)
    trigger = plain[0][0].response_ids[1]
    answer = [t for t in range(3, 9) if t != trigger][:4]
    now = NativeEngine(model, max_slots=4).generate(prompts, params, tool_hook=EchoTool(trigger, answer))
    slow = SlowEcho(trigger, answer, delay=0.2)
    start = time.monotonic()
    later = NativeEngine(model, max_slots=4).generate(prompts, params, tool_hook=slow)
    seconds = time.monotonic() - start
    answered = sum(g[0].loss_mask.count(0) > 0 for g in later)
    assert answered >= 2
    for a, b in zip(now, later):
        assert a[0].response_ids == b[0].response_ids and a[0].loss_mask == b[0].loss_mask
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-5)
    calls = len(slow.calls)
    assert seconds < 0.7 * calls * 0.2, (seconds, calls)  # not one wait after another


def test_sampled_multi_turn_output_does_not_depend_on_when_answers_come_nor_on_batching():
    """With a tool hook each draw is a hash of (seed, request, position): sampled sequences are the same whether the
    answers come at once or 0.05 s later, and whatever the number of slots."""
    model = make_model("qwen2")
    prompts = make_prompts(MIXED)
    params = SamplingParams(n=2, max_new_tokens=20, temperature=1.0, seed=3)
    plain = NativeEngine(model).generate(prompts, params)
    trigger = plain[0][0].response_ids[0]
    answer = [t for t in range(3, 9) if t != trigger][:3]
    runs = [NativeEngine(model, max_slots=slots).generate(prompts, params, tool_hook=hook) for slots, hook in
            [(16, EchoTool(trigger, answer)), (16, SlowEcho(trigger, answer, 0.05)), (3, EchoTool(trigger, answer))]]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert [g.response_ids for g in a] == [g.response_ids for g in b]
            assert [g.loss_mask for g in a] == [g.loss_mask for g in b]
    assert sum(g.loss_mask.count(0) > 0 for group in runs[0] for g in group) >= 2
