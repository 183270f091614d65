"""Decode-sized projections on quack's Hopper GEMM against cuBLAS, one shape at a time and chained.

    python -m twinplane.kernels.bench_wave [--rows 8 16 32 64 96 128 160 192 256] [--layers 28]

Random weights in Qwen3-0.6B's shapes for every layer (``bench_skinny``'s), timed in CUDA graphs
(``triton.testing.do_bench_cudagraph``, median), microseconds a call:

- each projection (q/k/v, o, gate/up, down) as a chain of one call per layer's weights, cuBLAS
  against ``wave_gemm.wave_linear`` whether or not its output fits one wave; ``*`` marks the one
  that ``linear`` takes for that shape (quack where the 64 x 64 tiles fit on the SMs at once;
  1-4 rows go to the skinny kernel instead, so the default rows start at 8);
- a decoder layer's chain (``bench_skinny.layers_chain``: norms, the four projections, SiLU-and-mul)
  with cuBLAS against the model's own dispatch (``dataplane.layers.linear.linear``).

Needs an sm_90 GPU with quack-kernels installed.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from twinplane.dataplane.layers.linear import linear
from twinplane.kernels import wave_gemm
from twinplane.kernels.bench_skinny import HIDDEN, Q, graph_us, layers_chain, make_layers

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def projection_us(layers: list[dict], name: str, x: torch.Tensor, project) -> float:
    """Microseconds a call of ``project`` over each layer's ``name`` weight in turn."""
    out, _ = graph_us(lambda: [project(x, p[name]) for p in layers])
    return out / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128, 160, 192, 256])
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not wave_gemm.in_use(device, torch.bfloat16):
        raise SystemExit("quack's GEMM is not in use here (needs sm_90 and quack-kernels)")
    torch.manual_seed(0)
    layers = make_layers(args.layers, device)
    print(f"{args.layers} layers of Qwen3-0.6B's projections; us a call, cuBLAS / quack (* what `linear` takes), "
          f"then a layer's chain")
    shapes = "".join(f" {name + ' ' + 'x'.join(map(str, layers[0][name].shape)):>22}" for name in PROJECTIONS)
    print(f"{'rows':>4}{shapes} {'chain: cuBLAS / linear':>24}")
    for rows in args.rows:
        cells = []
        for name in PROJECTIONS:
            weight = layers[0][name]
            x = torch.randn(rows, weight.shape[1], device=device, dtype=torch.bfloat16)
            expected = F.linear(x, weight)
            diff = (wave_gemm.wave_linear(x, weight).float() - expected.float()).abs().max().item()
            if not wave_gemm.in_use(device, torch.bfloat16):
                raise SystemExit("quack's GEMM failed (logged above)")
            if diff > 0.05 * expected.float().abs().max().item():
                raise SystemExit(f"quack's {name} at {rows} rows differs from cuBLAS by {diff}")
            cublas = projection_us(layers, name, x, F.linear)
            quack = projection_us(layers, name, x, wave_gemm.wave_linear)
            wave = wave_gemm.supports(x, weight)
            cells.append(f"{cublas:6.2f}{'' if wave else '*'} / {quack:6.2f}{'*' if wave else ''}")
        hidden = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
        residual, attn = torch.randn_like(hidden), torch.randn(rows, Q, device=device, dtype=torch.bfloat16)
        base, _ = graph_us(lambda: layers_chain(layers, hidden, residual, attn))
        model, _ = graph_us(lambda: layers_chain(layers, hidden, residual, attn, linear))
        per_layer = f"{base / args.layers:.1f} / {model / args.layers:.1f}"
        print(f"{rows:>4}" + "".join(f" {c:>22}" for c in cells) + f" {per_layer:>24}")


if __name__ == "__main__":
    main()
