"""Configuration of the data-plane process, validated once at start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "flash_attn_4", "triton", "flash_attn_2", "torch")
DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8")  # fp8: float8_e4m3fn, values stored unscaled (clamped to +-448)


@dataclass(frozen=True)
class DataPlaneConfig:
    model: str  # Hugging Face folder, or "dummy:<shape>" for random weights
    device: str = "auto"  # "auto" (cuda when available), "cuda" or "cpu"
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    block_size: int = 256  # tokens per KV-cache block
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + activations + KV
    num_kv_blocks: int = 0  # 0 = measure (GPU) or derive from cpu_kv_cache_gib (CPU)
    cpu_kv_cache_gib: float = 1.0  # KV-cache budget on CPU
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; "fp8": one byte a value, twice the blocks
    seed: int = 0  # seeds random weights of dummy models and unseeded sampling
    model_name: str = ""  # what Describe calls the model; default: model as given (embedded.model_name)

    def __post_init__(self) -> None:
        checks = [
            (self.block_size > 0 and self.block_size % 16 == 0 or self.block_size in (1, 2, 4, 8),
             f"block_size must be a power of two up to 8 or a multiple of 16, got {self.block_size}"),
            (self.max_model_len > 0, f"max_model_len must be > 0, got {self.max_model_len}"),
            (self.max_num_seqs > 0, f"max_num_seqs must be > 0, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= self.max_num_seqs,
             "max_num_batched_tokens must be >= max_num_seqs"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.num_kv_blocks >= 0, "num_kv_blocks must be >= 0"),
            (0.0 < self.cpu_kv_cache_gib < math.inf, f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (0 <= self.seed < 2**63, f"seed (--weights-seed) must be in [0, 2**63), got {self.seed}"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"),
            (self.device in ("auto", "cuda", "cpu"), "device must be auto, cuda or cpu"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
