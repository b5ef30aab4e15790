"""FusedAdamStep makes the update Adam.step makes, bit for bit, across a checkpoint's load_state_dict."""

import copy

import pytest
import torch

from m2flow.engines.optim import FusedAdamStep


def _model_and_opt(seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True, **kw)


def _train(model, step, opt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=gen)).pow(2).mean().backward()
        step()


def test_same_update_as_adam_step_bit_for_bit_and_after_loading_state():
    ref, ref_opt = _model_and_opt()
    fast, fast_opt = _model_and_opt()
    stepper = FusedAdamStep(fast_opt)
    assert stepper.fast
    _train(ref, ref_opt.step, ref_opt, 5, seed=1)
    _train(fast, stepper.step, fast_opt, 5, seed=1)
    for a, b in zip(ref.parameters(), fast.parameters()):
        assert torch.equal(a, b)
    assert fast_opt.state_dict()["state"][0]["step"].item() == 5  # the optimizer's own state moved on
    # a checkpoint's optimizer state loaded into the optimizer replaces its tensors: the stepper follows them
    saved = copy.deepcopy(ref_opt.state_dict())
    _train(ref, ref_opt.step, ref_opt, 3, seed=2)
    fast_opt.load_state_dict(saved)
    _train(fast, stepper.step, fast_opt, 3, seed=2)
    for a, b in zip(ref.parameters(), fast.parameters()):
        assert torch.equal(a, b)
    assert [s["step"].item() for s in fast_opt.state.values()] == [8.0] * 4


def test_what_it_does_not_cover_falls_back_to_adam_step():
    model, opt = _model_and_opt(weight_decay=0.1)
    stepper = FusedAdamStep(opt)
    assert not stepper.fast
    ref, ref_opt = _model_and_opt(weight_decay=0.1)
    _train(ref, ref_opt.step, ref_opt, 3, seed=3)
    _train(model, stepper.step, opt, 3, seed=3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="steps a torch.optim.Adam, got SGD"):
        FusedAdamStep(torch.optim.SGD(model.parameters(), lr=0.1))
