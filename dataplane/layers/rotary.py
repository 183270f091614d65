"""Rotary position embedding (RoPE), rotate-half layout, with cached cos/sin tables.

Supports the plain ("default") frequencies, "linear" position interpolation and the
"llama3" frequency-dependent scaling. ``rope_settings`` reads the Hugging Face config in
both of its layouts: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``.
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


def compute_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for the given scaling type."""
    inv_freq = _default_inv_freq(head_dim, base)
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3 are)")


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
            inv_freq = compute_inv_freq(head_dim, base, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, self.cos_sin_cache, positions)
