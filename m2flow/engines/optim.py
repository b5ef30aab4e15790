"""Optimizer steps for small models, where an optimizer call's Python bookkeeping is a real share of a step.

torch.optim.Adam(fused=True).step() spends ~0.2 ms a call outside its kernel on CPU (grouping the tensors by device
and dtype, the per-group checks, the profiler hooks): 3 calls a SAC gradient step, about 5% of a 13 ms step.
`FusedAdamStep` keeps the optimizer (its state, param_groups, state_dict and load_state_dict are untouched, so
checkpoints are the same) and calls the same fused kernel on lists it gathered once: the same arithmetic, bit for
bit (tests/unit/test_optim.py checks it against Adam.step).
"""

from __future__ import annotations

import torch


class FusedAdamStep:
    """`step()`: the update `opt.step()` makes, for a torch.optim.Adam(fused=True) on CPU tensors with one param
    group and no amsgrad, weight decay, maximize or capturable (anything else: `opt.step()` itself). The first call
    (no state yet) is `opt.step()`, which creates the state; the state's tensors are gathered again when
    `opt.load_state_dict` replaced them."""

    def __init__(self, opt: torch.optim.Optimizer):
        if not isinstance(opt, torch.optim.Adam):
            raise TypeError(f"FusedAdamStep steps a torch.optim.Adam, got {type(opt).__name__}")
        self.opt, self._lists = opt, None
        g = opt.param_groups
        self.fast = (len(g) == 1 and bool(g[0].get("fused")) and not g[0]["amsgrad"] and not g[0]["weight_decay"]
                     and not g[0]["maximize"] and not g[0]["capturable"] and not g[0]["differentiable"]
                     and not g[0].get("decoupled_weight_decay", False) and not isinstance(g[0]["lr"], torch.Tensor)
                     and all(p.device.type == "cpu" for p in g[0]["params"]))

    def step(self) -> None:
        params = self.opt.param_groups[0]["params"]
        # a parameter without a gradient is skipped by Adam.step; the first step creates the state
        if not self.fast or any(p.grad is None or p not in self.opt.state for p in params):
            self.opt.step()
            return
        if self._lists is None or self._lists[0][0] is not self.opt.state[params[0]]["exp_avg"]:  # new or loaded
            state = [self.opt.state[p] for p in params]
            self._lists = ([s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state], [s["step"] for s in state])
        exp_avgs, exp_avg_sqs, steps = self._lists
        g = self.opt.param_groups[0]  # read each step: a scheduler may change the learning rate
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                           lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], weight_decay=0.0, eps=g["eps"],
                           maximize=False, grad_scale=None, found_inf=None)
