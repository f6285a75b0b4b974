"""Batched answer generation vs one question at a time, and CLI start-up time.

Generation: a GPT-2 built from config (6 layers, 512 wide, 8 heads; random weights: the speed of
generation does not depend on what was learned) answers the first 500 NQ-open questions with a fixed
number of new tokens (an untrained model almost never emits EOS, so both arms generate about the same
amount), once with
qatune's batched, length-sorted, left-padded generation (batch 32) and once one question at a time.

Start-up: wall time of ``qatune --help`` in a fresh process (median of 5): torch and transformers
must not be imported for it.

Writes both to bench/results/<this machine>/generate_and_startup.json with the CPU they ran on.

    python bench/probes/generate_and_startup.py       # ~3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_machine import describe_torch, headline, json_option, results_path, write_json
from workloads import SHARED, W1

STEM = "generate_and_startup"


def startup_seconds(repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "qatune", "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    json_option(parser, STEM)
    args = parser.parse_args()
    machine = describe_torch()
    print(headline(machine), flush=True)

    from qatune.config import GenerateConfig, ScratchModel
    from qatune.data.templates import PromptTemplate
    from qatune.inference.generate import answer_questions
    from qatune.model.folder import ModelInfo
    from qatune.model.scratch_tokenizer import train_scratch_tokenizer
    from qatune.model.sources import build_scratch

    startup = startup_seconds()
    print(f"qatune --help: {statistics.median(startup):.3f} s (median of {len(startup)} fresh processes)", flush=True)
    if not SHARED.exists():
        print(f"generation benchmark needs the shared datasets at {SHARED}", file=sys.stderr)
        return 1
    with open(SHARED / "nq_open" / "nq_open.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))[: args.questions]
    template = PromptTemplate()
    tokenizer = train_scratch_tokenizer("generative", [template.render(r["question"]) + " " + r["answer"]
                                                       for r in rows], W1.vocab)
    torch.manual_seed(0)
    shape = ScratchModel(n_layer=W1.layers, n_embd=W1.width, n_head=W1.heads, vocab_size=W1.vocab,
                         n_positions=W1.positions)
    model = build_scratch(shape, "generative", tokenizer).eval()
    info = ModelInfo(task="generative", max_length=256)
    questions = [r["question"] for r in rows]
    generate = GenerateConfig(max_new_tokens=args.new_tokens)

    start = time.perf_counter()
    batched = answer_questions(model, tokenizer, info, questions, generate=generate, batch_size=args.batch_size)
    batched_s = time.perf_counter() - start
    start = time.perf_counter()
    single = [answer_questions(model, tokenizer, info, [q], generate=generate, batch_size=1)[0] for q in questions]
    single_s = time.perf_counter() - start
    same = sum(a == b for a, b in zip(batched, single))
    print(f"{len(questions)} questions, {args.new_tokens} new tokens each, {torch.get_num_threads()} threads")
    print(f"batched (batch {args.batch_size}): {batched_s:7.1f} s  {len(questions) / batched_s:7.1f} questions/s")
    print(f"one at a time:       {single_s:7.1f} s  {len(questions) / single_s:7.1f} questions/s")
    print(f"speed-up x{single_s / batched_s:.1f}; identical answers: {same}/{len(questions)}")
    parameters = {"questions": len(questions), "new_tokens": args.new_tokens, "batch_size": args.batch_size,
                  "model": "GPT-2 6x512x8 from config, vocab 4096, random weights"}
    generation = {"batched_s": batched_s, "batched_questions_per_s": len(questions) / batched_s, "single_s": single_s,
                  "single_questions_per_s": len(questions) / single_s, "speedup": single_s / batched_s,
                  "identical_answers": same}
    write_json(args.json or results_path(STEM), {"machine": machine, "parameters": parameters,
                           "startup": {"runs_s": startup, "median_s": statistics.median(startup)},
                           "generation": generation})
    return 0


if __name__ == "__main__":
    sys.exit(main())
