"""The training forward + backward of one GRPO batch: m2flow's loss path against TRL's, same model and batch.
m2flow runs each micro-batch size twice: every sample forwarded whole (as TRL does), and "shared" (each group's
prompt forwarded once, `actor.share_prompts`).

Answers "is m2flow's training compute slower than TRL's?" apart from everything else in a step. One process,
interleaved repeats (trl, m2flow at each micro-batch size, trl, ...), medians over all but the first repeat, the
1-minute load average printed. The batch: `--prompts` 2-digit addition prompts x `--n` responses of 2..`--max-new-tokens`
random tokens, the model a tiny Qwen2 built from a config (`--hidden`, `--layers`).

    python benchmarks/train_compute.py                            # h128 / 4 layers, 32 x 8 samples, 2 threads
    python benchmarks/train_compute.py --hidden 512 --layers 6    # the ~20M-parameter model
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch

from m2flow.engines.hf import init_tiny_model, load_model, load_tokenizer
from m2flow.engines.train import collate, token_logprobs_and_entropy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[32, 256], help="m2flow actor.micro_batch sizes")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError as e:
        raise SystemExit(f"TRL is not installed ({e}); `make bench` installs it") from None

    torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp(prefix="train_compute_")
    init_tiny_model(path, hidden_size=args.hidden, num_layers=args.layers, seed=0)
    tok, model = load_tokenizer(path), load_model(path).train()
    rng = random.Random(0)
    samples = []
    for _ in range(args.prompts):
        prompt = tok(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", add_special_tokens=False)["input_ids"]
        samples += [(prompt, [rng.randint(3, model.config.vocab_size - 1) for _ in range(rng.randint(2, args.max_new_tokens))])
                    for _ in range(args.n)]
    batch = collate(samples, tok.pad_token_id)  # m2flow: right-padded prompt + response

    # TRL: left-padded prompts, right-padded completions, logits of the completion only
    B, P, C = len(samples), max(len(p) for p, _ in samples), max(len(r) for _, r in samples)
    prompt_ids, prompt_mask = torch.full((B, P), tok.pad_token_id), torch.zeros((B, P), dtype=torch.long)
    completion_ids, completion_mask = torch.full((B, C), tok.pad_token_id), torch.zeros((B, C), dtype=torch.long)
    for i, (p, r) in enumerate(samples):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = torch.tensor(p), 1
        completion_ids[i, :len(r)], completion_mask[i, :len(r)] = torch.tensor(r), 1

    def trl() -> None:
        ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=C + 1).logits[:, :-1, :]
        logps = selective_log_softmax(logits[:, -C:], completion_ids)
        (-(logps * completion_mask).sum() / completion_mask.sum()).backward()

    def m2flow(micro: int, share: bool) -> None:
        for i in range(0, B, micro):
            part = {k: v[i:i + micro] for k, v in batch.items()}
            logps, _ = token_logprobs_and_entropy(model, part, entropy_grad=False, share_prompts=share)
            (-(logps * part["response_mask"]).sum() / batch["response_mask"].sum()).backward()

    paths = {"TRL (selective_log_softmax)": trl,
             **{f"m2flow micro_batch={m}{' shared' if share else ''}": (lambda m=m, share=share: m2flow(m, share))
                for m in args.micro_batches for share in (False, True)}}
    seconds: dict[str, list[float]] = {k: [] for k in paths}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, fn in paths.items():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t)
    params = sum(p.numel() for p in model.parameters())
    print(f"fwd+bwd of {B} samples (m2flow length {batch['input_ids'].shape[1]}, TRL {P + C}), {params / 1e6:.2f}M "
          f"parameters, {args.threads} threads; load avg {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    for name, s in seconds.items():
        print(f"  {name:30s} median {statistics.median(s[1:]):.3f} s   ({', '.join(f'{x:.3f}' for x in s)})")


if __name__ == "__main__":
    main()
