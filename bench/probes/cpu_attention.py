"""Attention kernel and GELU kernel of a GPT-2 training step on CPU: which is faster, at which row width.

What two speed paths rest on: fused_gelu (GPT-2's Python ``gelu_new`` run as torch's fused tanh-GELU,
``gelu_pytorch_tanh``, the same function; a scratch GPT-2 is built with it) and attention_by_width (eager
attention for batches of at most 256 tokens under bf16 on CPU). Plain transformers, no qatune: a W1-shaped
GPT-2 (6x512x8, vocab 4,096) runs full training steps (forward, backward, clipping, fused AdamW) for each
variant, alternating variants within each round; prints milliseconds per step (median of rounds) and writes
bench/results/<this machine>/cpu_attention.json with the CPU it ran on.

    python bench/probes/cpu_attention.py     # ~3 minutes on 2 cores
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_machine import describe, headline, probe_parser, results_path, write_json

STEM = "cpu_attention"
SHAPES = [(16, 32), (8, 128), (4, 256)]  # (rows, tokens): same tokens per step at W1's batch size, wider rows
VARIANTS = [("sdpa", "gelu_new"), ("eager", "gelu_new"), ("sdpa", "gelu_pytorch_tanh"), ("eager", "gelu_pytorch_tanh")]


def build(attention: str, activation: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=4096, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, activation_function=activation)
    config._attn_implementation = attention
    model = GPT2LMHeadModel(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def ms_per_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, bf16: bool,
                steps: int = 8) -> float:
    for i in range(steps + 2):
        if i == 2:
            start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps * 1000


def main() -> int:
    args = probe_parser(__doc__, STEM, rounds=3).parse_args()
    info = {**describe(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    print(headline(info), flush=True)
    models = {variant: build(*variant) for variant in VARIANTS}
    results = []
    for precision in ("bf16", "fp32"):
        for rows, width in SHAPES:
            ids = torch.randint(0, 4096, (rows, width), generator=torch.Generator().manual_seed(0))
            times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    times[variant].append(ms_per_step(*models[variant], ids, precision == "bf16"))
            base = statistics.median(times[VARIANTS[0]])
            for (attention, activation), values in times.items():
                median = statistics.median(values)
                results.append({"precision": precision, "rows": rows, "tokens": width, "attention": attention,
                                "activation": activation, "ms_per_step": round(median, 1),
                                "rounds_ms": [round(v, 1) for v in values],
                                "speedup_vs_sdpa_gelu_new": round(base / median, 2)})
                print(f"{precision} {rows:2}x{width:<3} {attention:5} {activation:17} {median:7.1f} ms/step  "
                      f"x{base / median:.2f}", flush=True)
    write_json(args.json or results_path(STEM), {"machine": info, "results": results,
                                                 "model": "GPT-2 6x512x8, vocab 4096 (21M parameters)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
