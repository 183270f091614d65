"""Decoder models (Llama, Qwen2, Qwen3) and the architecture registry."""

from twinplane.dataplane.models.registry import MODEL_REGISTRY, model_class_for

__all__ = ["MODEL_REGISTRY", "model_class_for"]
