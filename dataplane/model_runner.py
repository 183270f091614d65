"""ModelRunner: the data plane's model, KV cache, sequence mirrors and sampler behind ``step``.

Start-up (``__init__``) runs small ``init_*`` steps: pick device and dtype, load the model
with its attention backend, size and allocate the KV cache, set up the sampler. ``step``
checks a StepPlan, applies its drops and mirror updates, builds the input tensors, runs
one forward pass, computes logits only for the rows that sample, samples, and returns the
StepOutput in plan order. A bad plan raises ValueError before any state changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from twinplane.dataplane.attention_backends import get_attention_backend
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.cuda_graphs import DecodeGraphs
from twinplane.dataplane.distributed import tp_rank, tp_world_size
from twinplane.dataplane.kv_cache import allocate_kv_cache, bytes_per_block, cpu_num_blocks, cuda_num_blocks
from twinplane.dataplane.loader import load_model
from twinplane.dataplane.plan import StepOutput, StepPlan
from twinplane.dataplane.sampler import Sampler, SamplerOutput
from twinplane.dataplane.sampling_batch import SamplingBatch
from twinplane.dataplane.input_batch import InputBatch, PlanLimits

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class DataPlaneDescription:
    """The fields of the DescribeResponse proto message."""

    model: str
    tokenizer_path: str
    architecture: str
    dtype: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    attention_backend: str
    vocab_size: int
    eos_token_ids: list[int]
    max_logprobs: int
    device: str
    weight_bytes: int
    kv_bytes_per_token: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA device is available")
        return torch.device("cuda", tp_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _to_step_output(step_id: int, sampled: SamplerOutput, batch: SamplingBatch) -> StepOutput:
    output = StepOutput(step_id=step_id, sampled_token_ids=sampled.token_ids.to(torch.int32).cpu().numpy())
    if sampled.logprobs is None:
        return output
    output.sampled_logprobs = sampled.logprobs.float().cpu().numpy()
    top_ids = sampled.top_ids.cpu().numpy().astype(np.int32) if sampled.top_ids is not None else None
    top_lps = sampled.top_logprobs.float().cpu().numpy() if sampled.top_logprobs is not None else None
    for row, n in enumerate(batch.num_logprobs):
        if n >= 0:
            ids = top_ids[row, :n] if top_ids is not None else np.empty(0, np.int32)
            lps = top_lps[row, :n] if top_lps is not None else np.empty(0, np.float32)
            output.top_logprobs[row] = (ids, lps)
    return output


class ModelRunner:
    """Executes StepPlans for one model on one device (tensor-parallel rank 0 samples)."""

    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        if config.tensor_parallel_size != tp_world_size():
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs a torch.distributed group of "
                             f"that size (found {tp_world_size()}); the caller starts the ranks")
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.init_model()
        self.init_kv_cache()
        self.init_cuda_graphs()
        self.sampler = Sampler(config.seed, self.device)
        self.sequences = InputBatch(PlanLimits(
            vocab_size=self.vocab_size, num_kv_blocks=self.num_kv_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_logprobs=MAX_LOGPROBS), self.device)
        self._last_step_end: float | None = None

    def init_model(self) -> None:
        half = self.dtype in (torch.bfloat16, torch.float16)
        self.backend = get_attention_backend(self.config.attention_backend, self.device.type, half)
        self.loaded = load_model(self.config.model, self.dtype, self.device, self.config.seed, self.backend)
        self.model = self.loaded.model
        hf_config = self.loaded.hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = min(self.config.max_model_len, int(hf_config.max_position_embeddings))

    def init_kv_cache(self) -> None:
        layers, block_size = self.model.attention_layers(), self.config.block_size
        if self.config.num_kv_blocks > 0:
            self.num_kv_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            self.num_kv_blocks = cuda_num_blocks(
                self.model, block_size, self.dtype, self.device, self.config.max_num_batched_tokens,
                self.max_model_len, self.config.max_num_seqs, self.config.gpu_memory_utilization)
        else:
            self.num_kv_blocks = cpu_num_blocks(self.config.cpu_kv_cache_gib, bytes_per_block(layers, block_size, self.dtype))
        if tp_world_size() > 1:  # every rank must hold the same number of blocks
            count = torch.tensor([self.num_kv_blocks], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
            self.num_kv_blocks = int(count.item())
        self.kv_cache = allocate_kv_cache(layers, self.num_kv_blocks, block_size, self.dtype, self.device)

    def init_cuda_graphs(self) -> None:
        self.graphs = None
        if self.device.type != "cuda" or self.config.enforce_eager or self.backend.name == "torch":
            return  # the torch backend loops over host-side lengths, which a graph would freeze
        c = self.config
        self.graphs = DecodeGraphs(self.model, int(self.loaded.hf_config.hidden_size), self.dtype, self.device,
                                   c.max_num_seqs, self.max_model_len, c.block_size)
        self.graphs.capture()

    def describe(self) -> DataPlaneDescription:
        c = self.config
        device = "cpu" if self.device.type == "cpu" else f"{torch.cuda.get_device_name(self.device)} x{c.tensor_parallel_size}"
        return DataPlaneDescription(
            model=c.model, tokenizer_path=self.loaded.tokenizer_path, architecture=self.loaded.architecture,
            dtype=str(self.dtype).removeprefix("torch."), block_size=c.block_size, num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, tensor_parallel_size=c.tensor_parallel_size,
            attention_backend=self.backend.name, vocab_size=self.vocab_size,
            eos_token_ids=list(self.loaded.eos_token_ids), max_logprobs=MAX_LOGPROBS, device=device,
            weight_bytes=self._weight_bytes() * c.tensor_parallel_size,
            kv_bytes_per_token=bytes_per_block(self.model.attention_layers(), 1, self.dtype) * c.tensor_parallel_size)

    def _weight_bytes(self) -> int:
        """This rank's weight bytes (tied embeddings counted once)."""
        unique = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
        return sum(unique.values())

    def reset(self) -> None:
        """Forget every sequence (e.g. when the control plane reconnects)."""
        self.sequences.reset()

    def close(self) -> None:
        """Release the KV cache, the model and the mirrors (the runner is unusable afterwards)."""
        self.sequences.reset()
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(torch.empty(0, 0, layer.num_kv_heads, layer.head_dim), torch.empty(0, 0, layer.num_kv_heads, layer.head_dim))
        del self.kv_cache, self.model, self.loaded, self.graphs
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self, plan: StepPlan) -> StepOutput:
        return self.step_with_logits(plan)[0]

    @torch.inference_mode()
    def step_with_logits(self, plan: StepPlan) -> tuple[StepOutput, torch.Tensor]:
        """Like ``step``, also returning the raw logits [num_sampled, vocab] (for tests)."""
        started = time.perf_counter()
        idle_us = 0 if self._last_step_end is None else int((started - self._last_step_end) * 1e6)
        inputs = self.sequences.prepare(plan)
        logits = torch.empty(0, self.vocab_size, device=self.device)
        output = StepOutput(step_id=plan.step_id, sampled_token_ids=np.empty(0, np.int32))
        prepared = time.perf_counter()
        if inputs is not None:
            if self.graphs is not None and self.graphs.can_run(inputs.metadata):
                hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            if inputs.sampling is not None:
                rank_logits = self.model.compute_logits(hidden[inputs.sample_indices])
                if rank_logits is not None:  # None on tensor-parallel ranks other than 0
                    logits = rank_logits.float()
                    output = _to_step_output(plan.step_id, self.sampler(logits, inputs.sampling), inputs.sampling)
        finished = time.perf_counter()
        output.prepare_us, output.execute_us, output.idle_us = (
            int((prepared - started) * 1e6), int((finished - prepared) * 1e6), idle_us)
        self._last_step_end = finished
        return output, logits
