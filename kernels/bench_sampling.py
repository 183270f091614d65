"""The temperature sampler alone, at the row counts of decode steps.

    python -m twinplane.kernels.bench_sampling [--rows 1 4 16 32 64 128 192 256] [--vocab 151936]

For each row count it times ``sample_temperature`` on random bf16 logits (Qwen's vocabulary by
default) with a draw key, as decode graphs call it: every row sampled at T = 0.6, and every row
greedy. Beside them, torch's own temperature draw (softmax of the float32 logits / T, then
``torch.multinomial``) and the read of the logits alone at the GPU's read peak, the floor of a
pass over them. Times are CUDA graphs (``triton.testing.do_bench_cudagraph``). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch
import triton

from twinplane.kernels.bench_attention import read_peak
from twinplane.kernels.sampling import sample_temperature


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 192, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()
    torch.manual_seed(0)
    peak = read_peak()
    print(f"read peak {peak:.2f} TB/s; us a call:")
    print(f"{'rows':>5} {'sampled':>9} {'greedy':>9} {'torch':>9} {'read floor':>11}")
    for rows in args.rows:
        logits = (torch.randn(rows, args.vocab, device="cuda") * 3).to(torch.bfloat16)
        temperature = torch.full((rows,), args.temperature, device="cuda")
        sampled = torch.zeros(rows, dtype=torch.bool, device="cuda")
        out, key = torch.empty(rows, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
        times = [time_us(lambda greedy=greedy: sample_temperature(logits, temperature, greedy, out=out, draw_key=key))
                 for greedy in (sampled, ~sampled)]
        times.append(time_us(lambda: torch.multinomial((logits.float() / args.temperature).softmax(-1), 1)))
        floor = logits.numel() * logits.element_size() / (peak * 1e12) * 1e6
        print(f"{rows:>5} {times[0]:>9.1f} {times[1]:>9.1f} {times[2]:>9.1f} {floor:>11.1f}")


if __name__ == "__main__":
    main()
