"""``dummy:<shape>`` models: real architectures' configs with seeded random weights.

Weights are generated per Hugging Face parameter name, at the full (unsharded) checkpoint
shape, from a generator seeded by (seed, name), then pushed through the same
``weight_loader``s as a real checkpoint, so every tensor-parallel rank sees the same model.
Matrices and biases ~ normal(0, 0.02); norm weights = 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from twinplane.dataplane.models.decoder import DecoderSpec, head_dim_of

_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
              rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
              bos_token_id=151643, eos_token_id=[151645, 151643], attention_bias=False, hidden_act="silu")
_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
              rope_theta=100_000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              attention_bias=False, mlp_bias=False, hidden_act="silu")
_TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, vocab_size=49152, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)

DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 12288, "tie_word_embeddings": False},
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "tiny-qwen3": {**_QWEN3, **_TINY},
    "tiny-llama": {**_LLAMA, **_TINY},
}


def is_dummy(model: str) -> bool:
    return model.startswith("dummy:")


def dummy_hf_config(model: str) -> PretrainedConfig:
    """The transformers config of ``dummy:<shape>``."""
    shape = model.removeprefix("dummy:")
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy model {model!r}; known: {', '.join('dummy:' + s for s in DUMMY_SHAPES)}")
    values = dict(DUMMY_SHAPES[shape])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def checkpoint_shapes(hf_config: Any, spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter name -> full shape, as a checkpoint of this config stores it."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = head_dim_of(hf_config)
    q_out = hf_config.num_attention_heads * head_dim
    kv_out = hf_config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (hf_config.vocab_size, hidden)}
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden)}
        for name, shape in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if spec.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes[f"{p}self_attn.o_proj.weight"] = (hidden, q_out)
        if spec.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (hidden,)
        if spec.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}self_attn.k_norm.weight"] = (head_dim,)
        mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        for name, shape in mlp.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if spec.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not getattr(hf_config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (hf_config.vocab_size, hidden)
    return shapes


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def dummy_weights(shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) per checkpoint parameter, deterministic in (seed, name), made on ``device``."""
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        generator = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
