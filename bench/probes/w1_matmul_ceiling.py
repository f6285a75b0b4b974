"""How much of the matmul peak W1's own matrix products can reach: the ceiling on the loop's MFU.

MFU (bench/w1_loop_vs_trainer.py) is 6 x parameters x tokens/s over the peak of one large n x n x n
product. A training step cannot beat the time its matrix products take at the shapes the step has, so
this times exactly those products, alone, back to back: for every linear layer of W1's GPT-2 (6 layers
x 512, vocabulary 4096) and each batch size, the forward X W^T, and the backward dY W and dY^T X, at
M = batch x tokens per row (21.2 in W1, as the W1 loop's results record). Attention's own products
and everything that is not a matrix product are left out, so the ceiling is generous: a step that did
nothing else would reach it.

    ceiling MFU = 6 x parameters x M / (time of one step's products) / peak

Run for bf16 (weights and activations in bf16, as qatune trains on CPU) and fp32, each against its
own peak (bf16 only where it is native). Prints a table per batch size, and, against the W1 loop measured on
this machine (bench/results/<this machine>/w1_loop_vs_trainer.json), the share of a step its products take.

    python bench/probes/w1_matmul_ceiling.py
    python bench/probes/w1_matmul_ceiling.py --batch-sizes 16 64 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_machine import describe_torch, headline, json_option, matmul_peak, native_bf16, results_path, write_json
from workloads import W1

LAYERS, WIDTH, VOCAB, POSITIONS = W1.layers, W1.width, W1.vocab, W1.positions
STEM = "w1_matmul_ceiling"


def linear_shapes() -> list[tuple[int, int]]:
    """(in, out) of every matrix product with a weight in one forward of W1's GPT-2, LM head included."""
    block = [(WIDTH, 3 * WIDTH), (WIDTH, WIDTH), (WIDTH, 4 * WIDTH), (4 * WIDTH, WIDTH)]
    return block * LAYERS + [(WIDTH, VOCAB)]


def parameters() -> int:
    """W1's parameter count as the W1 loop's MFU takes it: the tied LM head once, the position
    embeddings (POSITIONS x WIDTH, no multiply-adds) not at all."""
    per_layer = sum(k * n + n for k, n in linear_shapes()[:4]) + 4 * WIDTH  # + two LayerNorms
    return VOCAB * WIDTH + LAYERS * per_layer + 2 * WIDTH


def step_seconds(tokens: int, dtype: torch.dtype, repeats: int) -> float:
    """Median time of one step's products (forward and both backward products of every linear layer)."""
    operands = []
    for k, n in linear_shapes():
        operands.append((torch.randn(tokens, k, dtype=dtype), torch.randn(n, k, dtype=dtype) / k**0.5,
                         torch.randn(tokens, n, dtype=dtype)))

    def step() -> None:
        for x, w, dy in operands:
            torch.nn.functional.linear(x, w)   # forward
            dy.mm(w)                           # gradient of the input
            dy.t().mm(x)                       # gradient of the weight

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--tokens-per-row", type=float, default=None,
                        help="default: W1's mean from the W1 loop's results (21.2)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--loop", type=Path, default=None, metavar="PATH",
                        help="the W1 loop's JSON from this machine (default: bench/results/<this machine>/"
                             "w1_loop_vs_trainer.json)")
    json_option(parser, STEM)
    args = parser.parse_args()
    args.loop = args.loop or results_path("w1_loop_vs_trainer")
    per_row = args.tokens_per_row
    measured_step = None
    if args.loop.exists():
        w1 = json.loads(args.loop.read_text())
        best = w1["summary"]["qatune"]
        per_row = per_row or w1["runs"]["qatune"][0]["row_tokens_mean"]
        batch_size = w1["args"].get("batch_size", W1.batch_size)
        steps = -(-w1["args"]["rows"] // batch_size)
        loop_precision = w1.get("precision") or ("bf16" if w1["args"].get("bf16") else "fp32")
        measured_step = {"batch_size": batch_size, "ms_per_step": 1e3 * best["seconds"] / steps,
                         "mfu": best["mfu"], "precision": loop_precision, "file": str(args.loop),
                         "cpu": w1["machine"]["cpu"]}
    per_row = per_row or 21.2
    info = describe_torch()
    print(headline(info), flush=True)
    dtypes = {"bf16": torch.bfloat16} if native_bf16() else {}
    dtypes["fp32"] = torch.float32
    peaks = {name: matmul_peak(dtype) for name, dtype in dtypes.items()}
    print("matmul peak: " + ", ".join(f"{name} {peak / 1e9:.0f} GFLOP/s" for name, peak in peaks.items()))
    params = parameters()
    print(f"W1 GPT-2: {params / 1e6:.1f}M parameters, {per_row:.1f} tokens per row, {len(linear_shapes())} linear "
          f"layers (3 products each per step)\n")
    print(f"{'batch':>5} {'tokens':>6} " + " ".join(f"{name + ' ms':>9} {name + ' ceiling':>13}" for name in dtypes))
    rows = []
    for batch in args.batch_sizes:
        tokens = round(batch * per_row)
        row: dict = {"batch_size": batch, "tokens": tokens}
        for name, dtype in dtypes.items():
            seconds = step_seconds(tokens, dtype, args.repeats)
            row[name] = {"ms_per_step": 1e3 * seconds, "ceiling_mfu": 6 * params * tokens / seconds / peaks[name]}
        rows.append(row)
        print(f"{batch:5d} {tokens:6d} " + " ".join(
            f"{row[name]['ms_per_step']:9.2f} {100 * row[name]['ceiling_mfu']:12.1f}%" for name in dtypes), flush=True)
    if measured_step:
        same = next((r for r in rows if r["batch_size"] == measured_step["batch_size"]), None)
        name = measured_step["precision"]
        if same and name in same:
            share = same[name]["ms_per_step"] / measured_step["ms_per_step"]
            measured_step["products_share_of_step"] = share
            # The peak moves from run to run (2.1-2.6 TFLOP/s in bf16 on the same machine): against the peak the
            # loop's MFU was measured with, a step doing nothing but its products would reach mfu / share.
            measured_step["ceiling_vs_its_peak"] = measured_step["mfu"] / share
            print(f"\nW1 loop as measured ({args.loop.name}, {measured_step['cpu']}, {name}, "
                  f"batch {measured_step['batch_size']}): "
                  f"{measured_step['ms_per_step']:.0f} ms per step, MFU {100 * measured_step['mfu']:.1f}%; its "
                  f"products alone take {same[name]['ms_per_step']:.0f} ms ({100 * share:.0f}% of the step): a step "
                  f"doing nothing else would reach {100 * measured_step['ceiling_vs_its_peak']:.1f}% of the peak that "
                  f"MFU was measured against ({100 * same[name]['ceiling_mfu']:.1f}% of this run's peak)")
    write_json(args.json or results_path(STEM), {
        "machine": info, "peaks": peaks, "parameters": params, "tokens_per_row": per_row, "rows": rows,
        "w1_loop": measured_step,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
