"""LoRA adapters through PEFT (`model.lora`). The actor's model gets the adapters injected in place (every other
weight frozen); its state then holds, per adapted module, the frozen base (`X.base_layer.weight`) and the adapters
(`X.lora_A.default.weight`, `X.lora_B.default.weight`). What leaves the actor is either the merged weights, under the
plain model's names (`merged_items`), or the adapters alone (`adapter_items`), which a receiver holding the frozen
base applies itself (`AdapterReceiver`): weight = base + scaling * B @ A, the same arithmetic on both sides, so the
merged weights agree bit for bit. Pure tensor work: no workers, no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

ADAPTER = "default"  # PEFT's name of the one adapter
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


def add_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    """Inject LoRA adapters (`lora`: the config's model.lora) into `model` in place and freeze every other weight;
    returns the PEFT wrapper (for its adapter config). The model object itself keeps its type and forward."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules)
    if getattr(model.config, "tie_word_embeddings", False) and any(t.split(".")[-1] == "lm_head" for t in targets):
        raise ValueError("model.lora.target_modules names lm_head, whose weight this model shares with its input "
                         "embedding (tie_word_embeddings): merged, the adapter would change the embedding too")
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                        target_modules="all-linear" if targets == ["all-linear"] else targets)
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module the model does not have
        raise ValueError(f"model.lora.target_modules {targets}: {e}") from None


def _merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """One adapted weight, merged (what every side computes, so that their results agree bit for bit)."""
    return base + (b.to(base) @ a.to(base)) * scaling  # in the base's dtype, on its device


def merged_items(items: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's state, (name, tensor) in sorted name order, as the plain model's state in sorted order: each
    adapted module's weight merged under its plain name (`X.weight`), its bias renamed, the adapters dropped. Works
    on a stream (e.g. a sharded model's tensors gathered one at a time): one module is held at a time."""
    module, held = None, {}

    def flush():
        if module is not None:
            if "bias" in held:
                yield f"{module}.bias", held["bias"]
            yield f"{module}.weight", _merged(held["weight"], held["A"], held["B"], scaling)

    for name, tensor in items:
        prefix, part = _split(name)
        if prefix != module:
            yield from flush()
            module, held = prefix, {}
        if prefix is None:
            yield name, tensor
        else:
            held[part] = tensor
    yield from flush()


def adapter_items(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the adapters of a LoRA model's state (their names as in the model)."""
    return ((n, t) for n, t in items if n.endswith(_A) or n.endswith(_B))


def _split(name: str) -> tuple[str | None, str]:
    """(adapted module, part: weight | bias | A | B) for a LoRA entry, (None, name) for any other."""
    if name.endswith(_A):
        return name[: -len(_A)], "A"
    if name.endswith(_B):
        return name[: -len(_B)], "B"
    if _BASE in name:
        prefix, rest = name.split(_BASE, 1)
        return prefix, rest
    return None, name


class AdapterReceiver:
    """A receiver of adapter-only weight syncs: keeps the frozen base of every adapted module (copied from the model
    at the first sync, when it still holds the base weights it was loaded with) and sets weight = base + scaling *
    B @ A at every sync."""

    def __init__(self, scaling: float):
        self.scaling = scaling
        self.base: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def apply(self, model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
        params = dict(model.named_parameters())
        modules = sorted({_split(n)[0] for n in adapters})
        if self.base is None:
            missing = [m for m in modules if f"{m}.weight" not in params]
            if missing:
                raise ValueError(f"adapters for modules this model does not have: {missing[:3]}")
            self.base = {m: params[f"{m}.weight"].detach().clone() for m in modules}
        for m in modules:
            params[f"{m}.weight"].copy_(_merged(self.base[m], adapters[m + _A], adapters[m + _B], self.scaling))


def save_adapter(peft_model, items: Iterable[tuple[str, torch.Tensor]], directory: str | Path) -> None:
    """Write the adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), which
    `peft.PeftModel.from_pretrained(base_model, directory)` loads."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config[ADAPTER].save_pretrained(str(out))
    state = {f"base_model.model.{n.replace(f'.{ADAPTER}.', '.')}": t.detach().cpu().contiguous()
             for n, t in adapter_items(items)}
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
