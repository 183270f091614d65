"""ModelRunner: the data plane's model, KV cache, sequence mirrors and sampler behind ``step``.

Start-up (``__init__``) runs small ``init_*`` steps: pick device, dtype and KV-cache dtype, load
the model with its attention backend, size and allocate the KV cache, set up the sampler. ``step``
checks a StepPlan, applies its drops and mirror updates, builds the input tensors, runs
one forward pass, computes logits only for the rows that sample, samples, and returns the
StepOutput in plan order. A bad plan raises ValueError before any state changes.

``step`` is ``launch`` then ``LaunchedStep.result``: ``launch`` only queues the device work
(the sampled tokens stay on the device as the next plan's PENDING inputs and start their
copy to the host), so the server can launch the next plan before this one's tokens are read.

A plan of K decode steps queues K forward passes and samplings at once, each step's tokens
the next one's inputs on the device, with no round trip to the control plane or the host in
between: what a small batch's step costs beyond its GPU time is paid once per K tokens. On
one CUDA device, plans that sample with temperature only replay one graph per step that
samples too (``decode_graphs.py``), so queueing a step costs the host a graph replay; so do
plans of one decode step that sample with temperature only, at any batch size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from twinplane.dataplane.attention_backends import get_attention_backend
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.cuda_graphs import StepGraphs, bucket, graph_batch_sizes
from twinplane.dataplane.decode_graphs import SampledDecodeGraphs
from twinplane.dataplane.distributed import tp_rank, tp_world_size
from twinplane.dataplane.kv_cache import (
    allocate_kv_cache, bytes_per_block, check_num_blocks, cpu_num_blocks, cuda_num_blocks, resolve_kv_dtype,
)
from twinplane.dataplane.loader import load_model
from twinplane.dataplane.models.decoder import head_dim_of
from twinplane.dataplane.models.registry import sliding_window
from twinplane.dataplane.plan import (MAX_DECODE_STEPS, PromptLogprobs, PromptLogprobsAsk, StepOutput, StepPath,
                                     StepPlan)
from twinplane.dataplane.sampler import Sampler, SamplerOutput
from twinplane.dataplane.sampling_batch import to_device
from twinplane.dataplane.input_batch import GraphStep, InputBatch, PlanLimits, SampledRows, StepInputs

MAX_LOGPROBS = 20
PROMPT_LOGPROB_ROWS = 512  # CPU: rows of one logits GEMM for prompt log-probabilities (CUDA: the largest padded count)
log = logging.getLogger("twinplane.dataplane")


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
    kv_cache_dtype: str
    max_decode_steps: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    layer_params: int
    masks_follow: bool = True  # it takes plans whose token masks follow them (StepPlan.masks_follow)
    generation_config: dict = field(default_factory=dict)  # the GenerationConfig message's fields that are set


def device_kind(name: str) -> str:
    """The kind of device, "cuda" or "cpu", that a --device value names ("auto": cuda where available)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str) -> torch.device:
    if device_kind(name) == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA device is available")
        return torch.device("cuda", tp_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class LaunchedStep:
    """A step whose device work is queued; ``result`` waits for it and returns the StepOutput."""

    step_id: int
    prepare_us: int
    forward_us: int = 0  # CPU: queueing the forward pass (graph replay or eager launches)
    sample_us: int = 0  # CPU: queueing logits and sampling
    launch_us: int = 0  # CPU: the whole launch
    idle_us: int = 0  # CPU: time between the previous step's end and this one's start
    execute_us: int = 0  # CPU: forward pass and sampling
    path: StepPath = StepPath.EAGER  # how the forward pass ran
    sampled: SampledRows | None = None
    sampler_output: SamplerOutput | None = None  # host copies, valid once `done` is reached
    num_logprobs: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # kept only when asked (tests)
    begin: torch.cuda.Event | None = None  # CUDA: the device reached this step's work
    done: torch.cuda.Event | None = None  # CUDA: ... finished it, tokens copied to the host
    previous_done: torch.cuda.Event | None = None  # CUDA: the step before finished
    record: Callable[[SampledRows, np.ndarray], None] | None = None  # stores the tokens in the history
    decode_budget: np.ndarray | None = None  # a plan of several decode steps: tokens of each sequence
    prompt_logprobs: PromptLogprobsOnTheWay | None = None  # rank 0, when the plan asks for them
    _output: StepOutput | None = None

    def wait(self) -> None:
        """Blocks until the step's tokens are on the host."""
        if self.done is not None:
            self.done.synchronize()

    def result(self) -> StepOutput:
        if self._output is None:
            self.wait()
            self._output = self._build_output()
        return self._output

    def _build_output(self) -> StepOutput:
        output = StepOutput(step_id=self.step_id, sampled_token_ids=np.empty(0, np.int32))
        sampled = self.sampler_output
        if sampled is not None and self.decode_budget is not None:  # [K, n] -> each sequence's budget, in order
            budget = self.decode_budget
            tokens = sampled.token_ids.numpy().reshape(-1, len(budget))
            output.sampled_token_ids = tokens.T[np.arange(len(tokens))[None, :] < budget[:, None]]
        elif sampled is not None:
            output.sampled_token_ids = sampled.token_ids.numpy()
            if self.record is not None:
                self.record(self.sampled, output.sampled_token_ids)
            if sampled.logprobs is not None:
                output.sampled_logprobs = sampled.logprobs.numpy()
                top_ids = sampled.top_ids.numpy().astype(np.int32) if sampled.top_ids is not None else None
                top_lps = sampled.top_logprobs.numpy() if sampled.top_logprobs is not None else None
                for row, n in enumerate(self.num_logprobs):
                    if n >= 0:
                        ids = top_ids[row, :n] if top_ids is not None else np.empty(0, np.int32)
                        lps = top_lps[row, :n] if top_lps is not None else np.empty(0, np.float32)
                        output.top_logprobs[row] = (ids, lps)
        if self.prompt_logprobs is not None:
            output.prompt_logprobs = self.prompt_logprobs.split()
        output.prepare_us, output.idle_us, output.execute_us = self.prepare_us, self.idle_us, self.execute_us
        output.launch_us = self.launch_us
        output.path = self.path
        if self.begin is not None:  # device time, measured by events: CPU work that overlaps costs nothing
            output.execute_us = int(self.begin.elapsed_time(self.done) * 1000)
            if self.previous_done is not None:
                output.idle_us = max(int(self.previous_done.elapsed_time(self.begin) * 1000), 0)
        return output


@dataclass
class PromptLogprobsOnTheWay:
    """A step's prompt log-probabilities, all asks together, on their way to (pinned) host memory."""

    asks: list[tuple[int, int, int]]  # (plan index, positions, num_top) of each ask, in the plan's order
    logprobs: torch.Tensor  # float32 [sum of positions]: of each next token
    top_ids: torch.Tensor  # int64 [sum of positions, largest num_top]
    top_logprobs: torch.Tensor  # float32 [sum of positions, largest num_top]
    ranks: torch.Tensor  # int64 [sum of positions]: of each next token

    def split(self) -> dict[int, PromptLogprobs]:
        """Each ask's share, by plan index (valid once the step is done)."""
        lps, ids, tops = self.logprobs.numpy(), self.top_ids.numpy().astype(np.int32), self.top_logprobs.numpy()
        ranks = self.ranks.numpy().astype(np.int32)
        out, begin = {}, 0
        for index, m, k in self.asks:
            end = begin + m
            out[index] = PromptLogprobs(lps[begin:end], ids[begin:end, :k], tops[begin:end, :k], ranks[begin:end])
            begin = end
        return out


def _to_host(sampled: SamplerOutput, token_ids: torch.Tensor) -> SamplerOutput:
    """Starts copying a step's sampler output (token_ids: its ids as int32) to (pinned) host memory."""
    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to("cpu", non_blocking=True)

    def host_float(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else host(t.float())

    return SamplerOutput(host(token_ids), host_float(sampled.logprobs),
                         host(sampled.top_ids), host_float(sampled.top_logprobs))


class ModelRunner:
    """Executes StepPlans for one model on one device (tensor-parallel rank 0 samples)."""

    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        if config.tensor_parallel_size != tp_world_size():
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs a torch.distributed group of "
                             f"that size (found {tp_world_size()}); the caller starts the ranks")
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.init_model()
        self.init_kv_cache()
        self.init_cuda_graphs()
        self.init_sampler()
        self.init_decode_graphs()
        self.sequences = InputBatch(PlanLimits(
            vocab_size=self.vocab_size, num_kv_blocks=self.num_kv_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_logprobs=MAX_LOGPROBS), self.device)
        self.sequences.wait_for_tokens = self._wait_for_last_step
        self.sequences.warm_up()
        self.use_decode_graphs(self.decode_graphs)
        self._last: LaunchedStep | None = None  # the most recently launched step
        self._awaiting_masks: tuple | None = None  # (step, inputs, hidden) of a plan whose token masks follow
        self._last_end: float | None = None  # CPU timing: when the previous step's work ended

    def init_model(self) -> None:
        half = self.dtype in (torch.bfloat16, torch.float16)
        self.backend = get_attention_backend(self.config.attention_backend, self.device.type, half,
                                             self.config.kv_cache_dtype)
        self.loaded = load_model(self.config.model, self.dtype, self.device, self.config.seed, self.backend)
        self.model = self.loaded.model
        hf_config = self.loaded.hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = min(self.config.max_model_len, int(hf_config.max_position_embeddings))
        if self.max_model_len < self.config.max_model_len:
            log.info("the model has positions for %d tokens (max_position_embeddings); max_model_len is cut from %d "
                     "to %d", self.max_model_len, self.config.max_model_len, self.max_model_len)
        window = sliding_window(hf_config)
        if window is not None and window < self.max_model_len:  # attention over all of it is the window's
            log.info("the model attends over a sliding window of %d tokens; max_model_len is cut from %d to %d, "
                     "within which attending to every token is the same", window, self.max_model_len, window)
            self.max_model_len = window

    def init_kv_cache(self) -> None:
        layers, block_size = self.model.attention_layers(), self.config.block_size
        block_bytes = bytes_per_block(layers, block_size, self.kv_dtype)
        if self.config.num_kv_blocks > 0:
            self.num_kv_blocks = self.config.num_kv_blocks
            check_num_blocks(self.num_kv_blocks, block_bytes, self.device, f"num_kv_blocks={self.num_kv_blocks}")
        elif self.device.type == "cuda":
            self.num_kv_blocks = cuda_num_blocks(
                self.model, block_size, self.kv_dtype, self.device, self.config.max_num_batched_tokens,
                self.max_model_len, self.config.max_num_seqs, self.config.gpu_memory_utilization)
        else:
            self.num_kv_blocks = cpu_num_blocks(self.config.cpu_kv_cache_gib, block_bytes)
            check_num_blocks(self.num_kv_blocks, block_bytes, self.device,
                             f"cpu_kv_cache_gib={self.config.cpu_kv_cache_gib}")
        if tp_world_size() > 1:  # every rank must hold the same number of blocks
            count = torch.tensor([self.num_kv_blocks], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
            self.num_kv_blocks = int(count.item())
        self.kv_cache = allocate_kv_cache(layers, self.num_kv_blocks, block_size, self.kv_dtype, self.device)

    def init_cuda_graphs(self) -> None:
        self.graphs = None
        if self.device.type != "cuda" or self.config.enforce_eager or self.backend.name == "torch":
            return  # the torch backend loops over host-side lengths, which a graph would freeze
        c = self.config
        self.graphs = StepGraphs(self.model, int(self.loaded.hf_config.hidden_size), self.dtype, self.device,
                                 c.max_num_seqs, self.max_model_len, c.block_size, c.max_num_batched_tokens,
                                 mixed=self.backend.graphs_mixed_steps)
        self.graphs.capture()

    @torch.inference_mode()
    def init_sampler(self) -> None:
        """The sampler; on CUDA also the logits of every padded row count a step can ask for.

        cuBLAS spends ~17-19 ms of host time on the first GEMM of each new shape (measured on an
        H200; it does not wait for the device). Outside the graphs, a step's logits GEMM has one
        row per sampled sequence, so while the batch grew, each prompt step met a new row count
        and its launch stalled for that long. The rows are padded to the graph batch sizes
        instead, and each of those GEMMs runs once here; the largest also warms the sampler (its
        kernel compiles) and leaves the caching allocator a block for the largest logits.
        """
        self.sampler = Sampler(self.config.seed, self.device)
        self.logit_rows: list[int] = []  # padded row counts of the logits GEMM (none on CPU)
        if self.device.type != "cuda":
            return
        self.logit_rows = graph_batch_sizes(self.config.max_num_seqs)
        self._logit_hidden = torch.zeros(self.logit_rows[-1], int(self.loaded.hf_config.hidden_size),
                                         dtype=self.dtype, device=self.device)
        for rows in self.logit_rows:  # every rank: the TP gather is collective
            logits = self.model.compute_logits(self._logit_hidden[:rows])
        if logits is not None:
            self.sampler.warm_up(logits)
        torch.cuda.synchronize(self.device)

    def init_decode_graphs(self) -> None:
        """Graphs of plans of several decode steps that sample too (one rank, the fused sampler)."""
        self.decode_graphs = None
        if self.graphs is None or tp_world_size() > 1 or not self.sampler.fused:
            return
        self.decode_graphs = SampledDecodeGraphs(self.model, self.sampler.draw_key, self.graphs.batch_sizes,
                                                 self.max_model_len, self.config.block_size, self.graphs.pool)
        self.decode_graphs.capture()

    def use_decode_graphs(self, graphs: SampledDecodeGraphs | None) -> None:
        """Replay ``graphs`` for the plans they take (None: the step-by-step path for every plan)."""
        self.decode_graphs = graphs
        self.sequences.use_graph_inputs(None if graphs is None else graphs.inputs)

    def _logits_input(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """hidden[indices], padded on CUDA to the next row count in ``logit_rows`` (extra rows: stale)."""
        n = indices.shape[0]
        rows = bucket(self.logit_rows, n) or n
        if rows == n:
            return hidden[indices]
        padded = self._logit_hidden[:rows]
        torch.index_select(hidden, 0, indices, out=padded[:n])
        return padded

    def describe(self) -> DataPlaneDescription:
        c = self.config
        device = "cpu" if self.device.type == "cpu" else \
            f"{torch.cuda.get_device_name(self.device)} x{c.tensor_parallel_size}"
        return DataPlaneDescription(
            model=c.model_name or c.model, tokenizer_path=self.loaded.tokenizer_path,
            architecture=self.loaded.architecture,
            dtype=str(self.dtype).removeprefix("torch."), block_size=c.block_size, num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, tensor_parallel_size=c.tensor_parallel_size,
            attention_backend=self.backend.name, vocab_size=self.vocab_size,
            eos_token_ids=list(self.loaded.eos_token_ids), max_logprobs=MAX_LOGPROBS, device=device,
            weight_bytes=self._weight_bytes() * c.tensor_parallel_size,
            kv_bytes_per_token=bytes_per_block(self.model.attention_layers(), 1, self.kv_dtype)
            * c.tensor_parallel_size,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            max_decode_steps=MAX_DECODE_STEPS, generation_config=dict(self.loaded.generation_config),
            **self._shape(), layer_params=self.model.layer_params() * c.tensor_parallel_size)

    def _shape(self) -> dict[str, int]:
        """The model's sizes that FLOP counts need (query heads: all ranks together)."""
        hf = self.loaded.hf_config
        return {"hidden_size": int(hf.hidden_size), "num_hidden_layers": int(hf.num_hidden_layers),
                "num_attention_heads": int(hf.num_attention_heads), "head_dim": head_dim_of(hf)}

    def _weight_bytes(self) -> int:
        """This rank's weight bytes (tied embeddings counted once)."""
        unique = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
        return sum(unique.values())

    def drop_refused(self, seq_ids) -> None:
        """A refused plan's drops hold all the same: those sequences ended on the control plane, also when
        the plan was refused as it was read, before ``launch`` saw it. Not while a plan waits for its masks."""
        if self._awaiting_masks is None:
            self.sequences.drop(seq_ids)

    def reset(self) -> None:
        """Forget every sequence (e.g. when the control plane reconnects)."""
        self._awaiting_masks = None
        self.sequences.reset()

    def close(self) -> None:
        """Release the KV cache, the model and the mirrors (the runner is unusable afterwards)."""
        self.sequences.reset()
        for layer in self.model.attention_layers():
            empty = torch.empty(0, 0, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(empty, empty)
        del self.kv_cache, self.model, self.loaded, self.graphs
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self, plan: StepPlan) -> StepOutput:
        return self.launch(plan).result()

    def step_with_logits(self, plan: StepPlan) -> tuple[StepOutput, torch.Tensor]:
        """Like ``step``, also returning the raw logits [num_sampled, vocab] (for tests)."""
        launched = self.launch(plan, keep_logits=True)
        logits = launched.logits if launched.logits is not None else torch.empty(0, self.vocab_size)
        return launched.result(), logits

    def _wait_for_last_step(self) -> None:
        if self._last is not None:
            self._last.result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, keep_logits: bool = False) -> LaunchedStep:
        """Checks the plan and queues its forward pass and sampling on the device (the sampling of a plan
        whose token masks follow, once sample_with_masks brings them)."""
        if self._awaiting_masks is not None:
            raise ValueError(f"step {self._awaiting_masks[0].step_id} waits for its token masks; no plan may come "
                             "before them")
        started = time.perf_counter()
        inputs = self.sequences.prepare(plan, graphs=not keep_logits)
        prepared = time.perf_counter()
        cuda = self.device.type == "cuda"
        step = LaunchedStep(plan.step_id, int((prepared - started) * 1e6))
        if cuda:
            step.begin, step.done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            step.begin.record(self.sequences.stream)
            step.previous_done = self._last.done if self._last is not None else None
        if isinstance(inputs, GraphStep):
            self._graph_step(step, inputs)
            step.forward_us = int((time.perf_counter() - prepared) * 1e6)
        elif inputs is not None and inputs.decode_steps is not None:
            self._decode_steps(step, inputs)
        elif inputs is not None:
            hidden, step.path = self._forward(inputs.input_ids, inputs.positions, inputs.metadata)
            asks = plan.cols().prompt_logprobs
            if asks:
                step.prompt_logprobs = self._prompt_logprobs(hidden, inputs.metadata.query_lens_host, asks)
            forwarded = time.perf_counter()
            step.forward_us = int((forwarded - prepared) * 1e6)
            if inputs.sampling is not None:
                self._sample(step, inputs, hidden, keep_logits)
                step.sample_us = int((time.perf_counter() - forwarded) * 1e6)
            elif inputs.with_masks is not None:  # sampled by sample_with_masks
                self._awaiting_masks = step, inputs, hidden
        step.launch_us = int((time.perf_counter() - started) * 1e6)
        if not cuda:
            step.idle_us = 0 if self._last_end is None else int((started - self._last_end) * 1e6)
        self._last = step
        if self._awaiting_masks is None:
            self._launched(step, prepared)
        elif not cuda:  # the forward pass, run
            step.execute_us = int((time.perf_counter() - prepared) * 1e6)
        return step

    def _launched(self, step: LaunchedStep, prepared: float) -> None:
        """The step's work is all queued: marks its end (CUDA) or times it (CPU, where it has run)."""
        if step.done is not None:
            step.done.record(self.sequences.stream)
        else:
            now = time.perf_counter()
            step.execute_us += int((now - prepared) * 1e6)
            self._last_end = now

    @property
    def awaits_masks(self) -> bool:
        """A launched plan waits for its token masks (StepPlan.masks_follow): no other plan may come first."""
        return self._awaiting_masks is not None

    @torch.inference_mode()
    def sample_with_masks(self, step_id: int, token_masks: dict[int, bytes]) -> LaunchedStep:
        """Samples the launched plan that waits for its token masks, with them; returns its step."""
        if self._awaiting_masks is None or self._awaiting_masks[0].step_id != step_id:
            waiting = None if self._awaiting_masks is None else self._awaiting_masks[0].step_id
            raise ValueError(f"token masks for step {step_id}, but the step waiting for masks is {waiting}")
        (step, inputs, hidden), self._awaiting_masks = self._awaiting_masks, None
        started = time.perf_counter()
        try:
            inputs.sampling = inputs.with_masks(token_masks)
        except ValueError:
            self.sequences.sampling_refused()
            self._launched(step, started)
            raise
        self._sample(step, inputs, hidden, keep_logits=False)
        step.sample_us = int((time.perf_counter() - started) * 1e6)
        step.launch_us += step.sample_us
        self._launched(step, started)
        return step

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> tuple[torch.Tensor, StepPath]:
        """The hidden states of one forward pass: a graph replay when one fits, else eager."""
        shape = None if self.graphs is None else self.graphs.shape_for(metadata, len(input_ids))
        if shape is None:
            return self.model(input_ids, positions, metadata), StepPath.EAGER
        return self.graphs.run(shape, input_ids, positions, metadata), self.graphs.path_of(shape)

    def _draw(self, inputs: StepInputs,
              hidden: torch.Tensor) -> tuple[torch.Tensor, SamplerOutput | None, torch.Tensor | None]:
        """Samples on rank 0 and broadcasts: the token ids (int32, on every rank), and rank 0's
        sampler output and logits (None on other ranks)."""
        num_sampled = inputs.sample_indices.shape[0]
        rank_logits = self.model.compute_logits(self._logits_input(hidden, inputs.sample_indices))
        sampled = None
        if rank_logits is not None:  # rank 0
            rank_logits = rank_logits[:num_sampled]
            sampled = self.sampler(rank_logits, inputs.sampling)
            token_ids = sampled.token_ids.to(torch.int32)
        else:
            token_ids = torch.empty(num_sampled, dtype=torch.int32, device=self.device)
        if tp_world_size() > 1:
            torch.distributed.broadcast(token_ids, src=0)
        return token_ids, sampled, rank_logits

    def _prompt_logprobs(self, hidden: torch.Tensor, query_lens: list[int],
                         asks: dict[int, PromptLogprobsAsk]) -> PromptLogprobsOnTheWay | None:
        """The log-probabilities of each ask's next tokens, and its top tokens, from the hidden states of
        its chunk's first positions; the output projection takes them a slice of rows at a time (a long
        prompt's logits at once would not fit). Every rank joins the projection; rank 0 gets the result."""
        starts = np.concatenate(([0], np.cumsum(query_lens)))
        rows = to_device(np.concatenate([starts[i] + np.arange(len(a.next_token_ids)) for i, a in asks.items()]),
                         self.device)
        next_ids = to_device(np.concatenate([a.next_token_ids for a in asks.values()]), self.device)
        num_top = max(a.num_top for a in asks.values())
        per_slice = self.logit_rows[-1] if self.logit_rows else PROMPT_LOGPROB_ROWS
        parts = []
        for begin in range(0, len(rows), per_slice):
            indices = rows[begin:begin + per_slice]
            logits = self.model.compute_logits(self._logits_input(hidden, indices))
            if logits is None:  # not rank 0
                continue
            logprobs = logits[:len(indices)].float().log_softmax(dim=-1)
            top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
            chosen = logprobs.gather(1, next_ids[begin:begin + len(indices), None].long())
            parts.append((chosen.squeeze(1), top_ids, top_logprobs, (logprobs > chosen).sum(dim=-1) + 1))
        if not parts:
            return None
        chosen, top_ids, top_logprobs, ranks = (torch.cat(p).to("cpu", non_blocking=True) for p in zip(*parts))
        asks_list = [(i, len(a.next_token_ids), a.num_top) for i, a in asks.items()]
        return PromptLogprobsOnTheWay(asks_list, chosen, top_ids, top_logprobs, ranks)

    def _sample(self, step: LaunchedStep, inputs: StepInputs, hidden: torch.Tensor, keep_logits: bool) -> None:
        """Samples on rank 0 and keeps what a step that samples once keeps: on rank 0 its output on the way
        to the host and how to record it; on every rank the tokens, for the next plan's PENDING inputs."""
        token_ids, sampled, rank_logits = self._draw(inputs, hidden)
        if sampled is not None:
            if keep_logits:
                step.logits = rank_logits.float()
            step.sampler_output = _to_host(sampled, token_ids)
            step.sampled, step.num_logprobs = inputs.sampled, inputs.sampling.num_logprobs
            step.record = None if inputs.sampled is None else self.sequences.record_sampled
        self.sequences.set_last_tokens(inputs.sample_rows, token_ids)

    def _graph_step(self, step: LaunchedStep, plan: GraphStep) -> None:
        """A decode plan staged in the graphs' buffer: replays its steps (``decode_graphs.py``) and keeps
        the tokens as ``_sample`` and ``_decode_steps`` keep theirs."""
        tokens = self.decode_graphs.replay(plan.num_seqs, plan.num_steps)
        if plan.budget is None:
            token_ids = tokens[0]
            step.path, step.sampler_output = StepPath.DECODE_GRAPH, _to_host(SamplerOutput(token_ids), token_ids)
            self.sequences.set_last_tokens(plan.sample_rows, token_ids)
            return
        self._keep_decode_steps(step, tokens, plan.sample_rows, plan.last, plan.budget, rank0=True)

    def _decode_steps(self, step: LaunchedStep, inputs: StepInputs) -> None:
        """Queues K decode steps, each fed the tokens the one before sampled; the host never waits.

        The token history is not recorded: these sequences use no penalties.
        """
        steps, n = inputs.decode_steps, len(inputs.input_ids)
        tokens = torch.empty(steps.num_steps, n, dtype=torch.int32, device=self.device)
        input_ids, metadata = inputs.input_ids, inputs.metadata
        for k in range(steps.num_steps):
            context_host = steps.context_lens_host[k]
            metadata = replace(metadata, slot_mapping=steps.slot_mapping[k], context_lens=steps.context_lens[k],
                               cu_seqlens_k=steps.cu_seqlens_k[k], max_seqlen_k=max(context_host),
                               context_lens_host=context_host)
            hidden, _ = self._forward(input_ids, steps.positions[k], metadata)
            input_ids, sampled, _ = self._draw(inputs, hidden)
            tokens[k] = input_ids
        self._keep_decode_steps(step, tokens, inputs.sample_rows, steps.last, steps.budget, sampled is not None)

    def _keep_decode_steps(self, step: LaunchedStep, tokens: torch.Tensor, sample_rows: torch.Tensor,
                           last: torch.Tensor, budget: np.ndarray, rank0: bool) -> None:
        """What a plan of several decode steps keeps: the tokens [K, n] on their way to the host (rank 0)
        with each sequence's step count, and each sequence's last token on the device for the next plan."""
        tokens = tokens.reshape(-1)
        self.sequences.set_last_tokens(sample_rows, tokens[last.long()])
        step.path = StepPath.MULTI_DECODE
        if rank0:
            step.sampler_output = SamplerOutput(tokens.to("cpu", non_blocking=True))
            step.decode_budget = budget
