"""Hugging Face architecture names -> model classes (all share the decoder in ``decoder.py``)."""

from __future__ import annotations

from typing import Any

from twinplane.dataplane.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama and SmolLM2: optional attention / MLP biases, no q/k norm."""

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(qkv_bias=attention_bias, o_bias=attention_bias,
                           mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=False)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers. Its sliding attention window, when it has one, is no shorter than the
    context the data plane serves (``sliding_window``), so attention over all of it is the same."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5: bias on q/k/v only."""

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: per-head RMSNorm on q and k, biases only when attention_bias is set."""

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True)


MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def sliding_window(hf_config: Any) -> int | None:
    """The attention window of a config that uses one (Mistral v0.1's 4,096 tokens; Qwen2's only when
    use_sliding_window is set), else None."""
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    window = getattr(hf_config, "sliding_window", None)
    return int(window) if window else None


def model_class_for(hf_config: Any) -> tuple[str, type[DecoderForCausalLM]]:
    """(architecture name, class) for the first supported entry of ``config.architectures``."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    raise ValueError(f"unsupported architectures {architectures}; supported: {sorted(MODEL_REGISTRY)}")
