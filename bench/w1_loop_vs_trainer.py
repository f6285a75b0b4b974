"""W1's training loop: qatune's `fit` against transformers.Trainer at its best, side by side.

Both arms start from the same saved weights and tokenizer and train on the same encoded examples (answer +
EOS supervised, prompt and padding -100); bench/workloads.py defines W1. The Trainer arm uses dynamic padding
(DataCollatorForSeq2Seq: DataCollatorForLanguageModeling would train on the prompt and, with pad == eos, never
on the EOS), train_sampling_strategy="group_by_length", its default fused AdamW and the precision qatune's
auto picks. Each arm runs in a fresh process (clean peak RSS), the arms alternating round by round; each round
shuffles with its own seed, the same in every arm. Only the loop is timed (set-up excluded in both arms).

Prints, per arm: supervised tokens/s, the padding share of computed tokens, peak RSS, the final model's loss
over the training set (the same code for both arms), MFU (6 x parameters x non-padding tokens/s over a matmul
peak measured here); per round, the Trainer's time over qatune's, and their median. MFU counts the model's
FLOPs: qatune leaves out work (the LM head and most of the last block on prompt positions, the batch's last
column, a shared prompt prefix per row), so its MFU can exceed the share of the peak its products reach.

``--speedups off auto all`` trains one qatune arm per setting of train.speedups (``all``: every path listed;
on a GPU ``auto`` turns them all off), each against the same Trainer runs.

    python bench/w1_loop_vs_trainer.py                   # 5 rounds, ~8 minutes on 2 CPU cores
    python bench/w1_loop_vs_trainer.py --rounds 1 --rows 300
    python bench/w1_loop_vs_trainer.py --precision fp32  # both arms in fp32: w1_loop_vs_trainer_fp32.json
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
    W1,
    SpeedupsLine,
    need_shared_data,
    precision,
    qatune_arm,
    speedups_setting,
    w1_build,
    w1_overrides,
    w1_trainer_arguments,
)

STEM = "w1_loop_vs_trainer"


class CountingCollator:
    """A collator that counts computed (rows x width), non-padding and supervised tokens, and is otherwise the
    collator it wraps: qatune's loop sets the collator's attributes (widths rounded, columns left out) through it."""

    def __init__(self, collate):
        object.__setattr__(self, "collate", collate)
        object.__setattr__(self, "counts", {"computed": 0, "real": 0, "supervised": 0})

    def __getattr__(self, name):  # what this class does not have itself
        return getattr(self.collate, name)

    def __setattr__(self, name, value):
        setattr(self.collate, name, value)

    def __call__(self, items):
        batch = self.collate(items)
        self.counts["computed"] += batch["input_ids"].numel()
        self.counts["real"] += int(batch["attention_mask"].sum())
        self.counts["supervised"] += int((batch["labels"][:, 1:] != -100).sum())
        return batch


# ------------------------------------------------------------------------------------------ arms


def arm_qatune(args, paths) -> dict:
    from qatune.config import load_config
    from qatune.train import fit, prepare

    speedups = SpeedupsLine()
    config = load_config(None, w1_overrides(paths["data"], args.precision, args.seed,
                                            speedups_setting(args.speedups), model=paths["model"]))
    prepared = prepare(config)
    counter = CountingCollator(prepared.collator)
    prepared.collator = counter
    start = time.perf_counter()
    fit(prepared, None, progress=False)
    seconds = time.perf_counter() - start
    result = _result(seconds, counter, _training_set_loss(prepared.model, prepared.tokenizer, prepared.train_records))
    result["speedups"] = speedups.line
    result["row_tokens_mean"] = counter.counts["real"] / max(len(prepared.train_records), 1)
    return result


def arm_trainer(args, paths) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from qatune.data.generative import PromptEncoder
    from qatune.data.spreadsheet import load_records
    from qatune.data.templates import PromptTemplate

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    records, _ = load_records(paths["data"])
    encoder = PromptEncoder(tokenizer, PromptTemplate())
    features = []
    for record in records:
        example = encoder.example(record, W1.positions)
        labels = [-100] * example.prompt_length + example.input_ids[example.prompt_length :]
        features.append({"input_ids": example.input_ids, "labels": labels})
    counter = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100,
                                                      return_tensors="pt"))
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(**w1_trainer_arguments(tmp, args.seed, args.precision == "bf16"))
        trainer = Trainer(model=model, args=training_args, train_dataset=features, data_collator=counter,
                          processing_class=tokenizer)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return _result(seconds, counter, _training_set_loss(model, tokenizer, records))


def _training_set_loss(model, tokenizer, records) -> float:
    """Mean cross-entropy per supervised answer token of the final model over the whole training set (teacher
    forcing), by the same code for both arms."""
    from qatune.kinds.generative import teacher_forced_loss
    from qatune.model.folder import ModelInfo

    total, count = teacher_forced_loss(model, tokenizer, ModelInfo(task="generative", max_length=W1.positions),
                                       records, 64)
    return total / count if count else None


def _result(seconds, counter, final_loss) -> dict:
    counts = counter.counts
    return {"seconds": seconds, "computed_tokens": counts["computed"], "real_tokens": counts["real"],
            "supervised_tokens": counts["supervised"], "final_loss": final_loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ------------------------------------------------------------------------------------------- main


def summarize(runs: dict[str, list[dict]], params: int, peaks: dict[str, float], precision_: str) -> dict:
    summary = {}
    for arm, results in runs.items():
        best = min(results, key=lambda r: r["seconds"])
        summary[arm] = {
            "seconds": best["seconds"],
            "supervised_tokens_per_s": best["supervised_tokens"] / best["seconds"],
            "real_tokens_per_s": best["real_tokens"] / best["seconds"],
            "padding_share": 1 - best["real_tokens"] / best["computed_tokens"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "final_loss": statistics.mean(r["final_loss"] for r in results),
            "mfu": 6 * params * best["real_tokens"] / best["seconds"] / peaks[precision_],
        }
    return summary


def main() -> int:
    args = comparison_parser(__doc__, STEM, W1.rows, 5).parse_args()
    forced = args.precision
    args.precision = precision(args.precision)

    if args.arm:  # a child process: one arm, its result printed as JSON
        paths, args.speedups = json.loads(args.paths), args.speedups[0]
        print_result(arm_trainer(args, paths) if args.arm == "trainer" else arm_qatune(args, paths))
        return 0

    need_shared_data()
    import torch

    info = describe_torch()
    print(headline(info), flush=True)
    qatune_arms = {qatune_arm(text): text for text in args.speedups}
    for text in args.speedups:
        speedups_setting(text)  # an unknown path name fails here, before anything runs
    arms = [*qatune_arms, "trainer"]
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        paths = w1_build(args.rows, Path(tmp), args.seed)
        print(f"{W1.describe(args.rows)}: {paths['params'] / 1e6:.1f}M parameters, {args.precision}, "
              f"{torch.get_num_threads()} threads; matmul peak fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
              f"{peaks['bf16'] / 1e9:.1f} GFLOP/s", flush=True)
        for round_, arm in alternating(args.rounds, arms):
            # Each round shuffles with its own seed (every arm alike): the final loss moves with the batch order
            # by about +-0.1 here, so losses are compared as means over the rounds.
            command = [sys.executable, __file__, "--arm", arm, "--paths", json.dumps(paths),
                       f"--seed={args.seed + round_}", f"--precision={args.precision}",
                       f"--speedups={qatune_arms.get(arm, 'auto')}"]
            result = child_result(command)
            runs[arm].append(result)
            print(f"round {round_ + 1} {arm:24} {result['seconds']:7.1f} s  "
                  f"{result['supervised_tokens'] / result['seconds']:7.1f} supervised tok/s  "
                  f"loss {result['final_loss']:.4f}", flush=True)
            if all(len(runs[a]) == round_ + 1 for a in arms):
                print(f"round {round_ + 1}: " + ", ".join(
                    f"{a} x{runs['trainer'][-1]['seconds'] / runs[a][-1]['seconds']:.2f}" for a in qatune_arms)
                      + " (Trainer's time / qatune's)", flush=True)
    summary = summarize(runs, paths["params"], peaks, args.precision)
    ratios = {arm: [t["seconds"] / q["seconds"] for q, t in zip(runs[arm], runs["trainer"])] for arm in qatune_arms}
    medians = {arm: statistics.median(values) for arm, values in ratios.items()}
    print(f"\n{'':24} {'supervised tok/s':>16} {'padding':>8} {'peak RSS':>9} {'mean loss':>10} {'MFU':>6}")
    for arm, s in summary.items():
        print(f"{arm:24} {s['supervised_tokens_per_s']:16.1f} {100 * s['padding_share']:7.1f}% "
              f"{s['peak_rss_mb']:7.0f}MB {s['final_loss']:10.4f} {100 * s['mfu']:5.1f}%")
    for arm, values in ratios.items():
        gaps = [q["final_loss"] - t["final_loss"] for q, t in zip(runs[arm], runs["trainer"])]
        spread = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
        print(f"\n{arm} / Trainer: {', '.join(f'x{r:.2f}' for r in values)} per round, median x{medians[arm]:.2f}; "
              f"final training-set loss, qatune minus Trainer: {statistics.mean(gaps):+.4f} (standard error "
              f"{spread:.4f})\n  {runs[arm][0]['speedups']}")
    suffix = f"_{args.precision}" if forced != "auto" and forced != precision("auto") else ""
    write_json(args.json or results_path(STEM, suffix), {
        "benchmark": "w1-loop", "workload": W1.describe(args.rows), "machine": info, "precision": args.precision,
        "peaks": peaks, "params": paths["params"], "reference": "trainer", "speedups": qatune_arms, "runs": runs,
        "summary": summary, "ratios": ratios, "median_ratio": medians,
        "args": {"rows": args.rows, "rounds": args.rounds, "seed": args.seed, "batch_size": W1.batch_size}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
