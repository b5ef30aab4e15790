"""bf16 against float32 on this machine: generation (the native engine, as the rollout runs it), one training pass
(forward + backward of a GRPO batch, as the actor runs it) and the agreement of the rollout's and the trainer's
logprobs, for each training precision m2flow offers:

    fp32        model.dtype=float32
    bf16-mixed  model.dtype=bfloat16 (float32 master weights, bf16 autocast; the default for bf16)
    bf16-pure   model.dtype=bfloat16 model.mixed_precision=false (the trained weights bf16)

The rollout generates in the model dtype (float32, or bf16 for both bf16 rows). Agreement: the mean and the largest
|trainer - rollout| logprob over the response tokens of the generated batch, on-policy (the same weights), which is
what an on-policy step's `actor/logprob_diff` reports. Interleaved repeats, medians over all but the first, the
1-minute load average printed. Asserts nothing.

    python benchmarks/bf16.py                                    # ~1M (h128, 4 layers), 32 x 8 samples
    python benchmarks/bf16.py --hidden 512 --layers 6 --prompts 4 --n 4 --repeats 2   # ~20M, a small batch
    python benchmarks/bf16.py --model runs/demo/checkpoints/step_N/model             # a trained model
    python benchmarks/bf16.py --device cuda --hidden 512 --layers 6                  # on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from m2flow.engines.base import SamplingParams
from m2flow.engines.hf import init_tiny_model, load_model, load_tokenizer
from m2flow.engines.native import NativeEngine
from m2flow.engines.precision import training_precision
from m2flow.engines.train import collate, token_logprobs, token_logprobs_and_entropy

PRECISIONS = {"fp32": ("float32", True), "bf16-mixed": ("bfloat16", True), "bf16-pure": ("bfloat16", False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="an HF model directory (default: a tiny Qwen2 built from a config)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="where the models compute: cpu, cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    path = args.model or init_tiny_model(tempfile.mkdtemp(prefix="bf16_"), hidden_size=args.hidden,
                                         num_layers=args.layers, seed=0)
    tok = load_tokenizer(path)
    prompts = [tok.encode(f"{10 + i}+{i * 7 % 90 + 10}=") for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=1,
                            stop_token_ids=[tok.eos_token_id])
    engines = {dtype: NativeEngine(load_model(path, dtype=getattr(torch, dtype), device=device).eval(), max_slots=256,
                                   max_len=64 + args.max_new_tokens) for dtype in ("float32", "bfloat16")}
    trained = {name: (training_precision(*how),
                      load_model(path, dtype=training_precision(*how).weights, device=device).train())
               for name, how in PRECISIONS.items()}
    n_params = sum(p.numel() for p in trained["fp32"][1].parameters())
    gen_times = {d: [] for d in engines}
    train_times = {name: [] for name in trained}
    rollouts = {}
    for _ in range(args.repeats):  # interleaved: every variant once per repeat
        for dtype, engine in engines.items():
            t = time.perf_counter()
            out = engine.generate(prompts, params)
            gen_times[dtype].append(elapsed(t, device))
            rollouts[dtype] = [g for group in out for g in group]
        batch = on(collate([(g.prompt_ids, g.response_ids) for g in rollouts["float32"]], tok.pad_token_id), device)
        for name, (precision, model) in trained.items():
            t = time.perf_counter()
            with precision.autocast(model):
                logp, ent = token_logprobs_and_entropy(model, batch)
            (logp.sum() + 0.01 * ent.sum()).backward()
            train_times[name].append(elapsed(t, device))
            model.zero_grad(set_to_none=True)

    tokens = sum(len(g.response_ids) for g in rollouts["float32"])
    print(f"model: {n_params / 1e6:.2f}M parameters, {args.prompts} prompts x {args.n} samples, {tokens} response "
          f"tokens, {args.threads} threads on {device_name(device)}, {args.repeats} repeats "
          f"(medians of the last {args.repeats - 1}), "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'precision':<12} {'generate s':>10} {'train pass s':>13} {'logprob |diff| mean':>20} {'max':>9}")
    for name, (precision, model) in trained.items():
        rollout = rollouts[PRECISIONS[name][0]]
        mean, top = agreement(model, precision, rollout, tok.pad_token_id, device)
        print(f"{name:<12} {median(gen_times[PRECISIONS[name][0]]):>10.3f} {median(train_times[name]):>13.3f} "
              f"{mean:>20.2e} {top:>9.2e}")


def agreement(model, precision, rollout, pad_id: int, device: torch.device) -> tuple[float, float]:
    """Mean and largest |trainer - rollout| logprob over the response tokens of `rollout` (same weights)."""
    batch = on(collate([(g.prompt_ids, g.response_ids) for g in rollout], pad_id), device)
    with torch.no_grad(), precision.autocast(model):
        logp = token_logprobs(model, batch).cpu()
    diffs = torch.cat([(logp[i, len(g.prompt_ids):len(g.prompt_ids) + len(g.response_ids)]
                        - torch.tensor(g.logprobs)).abs() for i, g in enumerate(rollout)])
    return float(diffs.mean()), float(diffs.max())


def on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def elapsed(start: float, device: torch.device) -> float:
    """Seconds since `start`, once the device has finished the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def median(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


if __name__ == "__main__":
    main()
