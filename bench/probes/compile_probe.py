"""Is torch.compile worth it for qatune's loop on this machine? Compile time vs steady-state step time.

W1's model (GPT-2 6 layers x 512 x 8 heads, vocab 4096) through qatune's training objective, batches of
16 rows with varying lengths (28-36 tokens, as length-grouped batches have), eager and compiled
(dynamic shapes). Prints the first compiled step (the compile cost) and the mean step time of both, and
writes them to bench/results/<this machine>/compile_probe.json with the CPU they ran on.

    python bench/probes/compile_probe.py        # ~3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_machine import describe_torch, headline, json_option, results_path, write_json
from transformers import GPT2Config, GPT2LMHeadModel

from qatune.model.objectives import CausalLMObjective
from qatune.speedups.activations import fuse_activations

STEM = "compile_probe"

ROWS = 16
LENGTHS = (28, 30, 32, 34, 36, 28, 30, 32)


def batch(length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 4096, (ROWS, length))
    labels = ids.clone()
    labels[:, : length - 5] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def step(objective: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    objective(**inputs)["loss_sum"].backward()


def mean_step(objective: torch.nn.Module) -> float:
    start = time.perf_counter()
    for length in LENGTHS:
        step(objective, batch(length))
    return (time.perf_counter() - start) / len(LENGTHS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    json_option(parser, STEM)
    args = parser.parse_args()
    info = describe_torch()
    print(headline(info), flush=True)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=4096, n_positions=256, n_embd=512, n_layer=6, n_head=8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    fuse_activations(model)
    eager = CausalLMObjective(model)
    for _ in range(2):
        step(eager, batch(30))
    eager_s = mean_step(eager)
    compiled = torch.compile(eager, dynamic=True)
    start = time.perf_counter()
    step(compiled, batch(30))
    compile_s = time.perf_counter() - start
    step(compiled, batch(34))
    compiled_s = mean_step(compiled)
    faster = 100 * (1 - compiled_s / eager_s)
    print(f"{torch.get_num_threads()} threads; eager step {eager_s:.3f} s, compiled step {compiled_s:.3f} s "
          f"({faster:.0f}% faster), first compiled step (compile) {compile_s:.0f} s")
    break_even = compile_s / (eager_s - compiled_s) if compiled_s < eager_s else None
    if break_even is not None:
        print(f"break-even after {break_even:.0f} steps (W1 is 63 steps)")
    else:
        print("compiled steps are not faster here: never worth it")
    write_json(args.json or results_path(STEM), {
        "machine": info, "eager_step_s": eager_s, "compiled_step_s": compiled_s, "compile_s": compile_s,
        "compiled_faster_percent": faster, "break_even_steps": break_even,
        "parameters": {"model": "GPT-2 6x512x8, vocab 4096, no dropout", "rows": ROWS, "lengths": list(LENGTHS),
                       "dynamic": True}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
