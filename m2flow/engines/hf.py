"""HF transformers causal LMs: build a tiny model directory from a config, load local checkpoints, and
`HFEngine`, a `GenerationEngine` on `model.generate`. Never touches the hub and knows nothing of the runtime."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
)
from transformers.utils import logging as hf_logging

from m2flow.errors import MissingFileError
from m2flow.engines.base import Generation, GroupCallback, SamplingParams

hf_logging.disable_progress_bar()  # no per-load/save bars in worker logs; m2flow shows its own progress

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3 in every tiny tokenizer
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

_CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen2_moe": Qwen2MoeConfig}
# a tiny mixture of experts: 4 routed experts, 2 per token, and a shared expert, each of twice the hidden size
_MOE = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


# ---------------------------------------------------------------------------------------------- tiny models


# Qwen2's pre-tokenizer split. With no merges it changes no token, but it makes tokenizer.json match what
# AutoTokenizer rebuilds for model_type qwen2 (Qwen2Tokenizer), so both load paths encode identically.
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map (space -> 'Ġ', newline -> 'Ċ', printable ASCII -> itself)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def build_char_tokenizer(chars: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: one token per ASCII character, ids 0-3 are <pad> <bos> <eos> <unk>.

    The vocabulary holds the byte symbols of `chars` (all 256 bytes when None, so no text is ever unknown;
    a non-ASCII character is then several tokens). It is built like Qwen2's tokenizer (NFC, split regex,
    ByteLevel, BPE) so that `AutoTokenizer` gives the same encoding whether it loads tokenizer.json as is
    (llama) or rebuilds Qwen2Tokenizer from its vocabulary (qwen2). Nothing is added around encoded text
    (no BOS): "12+34=" encodes to exactly 6 ids.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    symbols = _byte_symbols()
    if chars is None:
        wanted = list(symbols.values())
    else:
        bad = sorted({c for c in chars if ord(c) > 127})
        if bad:
            raise ValueError(f"build_char_tokenizer: tokenizer_chars must be ASCII, got {bad}")
        wanted = [symbols[ord(c)] for c in chars]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in wanted:
        vocab.setdefault(sym, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def tiny_config(arch: str = "qwen2", hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, intermediate_size: int | None = None, max_position_embeddings: int = 256,
                vocab_size: int | None = None):
    """The HF config of the tiny model `init_tiny_model` writes (`vocab_size`: its character tokenizer's)."""
    return _CONFIGS[arch](
        vocab_size=vocab_size or len(build_char_tokenizer()),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **(dict(_MOE, moe_intermediate_size=2 * hidden_size, shared_expert_intermediate_size=2 * hidden_size)
           if arch == "qwen2_moe" else {}),
    )


def init_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tokenizer_chars: str | None = None,
) -> Path:
    """Write a real HF model directory with random weights and a character-level tokenizer; returns its path.

    The directory holds config.json, generation_config.json, model.safetensors and the tokenizer files, so
    `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it offline.
    Embeddings are tied; no chat template is set. With a restricted `tokenizer_chars`, text outside it
    encodes to <unk> (llama) or is dropped (qwen2's AutoTokenizer rebuild): keep the default for real text.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"init_tiny_model: arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"init_tiny_model: need hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0, "
            f"got hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(tokenizer_chars)
    config = tiny_config(arch, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                         max_position_embeddings, vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False, max_new_tokens=32
    )
    with _quiet_progress():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def _quiet_progress():
    """Hide transformers' progress bars for a tiny save (restores the previous setting)."""
    from transformers.utils import logging as hf_logging

    was_disabled = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not was_disabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------- loading


def _check_model_dir(path: str | Path, need_weights: bool) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise MissingFileError(f"model directory {str(p)!r} does not exist (expected a local HF model directory)")
    if not (p / "config.json").is_file():
        raise MissingFileError(f"{str(p)!r} has no config.json (expected a local HF model directory)")
    if need_weights and not any((p / f).is_file() for f in _WEIGHT_FILES):
        raise MissingFileError(f"{str(p)!r} has no weights: expected one of {', '.join(_WEIGHT_FILES)}")
    return p


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a causal LM from a local directory only (never the hub); returns the model in eval mode."""
    p = _check_model_dir(path, need_weights=True)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    """Load the tokenizer saved in a local model directory (never the hub)."""
    p = Path(path)
    if not p.is_dir():
        raise MissingFileError(f"tokenizer directory {str(p)!r} does not exist (expected a local HF model directory)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise MissingFileError(f"{str(p)!r} has no tokenizer.json / tokenizer_config.json / tokenizer.model")
    return AutoTokenizer.from_pretrained(p, local_files_only=True)


# ---------------------------------------------------------------------------------------------- engine


class _LogprobRecorder(LogitsProcessor):
    """Records log π(token) of each sampled token under log_softmax(raw_logits / temperature), memory O(B·V).

    HF runs custom processors before its sampling warpers, so `scores` here are the raw logits. The token
    sampled from step k's distribution appears as input_ids[:, -1] at step k+1; the last one is gathered
    by `finish` from the returned sequences.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev_logp: torch.Tensor | None = None  # [B, V] log-probs of the step whose token is not known yet
        self.token_logps: list[torch.Tensor] = []  # one [B] tensor per generated token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev_logp is not None:
            self.token_logps.append(self.prev_logp.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev_logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """new_tokens: [B, T] generated ids -> [B, T] their log-probs."""
        T = new_tokens.shape[1]
        logps = self.token_logps[:T]  # HF may have run (and undone) extra steps
        if len(logps) < T:
            logps.append(self.prev_logp.gather(1, new_tokens[:, len(logps) : len(logps) + 1]).squeeze(1))
        return torch.stack(logps, dim=1) if logps else new_tokens.new_zeros((new_tokens.shape[0], 0), dtype=torch.float)


class HFEngine:
    """`GenerationEngine` on HF `model.generate`: left-padded prompt batches, n samples per prompt.

    `SamplingParams` is the only source of sampling settings: the checkpoint's generation_config defaults
    (repetition penalty, top-k, ...) are replaced by neutral ones so that logprobs match the training forward.
    An empty `stop_token_ids` means no stop token (responses run to max_new_tokens).
    HF generate is not streaming: prompts are generated `chunk_size` at a time (all at once when None) and
    `on_group_done` fires for each group of a chunk as soon as that chunk is done.
    """

    def __init__(self, model, tokenizer_or_pad_id, chunk_size: int | None = None):
        self.model = model.eval()
        self.pad_id = _pad_id(tokenizer_or_pad_id)
        self.chunk_size = chunk_size
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        on_group_done: GroupCallback | None = None,
        tool_hook=None,
    ) -> list[list[Generation]]:
        if tool_hook is not None:
            raise NotImplementedError("HFEngine: multi-turn generation with tools needs rollout.engine=native")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"HFEngine.generate: prompt {i} is empty")
        chunk = self.chunk_size or max(len(prompts), 1)
        results: list[list[Generation]] = []
        # A seed gives a private, reproducible stream; without one, sampling advances the global RNG.
        seeded = params.seed is not None
        with torch.random.fork_rng(devices=_rng_devices(self.device)) if seeded else contextlib.nullcontext():
            if seeded:
                torch.manual_seed(params.seed)
            for start in range(0, len(prompts), chunk):
                groups = self._generate_chunk(prompts[start : start + chunk], start, params)
                for offset, group in enumerate(groups):
                    if on_group_done is not None:
                        on_group_done(start + offset, group)
                results.extend(groups)
        return results

    @torch.no_grad()
    def _generate_chunk(self, prompts: Sequence[Sequence[int]], first_index: int, params: SamplingParams):
        """Generate params.n samples for each prompt of a chunk -> one group (list of Generation) per prompt."""
        n = params.n
        rows = [list(p) for p in prompts for _ in range(n)]  # prompt i's samples are rows i*n .. i*n+n-1
        input_ids, attention_mask = _left_pad(rows, self.pad_id, self.device)
        greedy = params.temperature <= 0
        recorder = _LogprobRecorder(1.0 if greedy else params.temperature)
        stop_ids = [int(t) for t in params.stop_token_ids]
        sampling = {} if greedy else dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            **sampling,
        )
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
        )
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        logps = recorder.finish(new_tokens).tolist()
        new_tokens = new_tokens.tolist()
        groups = []
        for i, prompt in enumerate(prompts):
            group = []
            for j in range(n):
                row = i * n + j
                ids, finish = _cut_at_stop(new_tokens[row], set(stop_ids))
                group.append(
                    Generation(
                        prompt_index=first_index + i,
                        sample_index=j,
                        prompt_ids=list(prompt),
                        response_ids=ids,
                        logprobs=logps[row][: len(ids)],
                        finish_reason=finish,
                    )
                )
            groups.append(group)
        return groups

    def update_weights(self, state_dict: dict) -> None:
        """Copy `state_dict` (names as in `model.state_dict()`) into the model's tensors in place, cast to their
        dtype/device; a partial dict updates only its keys, unknown keys raise (as in the native engine).
        A tied lm_head shares the embedding's storage, so either name updates both."""
        own = self.model.state_dict()  # views sharing the parameters' storage
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(f"HFEngine.update_weights: unknown keys {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        with torch.no_grad():
            for key, value in state_dict.items():
                own[key].copy_(value)


def _pad_id(tokenizer_or_pad_id) -> int:
    if isinstance(tokenizer_or_pad_id, int):
        return tokenizer_or_pad_id
    tok = tokenizer_or_pad_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        raise ValueError("HFEngine: the tokenizer has neither a pad_token_id nor an eos_token_id; pass a pad id")
    return int(pad)


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """rows of ids -> input_ids [B, L] left-padded with pad_id, attention_mask [B, L] (1 on real tokens)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, L - len(r) :] = 1
    return ids.to(device), mask.to(device)


def _cut_at_stop(ids: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Keep tokens up to and including the first stop token -> (ids, "stop"); else all tokens -> (ids, "length")."""
    for t, tok in enumerate(ids):
        if tok in stop_ids:
            return ids[: t + 1], "stop"
    return ids, "length"


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []

