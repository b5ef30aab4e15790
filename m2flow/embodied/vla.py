"""A tiny vision-language-action policy (`policy.kind=vla`) for ManiSkill3's pixel observations: the task camera's
frame (and the hand camera's, env.wrist_camera), the robot's proprioception and the task's instruction
(m2flow.embodied.envs.maniskill.pixel_layout).

The model is a small HF causal LM (Llama, sizes from the `vla` config section) over a prefix of embeddings: the
frames' patches (a two-layer convolutional stem the cameras share, one token per patch of each frame), the
proprioception (one token), the instruction's words (one token each; padding masked out) and a learned readout
token. Two action heads, as users of this field train VLAs:

- `GaussianVLA` (`vla.head=gaussian`): the readout token's last hidden state feeds a Gaussian head over an action
  chunk and the value head (in RL with its gradient stopped: `ValueGradient`), the ActorCritic interface PPO and GRPO
  use for every other policy.
- `TokenVLA` (`vla.head=tokens`): OpenVLA's discrete actions. Each action dimension is cut into `vla.bins` equal bins
  over the action space's bounds; a chunk of k actions of A dimensions is k x A action tokens, which the LM's head
  decodes one after another (each fed back as the next input, through the LM's key-value cache). An action is its
  bin's centre; its log-probability is the sum of its tokens' (what RLinf's PPO and GRPO on OpenVLA train with), and
  training recomputes the tokens' logits in one teacher-forced pass. Its value head reads the readout token's state
  as the Gaussian's does.

Both value heads (`VLAValue`) are a linear map of the readout token's state, to which `vla.value_hidden` adds a small
MLP over the proprioception and the episode's progress; the action heads never read the progress.

Pure torch modules: they never step an env and hold no loss.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from m2flow.embodied.envs.packed import PackedLayout
from m2flow.embodied.policies import ActorCritic, _linear, _mlp, gumbel_noise

HEADS = ("gaussian", "tokens")


class VLAEncoder(nn.Module):
    """Packed pixel observations -> the LM's hidden states over [frame patches; state; words; readout] (+ action
    tokens fed back, for the token head)."""

    def __init__(self, layout: PackedLayout, vocab: int, *, dim: int = 64, layers: int = 2, heads: int = 4,
                 patch: int = 16, action_tokens: int = 1):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel  # the reasoning wing's backbones: imported when built

        for name in ("rgb", "state", "progress", "instruction"):
            if name not in layout.fields:
                raise ValueError(f"policy.kind=vla reads packed pixel observations with a {name!r} field "
                                 f"(env.pixels=true on a ManiSkill3 task), got fields {sorted(layout.fields)}")
        channels, size, _ = layout.fields["rgb"].shape
        if channels % 3:
            raise ValueError(f"policy.kind=vla reads RGB frames (3 channels each), got {channels} channels")
        if patch % 4 or size % patch:
            raise ValueError(f"vla.patch={patch} must be a multiple of 4 dividing env.image_size={size}")
        if dim % heads:
            raise ValueError(f"vla.dim={dim} must be a multiple of vla.heads={heads}")
        self.layout, self.vocab, self.views = layout, vocab, channels // 3
        # one stem for every camera's frame; each view's patches have their own position embeddings
        self.vision = nn.Sequential(nn.Conv2d(3, dim // 2, 4, stride=4), nn.GELU(),
                                    nn.Conv2d(dim // 2, dim, patch // 4, stride=patch // 4))
        self.patches = self.views * (size // patch) ** 2
        self.vision_pos = nn.Parameter(torch.zeros(1, self.patches, dim))
        self.state = nn.Linear(layout.fields["state"].shape[0], dim)
        self.words = nn.Embedding(vocab, dim, padding_idx=0)
        self.readout = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.normal_(self.vision_pos, std=0.02)
        nn.init.normal_(self.readout, std=0.02)
        length = self.patches + 2 + layout.fields["instruction"].shape[0] + action_tokens
        # its token embeddings are the action tokens' (the token head's inputs); the prefix comes as embeddings
        self.lm = LlamaModel(LlamaConfig(vocab_size=max(action_tokens, 1), hidden_size=dim, intermediate_size=4 * dim,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=heads, max_position_embeddings=max(length, 8),
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                         attn_implementation="sdpa"))

    def prefix(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs [B, nbytes] packed rows -> (embeddings [B, P, dim], attention mask [B, P]: 0 at padding words)."""
        x = self.layout.unpack(torch.as_tensor(obs, device=self.readout.device))
        b = x["rgb"].shape[0]
        ids = x["instruction"].long()
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.vocab):
            raise ValueError(f"VLA: word ids outside [0, {self.vocab}): not ManiSkill3 pixel observations")
        rgb = x["rgb"].reshape(b * self.views, 3, *x["rgb"].shape[2:])  # [B * views, 3, H, W]
        frame = self.vision(rgb.float() / 255.0).flatten(2).transpose(1, 2).reshape(b, self.patches, -1)
        frame = frame + self.vision_pos
        parts = [frame, self.state(x["state"].float())[:, None], self.words(ids), self.readout.expand(b, 1, -1)]
        mask = torch.cat([torch.ones(b, self.patches + 1, dtype=torch.long), (ids != 0).long(),
                          torch.ones(b, 1, dtype=torch.long)], 1)
        return torch.cat(parts, 1), mask

    def value_inputs(self, obs: torch.Tensor) -> torch.Tensor:
        """obs [B, nbytes] packed rows -> what the value MLP reads beside the readout state: [proprioception;
        progress] [B, STATE_DIM + 1]."""
        x = self.layout.unpack(torch.as_tensor(obs, device=self.readout.device))
        return torch.cat([x["state"].float(), x["progress"].float()], 1)

    def run(self, embeds: torch.Tensor, mask: torch.Tensor, past=None):
        """The LM over `embeds` (after `past`, its cache) -> (last hidden states [B, len, dim], the cache)."""
        out = self.lm(inputs_embeds=embeds, attention_mask=mask, cache=past, use_cache=past is not None)
        return out.last_hidden_state, out.cache


class VLAValue(nn.Linear):
    """The value head: a linear map of the readout token's state (the first `dim` inputs, the weight and bias of
    this Linear) plus a tanh MLP (`hidden`, vla.value_hidden; none if empty) over the proprioception and the
    episode's progress (the rest, `VLAEncoder.value_inputs`). The readout's state says what the frames show; the
    progress says how many steps are left, which a return under a step limit depends on (PixelObservation). The
    MLP's last layer starts near 0: the value starts as the linear head's."""

    def __init__(self, dim: int, aux: int, hidden: tuple[int, ...] = ()):
        super().__init__(dim, 1)
        nn.init.orthogonal_(self.weight, 1.0)
        nn.init.zeros_(self.bias)
        self.mlp = nn.Sequential(*_mlp(aux, tuple(hidden), nn.Tanh), _linear(hidden[-1], 1, gain=0.01)) \
            if hidden else None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        v = nn.functional.linear(z[:, :self.in_features], self.weight, self.bias)
        return v if self.mlp is None else v + self.mlp(z[:, self.in_features:])


class ValueGradient:
    """Whether the value loss trains the encoder, or only the value head (`critic_in` stops its gradient).

    In RL it does not (`value_trains_encoder` False, the default): sharing it, PPO from a pixel clone on PickCube
    spent its updates on the critic's first large errors (a value loss of 40-130 against a policy loss of ~0.01, one
    gradient clipped to one norm), and its KL limit stopped each epoch after 2-4 minibatches that had moved the policy
    without improving it: sampled success fell from 44% to 6% in 9 iterations. In behaviour cloning it does
    (`bc.fit` turns it on): regressing the demonstrations' returns, which on the dense reward say how far the gripper
    is from the cube and the cube from the goal, teaches the encoder where they are; without it the same clone
    succeeded in 0 of 100 held-out episodes instead of 39 (docs/results/vla.md, 2026-12-06)."""

    value_trains_encoder = False

    def critic_in(self, h: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        """The value head's input: the readout state h (detached unless value_trains_encoder), then value_inputs
        where the head has its MLP (without it nothing else is unpacked)."""
        h = h if self.value_trains_encoder else h.detach()
        return h if self.critic_head.mlp is None else torch.cat([h, self.encoder.value_inputs(obs)], 1)


class GaussianVLA(ValueGradient, ActorCritic):
    """`VLAEncoder`'s readout state -> the Gaussian action head (an action chunk with env.chunk) and the value head."""

    def __init__(self, layout: PackedLayout, action_space: spaces.Space, vocab: int, *, chunk: int = 1,
                 log_std_init: float = 0.0, dim: int = 64, layers: int = 2, heads: int = 4, patch: int = 16,
                 value_hidden: tuple[int, ...] = ()):
        if not isinstance(action_space, spaces.Box):
            raise ValueError(f"policy.kind=vla acts in a Box, got {action_space}")
        super().__init__(action_space, dim, dim, chunk, log_std_init)
        self.encoder = VLAEncoder(layout, vocab, dim=dim, layers=layers, heads=heads, patch=patch)
        self.critic_head = VLAValue(dim, value_dims(layout), value_hidden)

    def features(self, obs):
        embeds, mask = self.encoder.prefix(obs)
        h = self.encoder.run(embeds, mask)[0][:, -1]
        return h, self.critic_in(h, obs)


class TokenVLA(ValueGradient, nn.Module):
    """OpenVLA-style action tokens: `bins` per action dimension, k x A tokens a chunk, decoded autoregressively by
    the LM head; the value head reads the readout token. act / evaluate / value / sample as ActorCritic's."""

    def __init__(self, layout: PackedLayout, action_space: spaces.Space, vocab: int, *, chunk: int = 1,
                 bins: int = 32, dim: int = 64, layers: int = 2, heads: int = 4, patch: int = 16,
                 value_hidden: tuple[int, ...] = ()):
        super().__init__()
        if not isinstance(action_space, spaces.Box) or not np.isfinite(action_space.low).all() \
                or not np.isfinite(action_space.high).all():
            raise ValueError(f"vla.head=tokens bins a bounded Box's actions, got {action_space}")
        if bins < 2:
            raise ValueError(f"vla.bins must be >= 2, got {bins}")
        self.action_space, self.chunk, self.bins = action_space, chunk, bins
        self.act_shape = tuple(action_space.shape)
        self.n_tokens = chunk * math.prod(self.act_shape)
        self.encoder = VLAEncoder(layout, vocab, dim=dim, layers=layers, heads=heads, patch=patch,
                                  action_tokens=bins)
        self.lm_head = _linear(dim, bins, gain=0.01)  # near-uniform over the bins at the start
        self.critic_head = VLAValue(dim, value_dims(layout), value_hidden)
        self.register_buffer("low", torch.tensor(np.array(action_space.low, np.float32)).reshape(-1), False)
        self.register_buffer("high", torch.tensor(np.array(action_space.high, np.float32)).reshape(-1), False)

    # -- actions <-> tokens --------------------------------------------------------------------------------------------
    def to_actions(self, index: torch.Tensor) -> torch.Tensor:
        """index [B, n_tokens] -> actions [B, (k,) *act]: each token's bin centre."""
        lo, hi = self._bounds()
        a = lo + (index.float() + 0.5) * (hi - lo) / self.bins
        return a.view(len(index), *((self.chunk,) if self.chunk > 1 else ()), *self.act_shape)

    def to_index(self, actions: torch.Tensor) -> torch.Tensor:
        """actions [B, (k,) *act] -> their bins [B, n_tokens] (a bin centre maps back to its own bin)."""
        lo, hi = self._bounds()
        u = (actions.reshape(len(actions), -1).float() - lo) / (hi - lo)
        return (u * self.bins).floor().clamp(0, self.bins - 1).long()

    def _bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the bounds of its action dimension ([n_tokens] each: the Box's, repeated over the chunk)."""
        return self.low.repeat(self.chunk), self.high.repeat(self.chunk)

    # -- the LM over the tokens -----------------------------------------------------------------------------------------
    def token_logits(self, obs: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing: the logits of every action token given the ones before it, in one pass -> (logits
        [B, n_tokens, bins], values [B])."""
        embeds, mask = self.encoder.prefix(obs)
        fed = self.encoder.lm.embed_tokens(index[:, :-1])
        h = self.encoder.run(torch.cat([embeds, fed], 1),
                             torch.cat([mask, torch.ones(len(index), fed.shape[1], dtype=mask.dtype)], 1))[0]
        p = embeds.shape[1]
        return self.lm_head(h[:, p - 1:]), self.critic_head(self.critic_in(h[:, p - 1], obs)).squeeze(-1)

    def decode(self, obs: torch.Tensor, gumbel: torch.Tensor | None = None):
        """Autoregressive decoding -> (index [B, n_tokens], logprob [B], values [B]). `gumbel` [B, n_tokens, bins]
        None: each token the most likely (deterministic); else argmax(log p + gumbel), an exact sample."""
        embeds, mask = self.encoder.prefix(obs)
        from transformers import DynamicCache

        cache = DynamicCache()
        h, cache = self.encoder.run(embeds, mask, cache)
        value = self.critic_head(self.critic_in(h[:, -1], obs)).squeeze(-1)
        tokens, logprob = [], torch.zeros(len(embeds))
        for j in range(self.n_tokens):
            log_p = torch.log_softmax(self.lm_head(h[:, -1]), -1)
            index = (log_p if gumbel is None else log_p + gumbel[:, j]).argmax(-1)
            logprob = logprob + log_p.gather(-1, index[:, None]).squeeze(-1)
            tokens.append(index)
            if j + 1 < self.n_tokens:
                mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], 1)
                h, cache = self.encoder.run(self.encoder.lm.embed_tokens(index[:, None]), mask, cache)
        return torch.stack(tokens, 1), logprob, value

    # -- the policy interface -------------------------------------------------------------------------------------------
    def act(self, obs: torch.Tensor, deterministic: bool = False):
        """obs [B, nbytes] -> (actions [B, (k,) *act], logprob [B], value [B]); deterministic: the likeliest tokens."""
        gumbel = None if deterministic else gumbel_noise(torch.rand(len(obs), self.n_tokens, self.bins))
        index, logprob, value = self.decode(obs, gumbel)
        return self.to_actions(index), logprob, value

    def sample(self, obs: torch.Tensor, noise_seed: int, lo: int, total: int):
        """The policy worker's sampler: Gumbel noise drawn for all `total` envs from `noise_seed` and sliced, so env
        i gets the same noise whatever stage or worker it is in."""
        u = torch.rand((total, self.n_tokens, self.bins), generator=torch.Generator().manual_seed(noise_seed))
        index, logprob, value = self.decode(obs, gumbel_noise(u[lo:lo + len(obs)]))
        return self.to_actions(index), logprob, value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """obs, actions -> (logprob [B], entropy [B], value [B]): the tokens' log-probabilities and entropies summed
        over the chunk, from one teacher-forced pass."""
        index = self.to_index(actions)
        logits, value = self.token_logits(obs, index)
        log_p = torch.log_softmax(logits, -1)
        logprob = log_p.gather(-1, index[..., None]).squeeze(-1).sum(-1)
        entropy = -(log_p.exp() * log_p).sum(-1).sum(-1)
        return logprob, entropy, value

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        embeds, mask = self.encoder.prefix(obs)
        return self.critic_head(self.critic_in(self.encoder.run(embeds, mask)[0][:, -1], obs)).squeeze(-1)

    def scale_std(self, factor: float) -> None:
        raise ValueError("policy.init_std_scale scales a Gaussian's std; vla.head=tokens samples action tokens "
                         "(leave it at 1)")


def value_dims(layout: PackedLayout) -> int:
    """How many numbers the value MLP reads (VLAEncoder.value_inputs): the proprioception's and the progress's."""
    return layout.fields["state"].shape[0] + layout.fields["progress"].shape[0]


def build_vla(layout: PackedLayout, action_space: spaces.Space, vocab: int, head: str = "gaussian", **kw):
    """`vla.head`: GaussianVLA or TokenVLA."""
    if head not in HEADS:
        raise ValueError(f"vla.head must be gaussian | tokens, got {head!r}")
    if head == "tokens":
        kw.pop("log_std_init", None)
        return TokenVLA(layout, action_space, vocab, **kw)
    kw.pop("bins", None)
    return GaussianVLA(layout, action_space, vocab, **kw)
