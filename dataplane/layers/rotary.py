"""Rotary position embedding (RoPE), rotate-half layout, with cached cos/sin tables.

Supports the plain ("default") frequencies, "linear" position interpolation, the "llama3"
frequency-dependent scaling and "yarn" (frequencies ramped between plain and interpolated by how
often they turn within the original context, cos/sin scaled by an attention factor).
``rope_settings`` reads the Hugging Face config in both of its layouts: ``rope_parameters``
(transformers 5) or ``rope_theta`` + ``rope_scaling``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from twinplane.dataplane.layers.fusion import on_cuda


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None for plain RoPE) from a Hugging Face config."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return theta, scaling
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, base: float, scaling: dict[str, Any],
          max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: a frequency that turns more than beta_fast times within the original context stays as it
    is, one that turns fewer than beta_slow times is divided by factor, and those in between are mixed
    linearly by dimension; cos and sin are scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    head_dim = 2 * len(inv_freq)
    original = float(scaling.get("original_max_position_embeddings") or max_position)
    factor = float(scaling.get("factor") or max_position / original)

    def log_scale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = log_scale(mscale) / log_scale(mscale_all_dim) if mscale and mscale_all_dim else log_scale()

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns this often in the original context
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = high - low if high != low else 1e-3
    ramp = ((torch.arange(len(inv_freq), dtype=torch.float32) - low) / span).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def rope_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None,
                     max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] for the given scaling type, and the factor cos and sin
    are scaled by (1 but for yarn)."""
    inv_freq = _default_inv_freq(head_dim, base)
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, base, scaling, max_position)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3 and "
                              "yarn are)")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


@on_cuda
def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, d], k [T, kv_heads, d] rotated by the cached cos/sin at positions [T]."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, heads, head_dim] and k [T, kv_heads, head_dim] at ``positions`` [T]."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        # Computed on CPU in float32 (a meta-device context must not reach the values),
        # then moved to the device the model is being built on.
        with torch.device("cpu"):
            inv_freq, attention_factor = rope_frequencies(head_dim, base, scaling, max_position)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, self.cos_sin_cache, positions)
