"""One decoder-only transformer covering Llama, Qwen2 and Qwen3 (they differ in flags).

``DecoderSpec`` names the differences: biases on the q/k/v and o projections, biases in
the MLP, and Qwen3's per-head RMSNorm on q and k before RoPE. Module names mirror the
Hugging Face checkpoints except for the packed ``qkv_proj`` and ``gate_up_proj``, which
``packed_modules_mapping`` tells the loader how to fill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata
from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend
from twinplane.dataplane.layers.activation import SiluAndMul
from twinplane.dataplane.layers.attention import Attention
from twinplane.dataplane.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from twinplane.dataplane.layers.layernorm import RMSNorm
from twinplane.dataplane.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from twinplane.dataplane.layers.rotary import RotaryEmbedding, rope_settings

if TYPE_CHECKING:
    from twinplane.kernels.rope_store import QKVRope


# On CUDA, layers of these head sizes (half a power of two) run q/k norm, RoPE and the K/V
# store as one Triton kernel, inside decode attention where the backend has that kernel;
# others, and every layer on CPU, run them one by one.
FUSED_HEAD_DIMS = (32, 64, 128, 256)


@dataclass(frozen=True)
class DecoderSpec:
    """What one architecture changes in the shared decoder, read from its HF config."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def head_dim_of(hf_config: Any) -> int:
    """``head_dim`` from the config, else hidden_size // num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


class DecoderAttention(nn.Module):
    """q/k/v projection, optional q/k norm, RoPE, paged attention, output projection."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, backend: AttentionBackend) -> None:
        super().__init__()
        total_heads, total_kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, total_heads,
                                          total_kv_heads, bias=spec.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hf_config.hidden_size, bias=spec.o_bias)
        theta, scaling = rope_settings(hf_config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, hf_config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, backend)
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps) if spec.qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden), metadata))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """q/k/v projection rows [T, (heads + 2 kv_heads) * d] -> attention output [T, heads * d]."""
        if qkv.is_cuda and self.head_dim in FUSED_HEAD_DIMS:
            return self.attn.attend_qkv(qkv, self.qkv_rope(positions), metadata)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q.flatten(1), k.flatten(1), v, metadata)

    def qkv_rope(self, positions: torch.Tensor) -> QKVRope:
        """What the fused kernels need to turn q/k/v projection rows into q and cached K/V."""
        from twinplane.kernels.rope_store import QKVRope

        q_norm, k_norm = self.q_norm, self.k_norm
        norms = (None, None, 0.0) if q_norm is None or k_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        return QKVRope(self.num_heads, self.num_kv_heads, positions, self.rotary_emb.cos_sin_cache, *norms)


class DecoderMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up packed in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, backend: AttentionBackend) -> None:
        super().__init__()
        assert getattr(hf_config, "hidden_act", "silu") == "silu", f"hidden_act {hf_config.hidden_act} unsupported"
        self.self_attn = DecoderAttention(hf_config, spec, backend)
        self.mlp = DecoderMLP(hf_config.hidden_size, hf_config.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        if _skinny(hidden, attn.qkv_proj.weight, mlp.gate_up_proj.weight):
            from twinplane.kernels.skinny_gemm import skinny_norm_linear

            # 1-4 rows on CUDA: each norm (and residual add) runs inside the projection after it,
            # SiLU-and-mul inside gate/up; kernels/skinny_gemm.py says why.
            norm = self.input_layernorm
            qkv, residual = skinny_norm_linear(hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight,
                                               attn.qkv_proj.bias)
            hidden = attn.o_proj(attn.attend(positions, qkv, metadata))
            norm = self.post_attention_layernorm
            act, residual = skinny_norm_linear(hidden, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                                               mlp.gate_up_proj.bias, glu=True)
            return mlp.down_proj(act), residual
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def _skinny(hidden: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the skinny projection kernel takes these rows with each of these weights (CUDA only)."""
    if not hidden.is_cuda:
        return False
    from twinplane.kernels.skinny_gemm import supports

    return all(supports(hidden, w) for w in weights)


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (HF's ``model.*``)."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(hf_config, spec, backend)
                                    for _ in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """input_ids [T], positions [T], metadata -> hidden [T, hidden]; logits for chosen rows."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        raise NotImplementedError

    def __init__(self, hf_config: Any, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        spec = self.spec_from_config(hf_config)
        self.model = DecoderModel(hf_config, spec, backend or TorchAttentionBackend())
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden] -> logits [n, vocab] (None on TP ranks other than 0)."""
        return self.lm_head(hidden)

    def layer_params(self) -> int:
        """Weights of this rank's decoder-layer matrices (norm weights and biases left out)."""
        return sum(p.numel() for p in self.model.layers.parameters() if p.dim() == 2)

    def attention_layers(self) -> list[Attention]:
        """The paged-attention modules, in layer order (for binding the KV cache)."""
        return [layer.self_attn.attn for layer in self.model.layers]
