"""W2, a real model with LoRA: qatune's loop against TRL's SFTTrainer at its best for this job, side by side.

SmolLM2-135M-Instruct with LoRA on reading-comprehension rows in the model's chat template, loss on the answer
and its end-of-turn token only (bench/workloads.py defines W2). Both arms start from the same plain
safetensors folder (the packaged GGUF dequantized once by qatune and saved without its quantization mark; TRL
cannot train the GGUF-loaded model as it is). TRL: SFTTrainer with a prompt-completion conversational dataset
(so that completion_only_loss applies), group_by_length sampling, padding-free off (on CPU it makes one long
row), gradient checkpointing off (TRL's default is on; off is faster with this much memory). Each arm runs in a
fresh process, the arms alternating round by round.

The figure is the loop's tokens/s (non-padding tokens of the epoch over the training time, set-up excluded in
both arms). Also: the last logged training loss of each arm (a window of 5 steps: each arm shuffles its own
way, so those windows hold different rows); the trained model's loss over all its training rows afterwards
(mean cross-entropy per answer token, the same code for both arms, each on the sequences it trained on: the
like-for-like loss); and MFU, 6 x all parameters per token (LoRA's backward still runs through the frozen
base) against a matmul peak measured here in the precision both arms train in. That count includes work
neither arm does (the frozen weights' gradients) and, for qatune, the LM head on prompt positions, so near a
compute-bound peak it exceeds 100%: read it as a ratio between the arms.

``--speedups off auto all`` trains one qatune arm per setting of train.speedups, each against the same TRL runs.

    python bench/w2_lora_vs_trl.py                  # 2 rounds of 500 rows: ~35 minutes on 2 cores in bf16
    python bench/w2_lora_vs_trl.py --rows 200 --rounds 3
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import (
    alternating,
    child_result,
    comparison_parser,
    describe_torch,
    headline,
    matmul_peak,
    print_result,
    results_path,
    write_json,
)
from workloads import (
    W2,
    SpeedupsLine,
    need_shared_data,
    precision,
    qatune_arm,
    speedups_setting,
    w2_build,
    w2_conversations,
    w2_lora_arguments,
    w2_overrides,
    w2_sft_arguments,
)

STEM = "w2_lora_vs_trl"


def answer_loss(model, examples: list[tuple[list[int], list[int]]], bf16: bool, batch: int = 8) -> float:
    """Mean cross-entropy per supervised token of ``model`` over ``examples`` ((input ids, 0/1 per token: is it
    supervised), the same code for both arms), in the precision training ran in."""
    import torch
    import torch.nn.functional as F

    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(order), batch):
            chunk = [examples[i] for i in order[start:start + batch]]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            supervised = torch.zeros_like(ids, dtype=torch.bool)
            for row, (tokens, marks) in enumerate(chunk):
                ids[row, :len(tokens)] = torch.tensor(tokens)
                mask[row, :len(tokens)] = 1
                supervised[row, :len(marks)] = torch.tensor(marks, dtype=torch.bool)
            ids, mask, supervised = ids.to(device), mask.to(device), supervised.to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            targets, picked = ids[:, 1:], supervised[:, 1:]
            total += F.cross_entropy(logits[picked].float(), targets[picked], reduction="sum").item()
            count += int(picked.sum())
    return total / count


def supervised_up_to_end_of_turn(ids: list[int], labels: list[int], end_of_turn: int) -> list[int]:
    """TRL's supervised positions (labels != -100) up to the end-of-turn token: TRL also trains on the newline
    after it, which qatune does not; the like-for-like loss counts the answer and its end-of-turn in both."""
    marks = [int(label != -100) for label in labels]
    for i, (token, mark) in enumerate(zip(ids, marks)):
        if mark and token == end_of_turn:
            return marks[:i + 1] + [0] * (len(marks) - i - 1)
    return marks


# ------------------------------------------------------------------------------------------ arms


def arm_qatune(args, paths) -> dict:
    from qatune.config import load_config
    from qatune.train import fit, prepare

    config = load_config(None, w2_overrides(paths["model"], paths["data"], args.precision, args.seed,
                                            speedups_setting(args.speedups)))
    speedups = SpeedupsLine()
    prepared = prepare(config)
    tokens = sum(len(item) for item in prepared.dataset.items)
    supervised = sum(len(item) - item.prompt_length for item in prepared.dataset.items)
    trained: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        # A run directory for metrics.jsonl (the logged losses); the clock stops before its last checkpoint.
        start = time.perf_counter()
        fit(prepared, Path(tmp), progress=False, when_trained=lambda: trained.append(time.perf_counter()))
        seconds = trained[0] - start
        logged = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    losses = [record["loss"] for record in logged if record.get("event") == "train"]
    examples = [(item.input_ids, [0] * item.prompt_length + [1] * (len(item) - item.prompt_length))
                for item in prepared.dataset.items]
    return {"seconds": seconds, "tokens": tokens, "supervised_tokens": supervised, "final_loss": losses[-1],
            "peak_rss_mb": peak, "train_set_loss": answer_loss(prepared.model, examples, args.precision == "bf16"),
            "speedups": speedups.line}


def arm_trl(args, paths) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_list(w2_conversations(paths["data"]))
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    bf16 = args.precision == "bf16"
    with tempfile.TemporaryDirectory() as tmp:
        trainer = SFTTrainer(model=model, args=SFTConfig(**w2_sft_arguments(tmp, args.seed, bf16)),
                             train_dataset=dataset, processing_class=tokenizer,
                             peft_config=LoraConfig(**w2_lora_arguments()), callbacks=[Losses()])
        tokens = sum(len(x) for x in trainer.train_dataset["input_ids"])
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        examples = [(ids, supervised_up_to_end_of_turn(ids, labels, tokenizer.eos_token_id))
                    for ids, labels in zip(trainer.train_dataset["input_ids"], trainer.train_dataset["labels"])]
        train_set_loss = answer_loss(trainer.model, examples, bf16)
    return {"seconds": seconds, "tokens": tokens, "final_loss": losses[-1] if losses else float("nan"),
            "peak_rss_mb": peak, "train_set_loss": train_set_loss}


# ------------------------------------------------------------------------------------------- main


def main() -> int:
    args = comparison_parser(__doc__, STEM, W2.rows, 2).parse_args()
    forced = args.precision
    args.precision = precision(args.precision)
    if args.arm:  # a child process: one arm, its result printed as JSON
        paths, args.speedups = json.loads(args.paths), args.speedups[0]
        print_result(arm_trl(args, paths) if args.arm == "trl" else arm_qatune(args, paths))
        return 0

    need_shared_data()
    import torch

    info = describe_torch()
    # MFU against the peak of the precision both arms train in.
    peak = matmul_peak(torch.bfloat16 if args.precision == "bf16" else torch.float32, repeats=5)
    print(f"{headline(info)}; {args.precision} matmul peak {peak / 1e9:.0f} GFLOP/s", flush=True)
    qatune_arms = {qatune_arm(text): text for text in args.speedups}
    for text in args.speedups:
        speedups_setting(text)  # an unknown path name fails here, before anything runs
    arms = [*qatune_arms, "trl"]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    out = args.json or results_path(STEM, f"_{args.precision}" if forced not in ("auto", precision("auto")) else "")
    with tempfile.TemporaryDirectory() as tmp:
        paths = w2_build(args.rows, Path(tmp))
        print(f"{W2.describe(args.rows)} ({paths['params'] / 1e6:.1f}M parameters), {args.precision}", flush=True)
        for round_, arm in alternating(args.rounds, arms):
            command = [sys.executable, __file__, "--arm", arm, "--paths", json.dumps(paths), f"--seed={args.seed}",
                       f"--precision={args.precision}", f"--speedups={qatune_arms.get(arm, 'auto')}"]
            result = child_result(command)
            result["tokens_per_s"] = result["tokens"] / result["seconds"]
            result["mfu"] = 6 * paths["params"] * result["tokens_per_s"] / peak
            runs[arm].append(result)
            print(f"round {round_ + 1} {arm:24} {result['seconds']:7.1f} s  {result['tokens_per_s']:6.1f} tokens/s  "
                  f"last logged loss {result['final_loss']:.3f}  loss over its training rows "
                  f"{result['train_set_loss']:.3f}  MFU {100 * result['mfu']:.1f}%  "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
            if any(len(runs[a]) < len(runs["trl"]) or not runs[a] for a in arms):
                continue
            # After every round: a run stopped later (a round took 47 minutes without native bf16) keeps these.
            ratios = {a: [q["tokens_per_s"] / t["tokens_per_s"] for q, t in zip(runs[a], runs["trl"])]
                      for a in qatune_arms}
            medians = {a: statistics.median(values) for a, values in ratios.items()}
            print(f"round {round_ + 1}: " + ", ".join(f"{a} x{ratios[a][-1]:.2f}" for a in qatune_arms)
                  + " (qatune's tokens/s / TRL's)", flush=True)
            write_json(out, {
                "benchmark": "w2", "workload": W2.describe(args.rows), "machine": info,
                f"{args.precision}_peak_flops": peak, "precision": args.precision, "rows": args.rows,
                "rounds": round_ + 1, "reference": "trl", "speedups": qatune_arms, "runs": runs, "ratios": ratios,
                "median_ratio": medians})
    print()
    for arm in qatune_arms:
        print(f"{arm} / TRL SFTTrainer tokens/s: {', '.join(f'x{r:.2f}' for r in ratios[arm])}, median "
              f"x{medians[arm]:.2f}; loss over all training rows afterwards "
              f"{statistics.mean(r['train_set_loss'] for r in runs[arm]):.3f} against TRL's "
              f"{statistics.mean(r['train_set_loss'] for r in runs['trl']):.3f}\n  {runs[arm][0]['speedups']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
