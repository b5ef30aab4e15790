"""Generation throughput: the native engine vs HF `generate` on identical prompts, beside the machine's matmul limit.

Models are built from configs (random weights, no download): tiny (~1M params) and small (~20M). Both engines sample at
temperature 1 with no stop tokens, so every sequence makes exactly `--new` tokens. Prints one table.

    python benchmarks/generation.py [--models tiny 20M] [--batches 64 256] [--prompt 16] [--new 32]
                                    [--samples 1] [--repeats 2] [--threads N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import transformers

from m2flow.engines.base import SamplingParams
from m2flow.engines.native import NativeEngine

VOCAB = 260  # the char-level tokenizer of m2flow's tiny models (256 bytes + 4 specials)
MODELS = {  # name -> Qwen2 config kwargs, shaped like `init_tiny_model` (tied embeddings, GQA, MLP 4x hidden)
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "20M": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=5, num_attention_heads=8,
                num_key_value_heads=2),
}


def matmul_gflops(clock, n: int = 2048, repeats: int = 5) -> float:
    """fp32 GFLOP/s of an n x n torch.matmul (best of `repeats`): the machine's practical compute limit."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b, clock) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=True,
                                   **MODELS[name])
    return transformers.Qwen2ForCausalLM(cfg).eval()


def run_hf(model, prompts: torch.Tensor, new: int, samples: int = 1) -> None:
    model.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None,
        num_return_sequences=samples,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell (best is kept)")
    ap.add_argument("--samples", type=int, default=1, help="samples per prompt (batch / samples distinct prompts)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both engines (0: torch's default)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or process CPU time (use with --threads 1 when other jobs share the CPU)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter  # cpu: this process's CPU time
    if args.threads:
        torch.set_num_threads(args.threads)

    limit = matmul_gflops(clock)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; "
          f"fp32 matmul limit (2048^3 torch.matmul): {limit:.0f} GFLOP/s")
    print(f"prompts {args.prompt} tokens, {args.samples} sample(s) each, {args.new} new tokens per sample, "
          f"temperature 1.0; batch = sequences; best of {args.repeats}")
    header = f"{'model':>6} {'params':>7} {'batch':>5} | {'HF tok/s':>9} {'native tok/s':>12} {'speedup':>7} | " \
             f"{'HF %lim':>7} {'native %lim':>11}"
    print(header)
    print("-" * len(header))
    for name in args.models:
        model = build(name)
        n_params = sum(p.numel() for p in model.parameters())
        n_embed = model.model.embed_tokens.weight.numel()
        engine = NativeEngine(model, max_slots=max(args.batches))
        for batch in args.batches:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(1, model.config.vocab_size, (batch // args.samples, args.prompt), generator=g)
            plist = prompts.tolist()
            params = SamplingParams(n=args.samples, max_new_tokens=args.new, temperature=1.0, seed=0)
            run_hf(model, prompts[:8], 4)  # warm-up
            engine.generate(plist[:8], SamplingParams(max_new_tokens=4))
            t_hf = t_nat = math.inf
            for _ in range(args.repeats):  # interleaved, so both see the same machine load
                t_hf = min(t_hf, _timed(lambda: run_hf(model, prompts, args.new, args.samples), clock))
                t_nat = min(t_nat, _timed(lambda: engine.generate(plist, params), clock))
            n_seq = len(plist) * args.samples
            tokens = n_seq * args.new
            # matmul FLOPs of one sequence: body weights on every token, the (tied) head on each new token;
            # attention, sampling and prefill sharing not counted
            flops = 2 * n_seq * ((n_params - n_embed) * (args.prompt + args.new) + n_embed * args.new)
            pct_hf, pct_nat = (100 * flops / t / 1e9 / limit for t in (t_hf, t_nat))
            print(f"{name:>6} {n_params / 1e6:6.1f}M {batch:>5} | {tokens / t_hf:9.0f} {tokens / t_nat:12.0f} "
                  f"{t_hf / t_nat:6.1f}x | {pct_hf:6.1f}% {pct_nat:10.1f}%")


if __name__ == "__main__":
    main()
