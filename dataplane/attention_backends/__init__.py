"""Attention backends by name: "flash_attn_4" and "flash_attn_2" on GPU, "torch" anywhere.

To add a backend: subclass ``AttentionBackend`` in a new module of this package and add
an entry to ``_FACTORIES`` (a zero-argument callable that imports lazily and raises
``ImportError`` when its kernels are missing), then list its name in ``_AUTO_ORDER_CUDA``.
"""

from __future__ import annotations

from collections.abc import Callable

from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata
from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend


def _torch_backend() -> AttentionBackend:
    return TorchAttentionBackend()


def _flash_attn_4() -> AttentionBackend:
    from twinplane.dataplane.attention_backends.flash_attn import FlashAttention4Backend

    return FlashAttention4Backend()


def _flash_attn_2() -> AttentionBackend:
    from twinplane.dataplane.attention_backends.flash_attn import FlashAttention2Backend

    return FlashAttention2Backend()


_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _torch_backend, "flash_attn_4": _flash_attn_4, "flash_attn_2": _flash_attn_2}
# Preference order for "auto" on CUDA; names without a factory (yet) are skipped.
_AUTO_ORDER_CUDA = ("flash_attn_4", "flash_attn_2", "torch")


def get_attention_backend(name: str, device_type: str, half_precision: bool = True) -> AttentionBackend:
    """The backend called ``name``; "auto" picks the best available for ``device_type``.

    FlashAttention runs only in bfloat16/float16, so float32 models get the torch backend.
    """
    if name == "auto":
        order = _AUTO_ORDER_CUDA if device_type == "cuda" and half_precision else ("torch",)
        for candidate in order:
            if candidate in _FACTORIES:
                try:
                    return _FACTORIES[candidate]()
                except ImportError:
                    continue
        raise ValueError(f"no attention backend available on {device_type}")
    if name not in _FACTORIES:
        raise ValueError(f"attention backend {name!r} is not available; available: {sorted(_FACTORIES)}")
    try:
        return _FACTORIES[name]()
    except ImportError as exc:
        extra = {"flash_attn_4": "gpu", "flash_attn_2": "gpu-fa2"}.get(name)
        hint = f" (pip install 'twinplane[{extra}]')" if extra else ""
        raise ValueError(f"attention backend {name!r} cannot be loaded: {exc}{hint}; "
                         "--attention-backend auto picks one that is installed") from exc


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]
