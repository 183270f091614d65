"""Our Triton kernels compiled for sm_90 (an H100 / H200) without a GPU: decode attention (over a
bf16 and a float8 cache) and its merge, the skinny projections, RoPE/K/V store, the KV writer,
SiLU-and-mul, RMSNorm and the sampler (with and without token masks), in the variants their launch
wrappers pick.

Triton's interpreter (test_kernels_interpreted.py) runs the kernels as Python, so it checks
what they compute but not that they compile: Triton's compiler rejects, for example, a value
that a branch redefines with another shape, and the interpreter does not notice. Compiling
needs only Triton's frontend and the ptxas it ships with, no CUDA device.
"""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _compile(kernel, constexprs: dict, pointers: dict[str, str], floats: tuple[str, ...] = (), aligned: bool = False,
             ir: str = "ptx") -> str:
    """Compiles ``kernel`` for sm_90 with these constexprs; pointer arguments get the element type
    that ``pointers`` names (default bf16), ``floats`` are fp32 scalars, the rest int32. ``aligned``: every
    pointer and int argument divisible by 16, as Triton specializes a launch whose arguments are (torch's
    allocations and the strides of a model's shapes), so loads vectorize as they do on the GPU. Returns the
    PTX, or the IR that ``ir`` names (``ttgir``: after Triton's pipeliner)."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "bf16")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in names
             if aligned and signature[name][0] in "*i"}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()}, attrs=attrs)
    return triton.compile(source, target=HOPPER).asm[ir]


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("num_splits,from_qkv,has_norm,group,prefetch",
                         [(1, False, False, 2, False), (2, True, True, 2, False), (4, True, False, 4, True),
                          (16, True, True, 2, True), (8, False, False, 7, True), (1, True, True, 2, True)])
def test_decode_attention_compiles(cache, num_splits, from_qkv, has_norm, group, prefetch):
    """Over a float8 cache with one split, as ``_launch`` picks it on sm_90, the tiles convert through
    ``e4m3_to_f16``'s PTX (its text is in the kernel's); otherwise through Triton's conversion. The page
    numbers come through ``load_page``'s PTX, and with the stages ``key_stages`` gives a float8 cache's one
    split, the K/V tiles load two ahead: the asynchronous copies wait for all but the last two groups."""
    from twinplane.kernels.decode_attention import _decode_kernel, _merge_kernel, key_stages

    ints = {name: "i32" for name in ("block_table_ptr", "context_lens_ptr", "order_ptr", "positions_ptr", "slot_ptr")}
    floats32 = {name: "fp32" for name in ("lse_ptr", "cos_sin_ptr", "q_norm_ptr", "k_norm_ptr")}
    out = "fp32" if num_splits > 1 else "bf16"
    e4m3_ptx = cache == "fp8e4nv" and num_splits == 1
    constexprs = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=128, BLOCK_N=64,
                      PAGE=256, NUM_SPLITS=num_splits, ORDERED=True, FROM_QKV=from_qkv, HEADS=8 * group, KV_HEADS=8,
                      HAS_NORM=has_norm, PREFETCH=prefetch, PDL=True, E4M3_PTX=e4m3_ptx, PAGE_PTX=True,
                      STAGES=key_stages(num_splits, cache == "fp8e4nv"))
    pointers = {**ints, **floats32, "out_ptr": out, "q_norm_ptr": "bf16", "k_norm_ptr": "bf16", "k_ptr": cache,
                "v_ptr": cache}
    ptx = _compile(_decode_kernel, constexprs, pointers, floats=("eps", "scale_log2"))
    assert "griddepcontrol.wait" in ptx
    assert ("mov.b32 {lo, hi}" in ptx) == e4m3_ptx
    assert "ld.global.nc.b32" in ptx
    ttgir = _compile(_decode_kernel, constexprs, pointers, floats=("eps", "scale_log2"), aligned=True, ir="ttgir")
    in_flight = {int(n) for n in re.findall(r"async_wait .*num = (\d+)", ttgir)}
    assert max(in_flight) == (2 if e4m3_ptx else 0), in_flight
    if num_splits > 1:
        ptx = _compile(_merge_kernel, dict(HEAD_DIM=128, NUM_SPLITS=num_splits, PDL=True),
                       {"part_ptr": "fp32", "lse_ptr": "fp32"})
        assert "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("rows,add,norm,glu,bias", [
    (1, False, False, False, False), (2, False, False, False, True), (3, False, True, False, False),
    (4, True, True, False, True), (1, True, True, True, False), (4, True, True, True, True)])
def test_skinny_projection_compiles_and_loads_weights_before_it_waits(rows, add, norm, glu, bias):
    """Every variant compiles, and the weight loads come before ``griddepcontrol.wait`` in the PTX:
    the loads the kernel is there to overlap with the kernel ahead."""
    from twinplane.kernels.skinny_gemm import _skinny_kernel

    ptx = _compile(_skinny_kernel, dict(ROWS=rows, K=1000, K_PAD=1024, BLOCK_N=16, ADD=add, NORM=norm, GLU=glu,
                                        BIAS=bias, PDL=True), {}, floats=("eps",))
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    assert "ld.global" in ptx[:wait]


@pytest.mark.parametrize("add,d", [(False, 1024), (True, 1024), (True, 4000)])
def test_rms_norm_compiles_and_loads_its_weight_before_it_waits(add, d):
    from twinplane.kernels.rms_norm import _rms_norm_kernel

    ptx = _compile(_rms_norm_kernel, dict(D=d, BLOCK=triton.next_power_of_2(d), ADD=add, PDL=True), {},
                   floats=("eps",))
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait and "ld.global" in ptx[:wait]
    assert "ld.global" in ptx[wait:]  # x, after the wait


@pytest.mark.parametrize("has_norm", [True, False])
def test_rope_store_compiles(has_norm):
    from twinplane.kernels.rope_store import _rope_store_kernel

    _compile(_rope_store_kernel, dict(HEADS=16, KV_HEADS=8, HEADS_PAD=16, KV_HEADS_PAD=8, HALF=64, HAS_NORM=has_norm),
             {"positions_ptr": "i32", "slot_ptr": "i32", "cos_sin_ptr": "fp32"}, floats=("eps",))


def test_kv_writer_silu_mul_and_sampler_compile():
    from twinplane.kernels.kv_writer import _store_kv_kernel
    from twinplane.kernels.sampling import _partial_kernel, _pick_kernel
    from twinplane.kernels.silu_mul import _silu_mul_kernel

    _compile(_store_kv_kernel, dict(ROW=1024, BLOCK=1024), {"slot_ptr": "i32"})
    for pdl in (False, True):
        ptx = _compile(_silu_mul_kernel, dict(D=3072, BLOCK=1024, PDL=pdl), {})
        assert ("griddepcontrol.wait" in ptx) == pdl
    for pdl in (False, True):
        stats = {"temperature_ptr": "fp32", "greedy_ptr": "i1", "best_score_ptr": "fp32", "best_index_ptr": "i32",
                 "tile_max_ptr": "fp32", "tile_sum_ptr": "fp32", "u_ptr": "fp32", "masks_ptr": "u8",
                 "mask_index_ptr": "i32"}
        for row_seeds, masked in ((False, False), (True, False), (False, True), (True, True)):
            _compile(_partial_kernel, dict(ROW_SEEDS=row_seeds, MASKED=masked, BLOCK=1024, TILES=4, PDL=pdl),
                     {**stats, "seeds_ptr": "i64"})
        for out, advance, masked in (("i32", True, False), ("i64", False, False), ("i32", True, True)):
            _compile(_pick_kernel, dict(ADVANCE=advance, MASKED=masked, STRIDE=1 << 16, BLOCK=1024, BLOCK_S=64,
                                        TILES_PAD=256, PDL=pdl), {**stats, "out_ptr": out, "key_ptr": "i64"})
