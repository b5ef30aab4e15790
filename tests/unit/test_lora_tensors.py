"""LoRA (model.lora) tensor work: the merged state equals the LoRA model's function and the plain model's names in
sorted order; a receiver applying the adapters to its frozen base holds the merged weights bit for bit; the adapter
directory loads with PEFT; bad settings get clear errors."""

from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel

from m2flow import config as C
from m2flow.engines.hf import init_tiny_model, load_model
from m2flow.engines.lora import AdapterReceiver, adapter_items, add_lora, merged_items, save_adapter
from m2flow.reasoning.config import ReasoningConfig
from m2flow.runtime.weights import WeightsRef, load_into, state_digest


def lora(r=4, alpha=8.0, targets=("all-linear",)):
    return SimpleNamespace(r=r, alpha=alpha, dropout=0.0, target_modules=list(targets), scaling=alpha / r)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_tiny_model(path, hidden_size=64, num_layers=2, seed=0)
    return path


def trained(base_dir, cfg):
    """A LoRA model whose adapters hold random (non-zero) values, as after training."""
    model = load_model(base_dir)
    peft = add_lora(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.1)
    return model.eval(), peft


def test_only_the_adapters_train(base_dir):
    model, _ = trained(base_dir, lora(r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 layers (not the output head)
    assert type(model).__name__ == "Qwen2ForCausalLM"  # injected in place: the flow's forward code is unchanged


def test_merged_state_is_the_plain_model_of_the_same_function(base_dir):
    model, _ = trained(base_dir, lora(r=4, alpha=8.0))
    items = list(merged_items(iter(sorted(model.state_dict().items())), 2.0))
    names = [n for n, _ in items]
    plain = load_model(base_dir).eval()
    assert names == sorted(names) == sorted(plain.state_dict())  # publish needs sorted names; no adapter left
    plain.load_state_dict(dict(items))
    x = torch.randint(3, 60, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, model(x).logits, rtol=1e-4, atol=1e-5)
    q = "model.layers.0.self_attn.q_proj"
    state = model.state_dict()
    a, b = state[f"{q}.lora_A.default.weight"], state[f"{q}.lora_B.default.weight"]
    expected = state[f"{q}.base_layer.weight"] + b @ a * 2.0
    assert torch.equal(dict(items)[f"{q}.weight"], expected)
    assert torch.equal(dict(items)[f"{q}.bias"], state[f"{q}.base_layer.bias"])


def test_a_receiver_applying_adapters_holds_the_merged_weights_bit_for_bit(base_dir):
    model, _ = trained(base_dir, lora(r=4, alpha=8.0, targets=["q_proj", "v_proj"]))
    state = sorted(model.state_dict().items())
    adapters = dict(adapter_items(iter(state)))
    assert sorted({n.split(".lora_")[0].rsplit(".", 1)[1] for n in adapters}) == ["q_proj", "v_proj"]
    receiver_model, receiver = load_model(base_dir), AdapterReceiver(2.0)
    receiver.apply(receiver_model, adapters)
    merged = dict(merged_items(iter(state), 2.0))
    assert state_digest(receiver_model.state_dict()) == state_digest(merged)
    # later syncs apply to the kept base, not on top of the last merge
    adapters2 = {n: t * 0.5 for n, t in adapters.items()}
    receiver.apply(receiver_model, adapters2)
    state = [(k, adapters2.get(k, v)) for k, v in state]
    assert state_digest(receiver_model.state_dict()) == state_digest(dict(merged_items(iter(state), 2.0)))


def test_the_adapter_directory_loads_with_peft(base_dir, tmp_path):
    model, peft = trained(base_dir, lora(r=4))
    save_adapter(peft, iter(sorted(model.state_dict().items())), tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_model(base_dir), str(tmp_path / "adapter")).eval()
    x = torch.randint(3, 60, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)


def test_bad_lora_settings_get_clear_errors(base_dir):
    with pytest.raises(ValueError, match="lm_head, whose weight this model shares with its input embedding"):
        add_lora(load_model(base_dir), lora(targets=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['nope_proj'\]"):
        add_lora(load_model(base_dir), lora(targets=["nope_proj"]))
    with pytest.raises(ValueError, match="adapters, not a state dict: this receiver cannot load them"):
        load_into(load_model(base_dir), WeightsRef(3, [], None, kind="adapters"))
    for override, message in [("model.lora.r=-1", "model.lora.r must be >= 0, got -1"),
                              ("model.lora.dropout=1.0", r"model.lora.dropout must be in \[0, 1\), got 1.0"),
                              ("model.lora.sync=full", "model.lora.sync must be adapters | merged, got 'full'"),
                              ("model.lora.target_modules=[]", "model.lora.target_modules must be a non-empty list")]:
        with pytest.raises(C.ConfigError, match=message):
            C.load(ReasoningConfig, None, [override])
