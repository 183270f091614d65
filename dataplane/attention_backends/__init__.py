"""Attention backends by name: "flash_attn_4", "triton" (our Triton kernels alone) and
"flash_attn_2" on GPU, "torch" anywhere.

A KV cache in fp8 (``--kv-cache-dtype fp8``, float8_e4m3fn) is read by "triton" (CUDA) and
"torch" only: FlashAttention reads a 16-bit cache. "auto" then picks "triton" on CUDA where it
is registered, else "torch".

To add a backend: subclass ``AttentionBackend`` in a new module of this package and add
an entry to ``_FACTORIES`` (a zero-argument callable that imports lazily and raises
``ImportError`` when its kernels are missing), then list its name in ``_AUTO_ORDER_CUDA``,
and in ``_READS_FP8_KV`` when it reads an fp8 cache.
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


def _triton() -> AttentionBackend:
    from twinplane.dataplane.attention_backends.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _flash_attn_2() -> AttentionBackend:
    from twinplane.dataplane.attention_backends.flash_attn import FlashAttention2Backend

    return FlashAttention2Backend()


_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _torch_backend, "flash_attn_4": _flash_attn_4, "triton": _triton, "flash_attn_2": _flash_attn_2}
# Preference order for "auto" on CUDA; names without a factory (yet) are skipped.
_AUTO_ORDER_CUDA = ("flash_attn_4", "triton", "flash_attn_2", "torch")
# The backends that read an fp8 KV cache (the others read 16 bits only): "auto"'s order on CUDA with one.
_READS_FP8_KV = ("triton", "torch")


def get_attention_backend(name: str, device_type: str, half_precision: bool = True,
                          kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend called ``name``; "auto" picks the best available for ``device_type``.

    FlashAttention and the Triton kernels are for bfloat16/float16, so float32 models get the torch
    backend; FlashAttention reads a 16-bit KV cache only, so an fp8 cache (``kv_cache_dtype`` "fp8")
    gets triton or torch, and naming FlashAttention with it is a ValueError.
    """
    fp8 = kv_cache_dtype == "fp8"
    if fp8 and name in _FACTORIES and name not in _READS_FP8_KV:
        raise ValueError(f"attention backend {name!r} reads a 16-bit KV cache only; --kv-cache-dtype fp8 runs on "
                         "the triton or torch backend (--attention-backend auto picks one)")
    if name == "auto":
        if device_type != "cuda" or not half_precision:
            order = ("torch",)
        else:
            order = _READS_FP8_KV if fp8 else _AUTO_ORDER_CUDA
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
