"""Projections of a few rows, chained as a decode step runs a decoder layer's four of them.

    python -m twinplane.kernels.bench_skinny [--rows 1 2 4 8] [--layers 28]

Random weights in Qwen3-0.6B's shapes for every layer (together far more than the L2 cache
holds, as a step reads them once), and per layer: norm + q/k/v, the output projection (of a
stand-in attention output: no attention), norm + gate/up + SiLU-and-mul, down. The chain is
timed in a CUDA graph (``triton.testing.do_bench_cudagraph``) three ways:

- ``layers``: what steps of more rows run (the norm kernel, cuBLAS, the SiLU-and-mul kernel);
- ``skinny``: ``kernels/skinny_gemm.py`` launched without programmatic dependent launch;
- ``skinny+PDL``: as decode steps of 1-4 rows run it.

Rows above ``skinny_gemm.MAX_ROWS`` are timed too (the limit is raised for the run), to show
where the skinny kernel stops paying. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from twinplane.dataplane.layers.layernorm import add_rms_norm
from twinplane.kernels import skinny_gemm
from twinplane.kernels.silu_mul import silu_mul

HIDDEN, Q, KV, INTERMEDIATE = 1024, 2048, 1024, 3072  # Qwen3-0.6B
EPS = 1e-6


def make_layers(count: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 0.02

    def norm() -> torch.Tensor:
        return torch.rand(HIDDEN, device=device, dtype=torch.bfloat16) + 0.5

    return [dict(qkv=weight(Q + 2 * KV, HIDDEN), o=weight(HIDDEN, Q), gate_up=weight(2 * INTERMEDIATE, HIDDEN),
                 down=weight(HIDDEN, INTERMEDIATE), input_norm=norm(), post_norm=norm()) for _ in range(count)]


def layers_chain(layers: list[dict], hidden: torch.Tensor, residual: torch.Tensor, attn: torch.Tensor,
                 project: Callable = F.linear) -> torch.Tensor:
    """The chain as steps of more rows run it, each projection through ``project`` (cuBLAS, or
    the model's own dispatch). ``attn`` [rows, Q] stands in for the attention output."""
    for p in layers:
        x, residual = add_rms_norm(hidden, residual, p["input_norm"], EPS)
        project(x, p["qkv"])
        x, residual = add_rms_norm(project(attn, p["o"]), residual, p["post_norm"], EPS)
        hidden = project(silu_mul(project(x, p["gate_up"])), p["down"])
    return hidden + residual


def skinny_chain(layers: list[dict], hidden: torch.Tensor, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    for p in layers:
        _, residual = skinny_gemm.skinny_norm_linear(hidden, residual, p["input_norm"], EPS, p["qkv"])
        o = skinny_gemm.skinny_linear(attn, p["o"])
        act, residual = skinny_gemm.skinny_norm_linear(o, residual, p["post_norm"], EPS, p["gate_up"], glu=True)
        hidden = skinny_gemm.skinny_linear(act, p["down"])
    return hidden + residual


def graph_us(fn: Callable[[], torch.Tensor], pdl: bool = True) -> tuple[float, torch.Tensor]:
    """Microseconds per replay of fn in a CUDA graph (median), and fn's result; ``pdl=False``
    launches the skinny kernels without programmatic dependent launch."""
    launch_pdl = skinny_gemm.launch_pdl
    if not pdl:
        skinny_gemm.launch_pdl = lambda device: False
    try:
        out = fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1000, out
    finally:
        skinny_gemm.launch_pdl = launch_pdl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    device = torch.device("cuda")
    skinny_gemm.MAX_ROWS = max(skinny_gemm.MAX_ROWS, *args.rows)
    torch.manual_seed(0)
    layers = make_layers(args.layers, device)
    print(f"{args.layers} layers of Qwen3-0.6B's projections; microseconds per chain (per layer)")
    print(f"{'rows':>4} {'layers':>16} {'skinny':>16} {'skinny+PDL':>16}  speed-up  max |diff| / max |layers|")
    for rows in args.rows:
        hidden = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
        residual = torch.randn_like(hidden)
        attn = torch.randn(rows, Q, device=device, dtype=torch.bfloat16)
        base, expected = graph_us(lambda: layers_chain(layers, hidden, residual, attn))
        plain, _ = graph_us(lambda: skinny_chain(layers, hidden, residual, attn), pdl=False)
        pdl, got = graph_us(lambda: skinny_chain(layers, hidden, residual, attn))
        diff = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
        cells = "".join(f" {t:9.1f} ({t / args.layers:4.1f})" for t in (base, plain, pdl))
        print(f"{rows:>4}{cells}  {base / pdl:7.2f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
