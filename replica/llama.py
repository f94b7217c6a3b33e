"""Compact decoder code for the Llama family (Llama, Qwen2, Qwen3, Mistral, Gemma3 text), built from an already
loaded transformers model: its config, its weights and its rotary-embedding frequencies.

It runs one packed step ``[T]`` (the runner's layout, see ``replica.model_runner``) with no batch dimension, no
attention masks and no cache objects, and its attention is the opaque op ``torch.ops.prefixserve.paged_attention``
(``replica.attention_op``), so the whole forward pass is one graph for ``torch.compile`` (``replica.compile``)::

    ids_pos [2, T] (token ids; positions) -> embed -> N x [ RMSNorm -> qkv (one Linear) -> (q/k RMSNorm) -> RoPE ->
        paged_attention op -> o_proj -> residual -> RMSNorm -> gate_up (one Linear) -> act(gate) * up -> down ->
        residual ] -> rows logits_index -> RMSNorm -> lm_head -> float32 logits [S, vocab]

Weights are shared with the source model (same tensors) except q/k/v and gate/up, which are concatenated into one
matrix each (one GEMM instead of three / two). The arithmetic follows transformers' own modeling code operation by
operation (RMSNorm casts, RoPE as ``x * cos + rotate_half(x) * sin`` with cos/sin computed exactly as the model's
rotary module does from its ``inv_freq`` and ``attention_scaling``, the same scaling and sliding window per layer), so
float32 logits match transformers to rounding. Gemma3 adds the (1 + w) RMSNorm, the embedding scale, the sandwich
norms around attention and MLP, per-layer-type RoPE and the final logit soft-capping.

Other architectures, and Llama-family variants this code does not reproduce (rope types whose frequencies depend on
the sequence length, partial rotary, attention logit soft-capping, bidirectional attention), return a reason from
``unsupported_reason`` and keep the transformers path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import replica.attention_op  # noqa: F401  (registers torch.ops.prefixserve.paged_attention)
from replica import cpu_kernels

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}


def names_compact_architecture(config_json: dict | None) -> bool:
    """Whether a checkpoint's config.json (``model_loader.read_config_json``) names an architecture of
    ``ARCHITECTURES`` (read before the model loads, to start what only a compiled forward needs:
    ``replica.compile.start_isa_probe``); True where it names none or could not be read (``unsupported_reason`` decides
    once the model is loaded)."""
    names = (config_json or {}).get("architectures") or []
    return not isinstance(names, list) or not names or any(name in ARCHITECTURES for name in names)


PACKED_FROM_ROWS = 4
"""Where linear layers hold packed oneDNN weights, inputs of this many rows or more use them, smaller ones the
small-row kernel (its streaming path for 1-3 rows on AVX-512 measured 0.5-0.9x oneDNN's time there, level or slower
at 4: BENCHMARKS.md section 0k)."""
PACKED_FROM_ROWS_AVX2 = 17
"""The same on CPUs without AVX-512 (``cpu_kernels.packed_gemm_from_few_rows`` False): the small-row kernel keeps every
input it takes (float32: up to 16 rows, ``kMaxFloatRows`` in ``csrc/small_linear.cpp``), and the packed weights take
the larger ones instead of MKL."""
PAIRS_BELOW_ROWS = 17
"""Where linear layers also hold their weights in pair layout (``cpu_kernels.pack_pairs``: bfloat16 on CPUs with
AVX512-BF16, float32 on CPUs with AVX-512), inputs of fewer rows than this (float32: from 2 rows) run the pair kernel,
before the packed oneDNN weights or the small-row kernel are considered. bfloat16: 0.65-0.82x the best other path's
time at 1-8 rows on the Zen 4 box, 0.78-0.85x at 9-16 (``benchmarks/linear_rows.py``, BENCHMARKS.md section 0n); on
the Zen 5 box 0.65-0.93x at 1-12 rows, 0.87-0.93x at 13-16 (section 0zd). float32 on the Zen 5 box: 0.78-0.95x at
2-16 rows (section 0ze)."""
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
"""Rope types whose inverse frequencies are fixed at construction (``dynamic`` and ``longrope`` change them with the
sequence length, which a packed batch of sequences of different lengths cannot reproduce)."""


def unsupported_reason(model: nn.Module) -> str | None:
    """None when ``CompactCausalLM.from_hf(model)`` reproduces the model; otherwise why not."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"architecture {name} has no compact implementation"
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return f"{name} does not have the expected model.layers / model.rotary_emb structure"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping is not supported by the paged attention"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not causal"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    rope_types = inner.rotary_emb.rope_type
    rope_types = rope_types.values() if isinstance(rope_types, dict) else [rope_types]
    for rope_type in rope_types:
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r} depends on the sequence length"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            return "attention module without q/k/v/o projections"
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "MLP module without gate/up/down projections"
        inv_freq = _rope_inv_freq(inner.rotary_emb, _layer_type(config, layer.self_attn.layer_idx))[0]
        if 2 * inv_freq.numel() != attn.head_dim:
            return "partial rotary embeddings"
    return None


def _layer_type(config, layer_idx: int) -> str | None:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_idx] if layer_types else None


def _rope_inv_freq(rotary_emb: nn.Module, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """The rotary module's inverse frequencies and attention scaling (per layer type for Gemma3)."""
    if isinstance(rotary_emb.rope_type, dict):
        return getattr(rotary_emb, f"{layer_type}_inv_freq"), getattr(rotary_emb, f"{layer_type}_attention_scaling")
    return rotary_emb.inv_freq, rotary_emb.attention_scaling


def _frozen(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return None if tensor is None else nn.Parameter(tensor.detach(), requires_grad=False)


def _cat_linear(*linears: nn.Linear) -> tuple[nn.Parameter, nn.Parameter | None]:
    """One weight (and bias) for several Linears reading the same input: output features concatenated in order."""
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    if all(linear.bias is None for linear in linears):
        return _frozen(weight), None
    bias = torch.cat([
        linear.bias.detach() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
        for linear in linears
    ])
    return _frozen(weight), _frozen(bias)


class RMSNorm(nn.Module):
    """transformers' RMSNorm, both flavours: Llama ``w * norm(x).to(dtype)``, Gemma ``(norm(x) * (1 + w)).to(dtype)``."""

    def __init__(self, source: nn.Module, gemma: bool) -> None:
        super().__init__()
        self.weight = _frozen(source.weight)
        self.eps = float(getattr(source, "variance_epsilon", None) or getattr(source, "eps"))
        self.gemma = gemma
        self.fused = self.weight.is_cuda and not gemma
        """CUDA: ATen's fused RMSNorm, one kernel where the formula below launches eight (float32: the same formula;
        bfloat16: rounded once, at the end, where transformers rounds before the weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear_kernel(weight: torch.Tensor) -> bool:
    """Whether this model's linear layers call ``cpu_kernels.linear`` (float32 and bfloat16 on CPU, kernels built).
    The op takes inputs of a few rows itself (a decode batch, a short prompt: up to 16 float32 rows, 8 bfloat16) and
    hands larger ones to ``at::linear``, so one graph serves every step. ATen's float32 GEMM (MKL) packs the weight
    matrix on every call, and oneDNN's bfloat16 GEMMs spend as long on their call and tile set-up; with 1-8 rows
    either costs more than streaming the weights once (``benchmarks/linear_rows.py``). Where oneDNN can pack the
    dtype (``cpu_kernels.packed_gemm_pays``) each layer also holds its weight packed for it, which takes inputs of
    ``PACKED_FROM_ROWS`` rows or more on AVX-512 CPUs and ``PACKED_FROM_ROWS_AVX2`` on others: a second copy of the
    linear weights, kept because the kernel still wins at few rows."""
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()


def _packed(weight: torch.Tensor, pack: bool) -> torch.Tensor | None:
    """``weight`` packed for oneDNN's GEMM (``cpu_kernels.pack_linear_weight``) when ``pack``, else None."""
    return cpu_kernels.pack_linear_weight(weight) if pack else None


def _pairs(weight: torch.Tensor, pairs: bool) -> torch.Tensor | None:
    """``weight`` in the pair kernel's layout (``cpu_kernels.pack_pairs``) when ``pairs``, else None."""
    return cpu_kernels.pack_pairs(weight) if pairs else None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: bool,
            packed: torch.Tensor | None = None, packed_from_rows: int = 0, pairs: torch.Tensor | None = None,
            pairs_below_rows: int = 0) -> torch.Tensor:
    if kernel:
        return torch.ops.prefixserve_cpu.linear(x, weight, bias, True, packed, packed_from_rows, pairs,
                                                pairs_below_rows)
    return F.linear(x, weight, bias)


class DecoderLayer(nn.Module):
    def __init__(self, source: nn.Module, layer_idx: int, config, gemma: bool, rope_index: int, pack: bool,
                 pairs: bool = False) -> None:
        super().__init__()
        attn, mlp = source.self_attn, source.mlp
        self.layer_idx = layer_idx
        self.rope_index = rope_index
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = float(attn.scaling)
        if hasattr(attn, "sliding_window"):
            window = attn.sliding_window
        else:  # Mistral reads the window from its config in every layer
            window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        self.sliding_window = int(window or 0)
        self.input_norm = RMSNorm(source.input_layernorm, gemma)
        self.qkv_weight, self.qkv_bias = _cat_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv_packed = _packed(self.qkv_weight, pack)
        self.qkv_pairs = _pairs(self.qkv_weight, pairs)
        self.q_norm = RMSNorm(attn.q_norm, gemma) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = RMSNorm(attn.k_norm, gemma) if getattr(attn, "k_norm", None) is not None else None
        self.o_weight, self.o_bias = _frozen(attn.o_proj.weight), _frozen(attn.o_proj.bias)
        self.o_packed = _packed(self.o_weight, pack)
        self.o_pairs = _pairs(self.o_weight, pairs)
        self.post_attention_norm = RMSNorm(source.post_attention_layernorm, gemma)
        self.sandwich = gemma
        if gemma:  # post_attention_norm normalizes the attention output; these wrap the MLP
            self.pre_feedforward_norm = RMSNorm(source.pre_feedforward_layernorm, gemma)
            self.post_feedforward_norm = RMSNorm(source.post_feedforward_layernorm, gemma)
        self.gate_up_weight, self.gate_up_bias = _cat_linear(mlp.gate_proj, mlp.up_proj)
        self.gate_up_packed = _packed(self.gate_up_weight, pack)
        self.gate_up_pairs = _pairs(self.gate_up_weight, pairs)
        self.intermediate = mlp.gate_proj.out_features
        self.down_weight, self.down_bias = _frozen(mlp.down_proj.weight), _frozen(mlp.down_proj.bias)
        self.down_packed = _packed(self.down_weight, pack)
        self.down_pairs = _pairs(self.down_weight, pairs)
        self.act_fn = mlp.act_fn
        self.joint_rope = self.qkv_weight.is_cuda and self.q_norm is None and self.k_norm is None
        """CUDA: rotate queries and keys as one tensor (half the kernels, the same values)."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: bool, packed_from_rows: int,
                pairs_below_rows: int = 0) -> torch.Tensor:
        num_tokens = h.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        residual = h
        x = self.input_norm(h)
        qkv = _linear(x, self.qkv_weight, self.qkv_bias, kernel, self.qkv_packed, packed_from_rows, self.qkv_pairs,
                      pairs_below_rows)
        v = qkv[:, q_size + kv_size :].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.joint_rope:
            qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        attn = torch.ops.prefixserve.paged_attention(q, k, v, self.layer_idx, self.scaling, self.sliding_window)
        out = _linear(attn.view(num_tokens, q_size), self.o_weight, self.o_bias, kernel, self.o_packed,
                      packed_from_rows, self.o_pairs, pairs_below_rows)
        if self.sandwich:
            h = residual + self.post_attention_norm(out)
            x = self.pre_feedforward_norm(h)
        else:
            h = residual + out
            x = self.post_attention_norm(h)
        gate_up = _linear(x, self.gate_up_weight, self.gate_up_bias, kernel, self.gate_up_packed, packed_from_rows,
                          self.gate_up_pairs, pairs_below_rows)
        mlp_out = _linear(
            self.act_fn(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :],
            self.down_weight,
            self.down_bias,
            kernel,
            self.down_packed,
            packed_from_rows,
            self.down_pairs,
            pairs_below_rows,
        )
        if self.sandwich:
            mlp_out = self.post_feedforward_norm(mlp_out)
        return h + mlp_out


class CompactCausalLM(nn.Module):
    """``forward(ids_pos [2, T] int64, logits_index [S] int64) -> float32 logits [S, vocab]`` for one packed step;
    attention reads the step's metadata from ``replica.attention_op.forward_context``."""

    def __init__(self, model: nn.Module, reserved_bytes: int = 0) -> None:
        """``reserved_bytes``: memory the replica will take besides the model (its KV pool), which extra weight copies
        must leave (``cpu_kernels.weight_copies_fit``)."""
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no compact implementation: {reason}")
        config = model.config
        inner = model.model
        gemma = ARCHITECTURES[type(model).__name__] == "gemma3"
        self.embed_weight = _frozen(inner.embed_tokens.weight)
        self.linear_kernel = linear_kernel(self.embed_weight)
        """``linear_kernel``; the benchmarks switch it (a compiled forward then compiles a graph per setting)."""
        lm_head = model.get_output_embeddings()
        # what one extra copy of the linear weights takes (``pack`` and ``pairs`` each make one), and what the build
        # takes anyway besides ``reserved_bytes``: the fused QKV and gate/up matrices (the source's stay alive)
        copy_bytes = sum(p.nbytes for p in inner.layers.parameters() if p.dim() == 2) + lm_head.weight.nbytes
        fused_bytes = sum(linear.weight.nbytes for layer in inner.layers
                          for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                         layer.mlp.gate_proj, layer.mlp.up_proj))
        reserved = reserved_bytes + fused_bytes
        pack = (self.linear_kernel and cpu_kernels.packed_gemm_pays(self.embed_weight.dtype)
                and cpu_kernels.weight_copies_fit(copy_bytes, "packed oneDNN weight copies", reserved))
        few_rows = cpu_kernels.packed_gemm_from_few_rows()
        self.packed_from_rows = (PACKED_FROM_ROWS if few_rows else PACKED_FROM_ROWS_AVX2) if pack else 0
        """Inputs of this many rows or more run on the packed weights (``cpu_kernels.linear``; a graph constant)."""
        pairs = (self.linear_kernel and cpu_kernels.pair_linear_pays(self.embed_weight.dtype)
                 and cpu_kernels.weight_copies_fit(copy_bytes * (2 if pack else 1), "pair-layout weight copies"
                                                   + (" beside the packed ones" if pack else ""), reserved))
        self.pairs_below_rows = PAIRS_BELOW_ROWS if pairs else 0
        """Inputs of fewer rows run the pair kernel on weights in pair layout (a graph constant; 0: none)."""
        embed_scale = getattr(inner.embed_tokens, "embed_scale", None)
        if embed_scale is not None:
            self.register_buffer("embed_scale", embed_scale.detach().to(self.embed_weight.dtype), persistent=False)
        else:
            self.embed_scale = None
        # one (inv_freq, attention_scaling) per distinct rope of the model; each layer points at its own
        ropes: list[tuple[torch.Tensor, float]] = []
        rope_of_layer: list[int] = []
        for layer_idx in range(len(inner.layers)):
            inv_freq, scaling = _rope_inv_freq(inner.rotary_emb, _layer_type(config, layer_idx))
            for index, (seen, seen_scaling) in enumerate(ropes):
                if seen is inv_freq and seen_scaling == scaling:
                    rope_of_layer.append(index)
                    break
            else:
                ropes.append((inv_freq, scaling))
                rope_of_layer.append(len(ropes) - 1)
        for index, (inv_freq, _) in enumerate(ropes):
            self.register_buffer(f"inv_freq_{index}", inv_freq.detach().float().clone(), persistent=False)
        self.rope_scalings = [float(scaling) for _, scaling in ropes]
        self.layers = nn.ModuleList(
            DecoderLayer(layer, layer_idx, config, gemma, rope_of_layer[layer_idx], pack, pairs)
            for layer_idx, layer in enumerate(inner.layers)
        )
        self.layer_sequence = tuple(self.layers)
        """The layers as a tuple, which the forward iterates: iterating the ModuleList makes Dynamo guard the order of
        its module dict's keys, a guard a stored graph cannot carry (``replica.compile.PrecompiledForward``)."""
        self.norm = RMSNorm(inner.norm, gemma)
        self.lm_head_weight = _frozen(lm_head.weight)  # the embedding itself when the source ties them
        self.lm_head_bias = _frozen(getattr(lm_head, "bias", None))
        self.lm_head_packed = _packed(self.lm_head_weight, pack)
        self.lm_head_pairs = _pairs(self.lm_head_weight, pairs)
        softcap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(softcap) if softcap else None

    def forward(self, ids_pos: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        kernel, packed_from_rows, pairs_below_rows = self.linear_kernel, self.packed_from_rows, self.pairs_below_rows
        h = F.embedding(ids_pos[0], self.embed_weight)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        positions = ids_pos[1].float()
        rope = []
        for index, attention_scaling in enumerate(self.rope_scalings):
            freqs = positions[:, None] * getattr(self, f"inv_freq_{index}")[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * attention_scaling).to(h.dtype)[:, None, :]  # [T, 1, D]: broadcast over heads
            sin = (emb.sin() * attention_scaling).to(h.dtype)[:, None, :]
            rope.append((cos, sin))
        for layer in self.layer_sequence:
            cos, sin = rope[layer.rope_index]
            h = layer(h, cos, sin, kernel, packed_from_rows, pairs_below_rows)
        h = self.norm(h.index_select(0, logits_index))  # row-wise: normalizing only the sampled rows is the same
        logits = _linear(h, self.lm_head_weight, self.lm_head_bias, kernel, self.lm_head_packed, packed_from_rows,
                         self.lm_head_pairs, pairs_below_rows)
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits.float()
