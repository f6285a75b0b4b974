"""Time per training step and MFU of qatune's loop, on synthetic rows: the regression check every contributor can run
before and after a change (nanoGPT's bench.py, for qatune). Nothing is read from ../shared, nothing downloaded.

A model built from its config with random weights (throughput does not depend on the weights: a GPT-2 or a Llama
of the shape asked), synthetic question/answer rows of lengths spread around --tokens, batched, checked and trained
by qatune's own code (prepare, the loop's set-up, ``train_step``); --burn-in steps first (kernels built, memory
faulted in), then --steps timed. MFU: 6 x parameters x tokens a second over a square matrix product's rate, timed on
the spot in the precision the run trains in.

    python bench/step_speed.py                         # a GPT-2 of 4 x 256, ~30 s on 2 CPU cores
    python bench/step_speed.py --model llama --layers 8 --width 512 --speedups off
    python bench/step_speed.py --json /tmp/step.json   # also write the figures
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_machine import describe_torch, headline, matmul_peak, write_json

WORDS = ("the river city north south bridge castle king queen year war people music art science school church "
         "water light power field house street").split()


def synthetic_rows(count: int, tokens: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) rows of about ``tokens`` words each, their lengths spread from half to one and a half
    times it (batches of many widths, as real sheets give)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        length = rng.randint(max(4, tokens // 2), max(5, tokens * 3 // 2))
        question = " ".join(rng.choice(WORDS) for _ in range(length - 3)) + "?"
        rows.append((question, " ".join(rng.choice(WORDS) for _ in range(3))))
    return rows


def build(args: argparse.Namespace, folder: Path) -> list[str]:
    """The config overrides of the run: its data file, and a model folder (Llama) or a scratch GPT-2."""
    data = folder / "rows.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "answer"])
        writer.writerows(synthetic_rows(args.batch_size * (args.burn_in + args.steps), args.tokens, args.seed))
    sets = [f"data.train_file={data}", "train.epochs=1", f"train.batch_size={args.batch_size}",
            f"train.precision={args.precision}", f"train.speedups={args.speedups}", f"seed={args.seed}",
            "data.max_length=auto", "train.logging_steps=1000000"]
    if args.model == "gpt2":
        return [*sets, f"model.scratch.n_layer={args.layers}", f"model.scratch.n_embd={args.width}",
                f"model.scratch.n_head={max(1, args.width // 64)}", f"model.scratch.vocab_size={args.vocab}",
                f"model.scratch.n_positions={max(64, 2 * args.tokens + 16)}"]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatune.model.scratch_tokenizer import train_scratch_tokenizer

    texts = [f"Question: {q}\nAnswer: {a}" for q, a in synthetic_rows(200, args.tokens, args.seed + 1)]
    tokenizer = train_scratch_tokenizer("generative", texts, args.vocab)
    torch.manual_seed(args.seed)
    heads = max(1, args.width // 64)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.width, intermediate_size=args.width * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 3), max_position_embeddings=max(64, 2 * args.tokens + 16),
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder / "llama")
    tokenizer.save_pretrained(folder / "llama")
    return [*sets, f"model.name_or_path={folder / 'llama'}", "data.prompt_template=Question: {question}\nAnswer:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=48, help="typical row length, in words")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--burn-in", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--speedups", default="auto", help="train.speedups: auto, off, or paths joined by commas")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if "," in args.speedups:
        args.speedups = "[" + args.speedups + "]"

    import torch

    from qatune.config import load_config
    from qatune.train import prepare
    from qatune.train.loop import Loop, train_step
    from qatune.train.sampler import windows

    info = describe_torch()
    print(headline(info), flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qatune-step-speed-") as folder:
        config = load_config(None, build(args, Path(folder)))
        prepared = prepare(config)
        loop = Loop.setup(prepared, None, None)
        params = sum(p.numel() for p in prepared.model.parameters())
        times, tokens = [], []
        for number, (window, _) in enumerate(windows(loop.loader, config.train.gradient_accumulation_steps)):
            if number >= args.burn_in + args.steps:
                break
            begin = time.perf_counter()
            train_step(loop, window)
            if number >= args.burn_in:
                times.append(time.perf_counter() - begin)
                tokens.append(sum(int(b["attention_mask"].sum()) for b in window))
        dtype = torch.bfloat16 if prepared.precision == "bf16" else torch.float32
        peak = matmul_peak(dtype)
    per_step = statistics.median(times)
    rate = sum(tokens) / sum(times)
    mfu = 6 * params * rate / peak
    found = {"benchmark": "qatune step speed on synthetic rows", "machine": info, "model": args.model,
             "layers": args.layers, "width": args.width, "parameters": params, "batch_size": args.batch_size,
             "precision": prepared.precision, "speedups": args.speedups, "steps_timed": len(times),
             "ms_per_step": round(1000 * per_step, 2), "tokens_per_s": round(rate, 1), "mfu": round(mfu, 4),
             "matmul_peak_tflops": round(peak / 1e12, 3), "seconds": round(time.perf_counter() - started, 1)}
    print(f"{args.model} {args.layers}x{args.width} ({params / 1e6:.1f}M parameters), batch {args.batch_size}, "
          f"{prepared.precision}, speedups {args.speedups}: {found['ms_per_step']:.1f} ms a step (median of "
          f"{len(times)}), {rate:,.0f} tokens/s, MFU {100 * mfu:.1f}% of {peak / 1e12:.2f} TFLOP/s; "
          f"{found['seconds']:.0f} s in all", flush=True)
    if args.json:
        write_json(args.json, found)
    else:
        print(json.dumps(found))


if __name__ == "__main__":
    main()
