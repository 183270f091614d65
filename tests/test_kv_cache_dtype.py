"""--kv-cache-dtype fp8: the KV cache in float8_e4m3fn, from the flag to the cache, the torch backend's
stores and reads, the backend choice, and a request through both planes, on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.test_dp_helpers import PlanBuilder
from twinplane.dataplane.attention_backends import _FACTORIES, get_attention_backend
from twinplane.dataplane.attention_backends.base import AttentionBackend, AttentionMetadata
from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend, write_kv_by_slot
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.convert import describe_to_pb
from twinplane.dataplane.model_runner import ModelRunner
from twinplane.dataplane.plan import StepPlan

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself, and a
# subnormal one (below 2^-6, spaced 2^-9 apart) by at most 2^-10
RELATIVE, ABSOLUTE = 2.0 ** -4, 2.0 ** -10


def test_the_kv_cache_dtype_is_auto_or_fp8() -> None:
    assert DataPlaneConfig(model="dummy:tiny-qwen3").kv_cache_dtype == "auto"
    assert DataPlaneConfig(model="dummy:tiny-qwen3", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    for bad in ("fp16", "float8_e4m3fn", "FP8", ""):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype must be one of \('auto', 'fp8'\), got '{bad}'"):
            DataPlaneConfig(model="dummy:tiny-qwen3", kv_cache_dtype=bad)


class _Named(AttentionBackend):
    """A stand-in for a backend whose kernels this machine may lack."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        raise AssertionError("not run")

    def forward(self, q, k_cache, v_cache, metadata, scale):
        raise AssertionError("not run")


def test_fp8_picks_a_backend_that_reads_it_and_refuses_flash_attention(monkeypatch) -> None:
    def never(name: str):
        def factory():
            pytest.fail(f"{name} was loaded for an fp8 KV cache")
        return factory

    for name in ("flash_attn_4", "flash_attn_2"):  # FlashAttention is never tried, installed or not
        monkeypatch.setitem(_FACTORIES, name, never(name))
    monkeypatch.delitem(_FACTORIES, "triton", raising=False)
    assert get_attention_backend("auto", "cpu", kv_cache_dtype="fp8").name == "torch"
    assert get_attention_backend("auto", "cuda", True, "fp8").name == "torch"  # no triton backend registered
    assert get_attention_backend("torch", "cuda", True, "fp8").name == "torch"
    for name in ("flash_attn_4", "flash_attn_2"):
        with pytest.raises(ValueError, match=rf"attention backend '{name}' reads a 16-bit KV cache only; "
                                             r"--kv-cache-dtype fp8 runs on the triton or torch backend"):
            get_attention_backend(name, "cuda", True, "fp8")
    monkeypatch.setitem(_FACTORIES, "triton", lambda: _Named("triton"))
    assert get_attention_backend("auto", "cuda", True, "fp8").name == "triton"  # first, where it is registered
    assert get_attention_backend("auto", "cuda", False, "fp8").name == "torch"  # the kernels are for 16-bit models
    assert get_attention_backend("auto", "cpu", True, "fp8").name == "torch"

    def missing():
        raise ImportError("no triton here")

    monkeypatch.setitem(_FACTORIES, "triton", missing)
    assert get_attention_backend("auto", "cuda", True, "fp8").name == "torch"
    # a 16-bit cache keeps FlashAttention first on CUDA
    monkeypatch.setitem(_FACTORIES, "flash_attn_4", lambda: _Named("flash_attn_4"))
    assert get_attention_backend("auto", "cuda", True).name == "flash_attn_4"
    assert get_attention_backend("flash_attn_4", "cuda", True, "auto").name == "flash_attn_4"


def _runner(**config) -> ModelRunner:
    return ModelRunner(DataPlaneConfig(model="dummy:tiny-qwen3", device="cpu", block_size=16, cpu_kv_cache_gib=1 / 1024,
                                       max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, **config))


def test_an_fp8_cache_holds_twice_the_blocks_of_16_bits_in_the_same_memory() -> None:
    full, half = _runner(), _runner(dtype="bfloat16")
    fp8, fp8_of_half = _runner(kv_cache_dtype="fp8"), _runner(dtype="bfloat16", kv_cache_dtype="fp8")
    for runner in (fp8, fp8_of_half):
        assert runner.kv_cache.dtype == FP8
        assert all(layer.k_cache.dtype == layer.v_cache.dtype == FP8 for layer in runner.model.attention_layers())
        assert runner.backend.name == "torch"
    assert (full.kv_cache.dtype, half.kv_cache.dtype) == (torch.float32, torch.bfloat16)
    assert fp8_of_half.num_kv_blocks == 2 * half.num_kv_blocks == 4 * full.num_kv_blocks
    assert fp8.num_kv_blocks == fp8_of_half.num_kv_blocks
    per_block = 2 * 2 * 16 * 2 * 16  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16: one byte each
    assert fp8.num_kv_blocks == (1 << 20) // per_block
    described = {name: describe_to_pb(r.describe()) for name, r in
                 [("full", full), ("half", half), ("fp8", fp8), ("fp8 of half", fp8_of_half)]}
    assert {name: d.kv_cache_dtype for name, d in described.items()} == {
        "full": "float32", "half": "bfloat16", "fp8": "float8_e4m3fn", "fp8 of half": "float8_e4m3fn"}
    assert described["fp8 of half"].dtype == "bfloat16"  # the weights' and activations' dtype stays
    bytes_per_token = {name: d.kv_bytes_per_token for name, d in described.items()}
    assert bytes_per_token == {"full": 512, "half": 256, "fp8": 128, "fp8 of half": 128}


def test_an_fp8_runner_steps_close_to_a_float32_one() -> None:
    """The same weights (one seed): prompt logits differ only by the cache's rounding (attention reads
    every prompt token's K/V back from the cache), by about 2^-4 of their scale at most, as attention's
    outputs do (the test below); and the cache really holds the prompt's K/V."""
    prompt = [5, 17, 301, 4000, 42, 7, 999, 12, 8, 1234, 77, 3]
    logits = {}
    for kv in ("auto", "fp8"):
        runner = _runner(kv_cache_dtype=kv)
        builder = PlanBuilder(16)
        out, logits[kv] = runner.step_with_logits(StepPlan(0, [builder.schedule(builder.new_seq(1, prompt))]))
        assert len(out.sampled_token_ids) == 1
        stored = runner.kv_cache[:, :, 0, :len(prompt)].float()
        assert stored.abs().sum() > 0 and not stored.isnan().any()
    assert not torch.equal(logits["auto"], logits["fp8"])
    torch.testing.assert_close(logits["fp8"], logits["auto"], rtol=0.0,
                               atol=RELATIVE * logits["auto"].abs().max().item())


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_write_kv_clamps_to_the_fp8_range_and_never_stores_nan(device: str) -> None:
    """A cast past e4m3's range gives NaN in torch versions whose cast does not saturate (e4m3fn has no
    infinity); the store clamps first, so every version stores +-448."""
    with torch.device(device):
        k = torch.tensor([[[1000.0, -1000.0, 0.1, 3.0]], [[448.0, -460.0, 1e30, -float("inf")]]])  # [2, 1, 4]
        v = -k
        k_cache, v_cache = torch.zeros(2, 2, 1, 4, dtype=FP8), torch.zeros(2, 2, 1, 4, dtype=FP8)
        write_kv_by_slot(k, v, k_cache, v_cache, torch.tensor([3, 0], dtype=torch.int32))
        from_bf16 = torch.zeros(4, 1, 1, 4, dtype=FP8)  # a bfloat16 model's K/V go in the same way
        TorchAttentionBackend().write_kv(k.bfloat16(), v.bfloat16(), from_bf16, from_bf16.clone(),
                                         torch.tensor([1, -1]))
    keys, values = k_cache.flatten(0, 1).cpu().float(), v_cache.flatten(0, 1).cpu().float()
    assert not keys.isnan().any() and not values.isnan().any()
    assert keys[3, 0].tolist() == [FP8_MAX, -FP8_MAX, 0.1015625, 3.0]  # 0.1 rounded to 3 mantissa bits
    assert keys[0, 0].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, -FP8_MAX]
    assert torch.equal(values, -keys)
    assert keys[1:3].abs().sum() == 0  # slots 1 and 2 untouched
    from_bf16 = from_bf16.cpu().float()
    assert from_bf16[1, 0, 0].tolist() == [FP8_MAX, -FP8_MAX, 0.1015625, 3.0] and from_bf16[0].sum() == 0


def _metadata(query_lens: list[int], context_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(cu_seqlens_q=cu, cu_seqlens_k=None, context_lens=torch.tensor(context_lens),
                             max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens), slot_mapping=None,
                             block_tables=tables, query_lens_host=query_lens, context_lens_host=context_lens)


def test_attention_over_an_fp8_cache_is_attention_over_the_rounded_values() -> None:
    """Decode and prefill rows over an fp8 cache: float32 attention over K/V rounded to e4m3 (reads convert
    back to q's dtype), so close to attention over the exact values. Output = sum_j p_j v_j: rounding V
    moves it by at most 2^-4 max|v|; rounding K moves each score by at most 2^-4 of the terms of its dot
    product (scores of order 1 here), which to first order moves the weights p_j, and the output, by about
    as much again: 2 * 2^-4 max|v| in all."""
    torch.manual_seed(0)
    heads, kv_heads, d, block_size, num_blocks = 4, 2, 16, 4, 12
    query_lens, context_lens = [1, 1, 5], [9, 1, 14]
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 11, 8, 4]], dtype=torch.int32)
    slots = torch.cat([tables[i, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
                       for i, n in enumerate(context_lens)]).to(torch.int32)
    k, v = torch.randn(len(slots), kv_heads, d), torch.randn(len(slots), kv_heads, d)
    q = torch.randn(sum(query_lens), heads, d)
    metadata = _metadata(query_lens, context_lens, tables)
    backend = TorchAttentionBackend()

    def attend(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = (torch.zeros(num_blocks, block_size, kv_heads, d, dtype=dtype) for _ in range(2))
        backend.write_kv(k, v, k_cache, v_cache, slots)
        if dtype == FP8:  # each stored value within e4m3's rounding of the exact one
            stored = k_cache.flatten(0, 1)[slots.long()].float()
            assert ((stored - k).abs() <= RELATIVE * k.abs() + ABSOLUTE).all()
        return backend.forward(q, k_cache, v_cache, metadata, d ** -0.5)

    fp8, exact = attend(FP8, k, v), attend(torch.float32, k, v)
    assert fp8.dtype == torch.float32 and not fp8.isnan().any()
    torch.testing.assert_close(fp8, attend(torch.float32, k.to(FP8).float(), v.to(FP8).float()),
                               rtol=1e-5, atol=1e-6)
    assert not torch.equal(fp8, exact)  # the cache rounds: it is fp8, not float32
    torch.testing.assert_close(fp8, exact, rtol=0.0, atol=2 * RELATIVE * v.abs().max().item())


def test_a_server_with_an_fp8_cache_answers_through_both_planes(planes_factory) -> None:
    planes = planes_factory("dummy:tiny-qwen3", "--block-size", "16", "--max-model-len", "128",
                            "--kv-cache-dtype", "fp8")
    with planes.client() as client:
        info = client.model_info(timeout=30)
        assert (info.kv_cache_dtype, info.dtype, info.kv_bytes_per_token) == ("float8_e4m3fn", "float32", 128)
        for prompt in ([5, 17, 301, 4000, 42], list(range(100, 140))):  # a prefill, then one over 2 blocks
            chunks = list(client.generate(token_ids=prompt, max_tokens=6, temperature=0, ignore_eos=True,
                                          timeout=60))
            tokens = [t for c in chunks for t in c.token_ids]
            assert len(tokens) == 6 and chunks[-1].finish_reason == "length"
            assert all(0 <= t < 49152 for t in tokens)


def test_the_flag_reaches_a_child_data_plane_and_its_config(monkeypatch) -> None:
    """serve and run start their data plane as a child, and bench a server: each passes the flag on."""
    from twinplane.clients import bench
    from twinplane.clients.cli import _dataplane_child, _dataplane_config, build_parser

    parser = build_parser()
    for argv, expected in ((["serve", "--kv-cache-dtype", "fp8"], "fp8"), (["serve"], "auto"),
                           (["run", "--kv-cache-dtype=fp8", "hi"], "fp8")):
        args = parser.parse_args(["--log-level", "info", *argv])
        assert _dataplane_config(args).kv_cache_dtype == expected
        child = _dataplane_child(args, "unix:///tmp/dp.sock")
        passed = parser.parse_args(child.command[child.command.index("--log-level"):])
        assert passed.command == "dataplane" and _dataplane_config(passed).kv_cache_dtype == expected, argv
    started = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda command, **_: started.append(command))
    bench._start_server(parser.parse_args(["bench", "--kv-cache-dtype", "fp8", "--api-server-count", "2"]))[2].close()
    served = parser.parse_args(started[0][started[0].index("--log-level"):])
    assert served.command == "serve" and _dataplane_config(served).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):  # argparse refuses other values
        parser.parse_args(["dataplane", "--kv-cache-dtype", "int8"])
