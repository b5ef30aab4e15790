"""How a policy copy (rollout, inference) takes the actor's synced weights: a whole state dict, or LoRA adapters
applied to the frozen base it keeps."""

from __future__ import annotations

from m2flow.engines.lora import AdapterReceiver
from m2flow.runtime.weights import WeightsRef, fetch, load_into


def adapter_receiver(cfg) -> AdapterReceiver | None:
    """What a policy copy (rollout, inference) needs to take adapter-only syncs: model.lora on, sync: adapters."""
    lora = cfg.model.lora
    return AdapterReceiver(lora.scaling) if lora.r and lora.sync == "adapters" else None


def load_policy(model, weights: WeightsRef, adapters: AdapterReceiver | None) -> None:
    """Load the actor's published weights into a policy copy in place: a state dict, or LoRA adapters applied to the
    frozen base that `adapters` keeps."""
    if weights.kind == "adapters":
        if adapters is None:
            raise ValueError(f"weights v{weights.version} are LoRA adapters, but this receiver keeps no base for them")
        adapters.apply(model, fetch(weights))
    else:
        load_into(model, weights)
