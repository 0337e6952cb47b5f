"""The decoder as trtc compiles it: Llama, Mistral, Qwen2 and Qwen3 in the step contract.

One forward call runs one step of a flattened in-flight batch (see `contract.py`). The code is
written for clarity of the exported graph: RMSNorm, rotary embedding and SwiGLU are spelled in
primitive ops that the ONNX passes then recognise and fuse; attention is the `trtc::PagedAttention`
plugin from the start, because its paged, ragged semantics have no faithful primitive spelling.
Parameter names mirror transformers', so a Hugging Face state dict loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtc.compiler.families import ModelGeometry, hf_skeleton
from trtc.plugins.all_reduce import all_reduce
from trtc.plugins.fp8_gemm import Fp8Linear
from trtc.plugins.int4_gemm import Int4Linear
from trtc.plugins.int4_gemm.reference import num_groups
from trtc.plugins.paged_attention import paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the model dtype, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Non-interleaved RoPE on ``x[T, heads*head_dim]``; ``cos/sin[T, head_dim/2]``."""
    tokens = x.shape[0]
    x = x.view(tokens, -1, head_dim)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.view(tokens, -1)


def row_parallel(linear: nn.Module, x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``linear(x)`` for a projection split by input features over ``world_size`` ranks: this
    rank's partial product, summed over the ranks by `trtc::AllReduce`, which adds the bias
    once (see `compiler/parallel.py`). One rank: the Linear as it is."""
    if world_size == 1:
        return linear(x)
    partial = F.linear(x, linear.weight) if isinstance(linear, nn.Linear) else linear(x, False)
    return all_reduce(partial, linear.bias, world_size=world_size)


class Attention(nn.Module):
    def __init__(self, g: ModelGeometry, sliding_window: int, world_size: int = 1):
        super().__init__()
        self.g, self.sliding_window, self.world_size = g, sliding_window, world_size
        self.kv_scales = (1.0, 1.0)  # (k_scale, v_scale): set for an FP8 KV cache
        self.q_proj = nn.Linear(g.hidden_size, g.num_heads * g.head_dim, bias=g.qkv_bias)
        self.k_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=g.qkv_bias)
        self.v_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=g.qkv_bias)
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.hidden_size, bias=g.o_bias)
        if g.qk_norm:
            # Qwen3: one RMSNorm over head_dim, shared by the heads, on q and on k.
            self.q_norm = RMSNorm(g.head_dim, g.rms_norm_eps)
            self.k_norm = RMSNorm(g.head_dim, g.rms_norm_eps)

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``norm`` over each head of ``x[T, heads*head_dim]``, as transformers applies it to the
        projection viewed as ``[T, heads, head_dim]``; back to 2-D, the rotary's input shape.
        The views name the head count, not the token count, so both export as constant-shape
        Reshapes (no per-layer shape arithmetic left in the graph)."""
        width, head_dim = x.shape[-1], self.g.head_dim
        return norm(x.view(-1, width // head_dim, head_dim)).view(-1, width)

    def forward(self, x, cos, sin, kv_cache, step):
        g = self.g
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if g.qk_norm:  # before the rotary embedding, as transformers' Qwen3Attention
            q, k = self._norm_heads(q, self.q_norm), self._norm_heads(k, self.k_norm)
        q = apply_rotary(q, cos, sin, g.head_dim)
        k = apply_rotary(k, cos, sin, g.head_dim)
        out, kv_cache = paged_attention(
            q,
            k,
            v,
            kv_cache,
            step["slot_mapping"],
            step["block_tables"],
            step["context_lens"],
            step["query_start_loc"],
            num_heads=g.num_heads,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            scale=g.head_dim**-0.5,
            sliding_window=self.sliding_window,
            k_scale=self.kv_scales[0],
            v_scale=self.kv_scales[1],
        )
        return row_parallel(self.o_proj, out, self.world_size), kv_cache


class MLP(nn.Module):
    def __init__(self, g: ModelGeometry, world_size: int = 1):
        super().__init__()
        self.world_size = world_size
        self.gate_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=g.mlp_bias)
        self.up_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=g.mlp_bias)
        self.down_proj = nn.Linear(g.intermediate_size, g.hidden_size, bias=g.mlp_bias)

    def forward(self, x):
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return row_parallel(self.down_proj, hidden, self.world_size)


class DecoderLayer(nn.Module):
    def __init__(self, g: ModelGeometry, layer: int, world_size: int = 1):
        super().__init__()
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.self_attn = Attention(g, g.sliding_windows[layer], world_size)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.mlp = MLP(g, world_size)

    def forward(self, x, cos, sin, kv_cache, step):
        attn, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, step)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv_cache


class Backbone(nn.Module):
    def __init__(self, g: ModelGeometry, world_size: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(g.vocab_size, g.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(g, i, world_size) for i in range(g.num_layers))
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)


class StepModel(nn.Module):
    """``forward(input_ids, positions, slot_mapping, block_tables, context_lens,
    query_start_loc, logits_indices, *kv_caches) -> (logits[L, vocab] fp32, *kv_caches)``,
    one row of logits per entry of ``logits_indices``.

    With ``world_size`` > 1 it is one tensor-parallel rank's graph: ``g`` is the rank's
    geometry (`compiler.parallel.rank_geometry`) and the row-parallel projections end in
    `trtc::AllReduce`; the logits are whole on every rank (replicated LM head)."""

    def __init__(
        self,
        g: ModelGeometry,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        world_size: int = 1,
    ):
        super().__init__()
        self.geometry = g
        self.world_size = world_size
        self.model = Backbone(g, world_size)
        if not g.tie_word_embeddings:
            self.lm_head = nn.Linear(g.hidden_size, g.vocab_size, bias=False)
        # [max_seq_len, head_dim/2], in the model dtype (transformers casts them likewise).
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        block_tables,
        context_lens,
        query_start_loc,
        logits_indices,
        *kv_caches,
    ):
        step = {
            "slot_mapping": slot_mapping,
            "block_tables": block_tables,
            "context_lens": context_lens,
            "query_start_loc": query_start_loc,
        }
        cos, sin = F.embedding(positions, self.rope_cos), F.embedding(positions, self.rope_sin)
        x = self.model.embed_tokens(input_ids)
        new_caches = []
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, kv_cache = layer(x, cos, sin, kv_cache, step)
            new_caches.append(kv_cache)
        # Only the rows that produce a next token go through the norm and the LM head.
        x = self.model.norm(torch.index_select(x, 0, logits_indices))
        head = (
            self.model.embed_tokens.weight
            if self.geometry.tie_word_embeddings
            else self.lm_head.weight
        )
        logits = F.linear(x, head).float()
        return (logits, *new_caches)


def rope_tables(config, max_seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_seq_len, head_dim/2]`` from the model's own rotary module (built
    from the config, as transformers builds it), so every rope-scaling variant transformers
    implements (linear, dynamic, yarn, llama3, ...) is honoured."""
    rotary = type(hf_skeleton(config).model.rotary_emb)(config=config)
    positions = torch.arange(max_seq_len)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].to(dtype).contiguous(), sin[0, :, :half].to(dtype).contiguous()


def step_skeleton(
    config,
    g: ModelGeometry,
    max_seq_len: int,
    dtype: torch.dtype,
    quantized=None,
    kv_scales: list[tuple[float, float]] | None = None,
    world_size: int = 1,
) -> StepModel:
    """The step model with fake tensors for weights (shapes and dtypes, no storage): what the
    exporter traces. ``quantized`` (a `QuantizationResult`) swaps the projections it holds for
    the plugin Linear modules, with empty tensors of the shapes they will have; ``kv_scales``
    gives each layer's (k_scale, v_scale) for an FP8 KV cache; ``world_size`` > 1 makes it one
    tensor-parallel rank's graph (``g`` the rank's geometry). Only the rotary tables are real.
    The weights themselves come later, from `compiler.weights.plan_weights`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cos, sin = rope_tables(config, max_seq_len, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = StepModel(g, cos, sin, world_size)
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                # Made in the build precision directly: Module.to cannot convert fake
                # parameters in place.
                empty = torch.empty(p.shape, dtype=dtype)
                setattr(module, name, nn.Parameter(empty, requires_grad=False))
        for name in quantized.linears.keys() if quantized is not None else ():
            parent, _, attr = name.rpartition(".")
            linear = model.get_submodule(name)
            plugin = _empty_plugin_linear(quantized.method, quantized.group_size, linear)
            setattr(model.get_submodule(parent), attr, plugin.to(dtype))
    for layer, scales in zip(model.model.layers, kv_scales or ()):
        layer.self_attn.kv_scales = tuple(float(s) for s in scales)
    return model.eval()


def _empty_plugin_linear(method: str, group_size: int | None, linear: nn.Linear) -> nn.Module:
    """The plugin module replacing ``linear`` (`Int4Linear` or `Fp8Linear`), its tensors empty
    with the dtypes quantization gives them (the module's ``to`` then applies the model
    dtype where its contract says so)."""
    n, k = linear.out_features, linear.in_features
    bias = None if linear.bias is None else torch.empty(n)
    if method == "fp8":
        return Fp8Linear(
            torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n), torch.empty(()), bias
        )
    groups = num_groups(k, group_size)
    return Int4Linear(
        torch.empty(n, k // 2, dtype=torch.uint8),
        torch.empty(n, groups),
        torch.empty(n, groups, dtype=torch.uint8),
        bias,
        group_size,
    )
