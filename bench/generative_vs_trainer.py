"""Generative QA training speed: qatune's loop vs transformers.Trainer at its best, side by side.

Workload W1: the first 1,000 rows of NQ-open (../shared/data/nq_open), a GPT-2 built from config
(6 layers, 512 wide, 8 heads), a byte-level BPE of 4,096 tokens trained on the data, prompt
"Question: ...\\nAnswer:" + " answer" + EOS, batch size 16, one epoch, same learning rate.

Both arms start from the same saved weights and tokenizer and train on the same encoded examples
(answer + EOS supervised, prompt and padding -100). The Trainer arm uses dynamic padding
(DataCollatorForSeq2Seq, which pads input_ids and labels per batch; DataCollatorForLanguageModeling
would train on the prompt and, with pad == eos, never on the EOS), train_sampling_strategy=
"group_by_length", bf16 when the CPU has native bf16 (else fp32, as qatune). Arms run alternately, each
in its own process (clean peak RSS). Prints supervised and non-padding tokens/s, their ratio, the
padding share of computed tokens, peak RSS, the final model's loss over the training set (same code for
both arms, so the data order of the last steps does not matter), and model FLOPs utilisation
(6 x parameters x non-padding tokens/s over a matmul peak measured here, for bf16 and fp32). MFU counts
model FLOPs, the work a full forward/backward of every non-padding token represents; qatune executes
less than that (no LM head, and no last-block projection/MLP, on prompt positions; a shared prompt
prefix once per batch; not the batch's last column, which predicts nothing), so its MFU can exceed the share
of peak its matrix products actually reach.
Final losses are compared per seed (both arms of a round shuffle with the same seed; the batch order
still differs between the arms' samplers, which moves the loss by about +-0.1).

    python bench/generative_vs_trainer.py            # ~8 minutes on 2 CPU cores (5 rounds)
    python bench/generative_vs_trainer.py --rounds 1 --rows 300
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from bench_machine import describe, headline, matmul_peak, native_bf16

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))


# ----------------------------------------------------------------------------------------- setup


def setup(args, workdir: Path) -> dict:
    from qatune.config import ScratchModel
    from qatune.data.templates import PromptTemplate
    from qatune.model.loading import build_scratch, train_scratch_tokenizer

    with open(SHARED / "nq_open" / "nq_open.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))[: args.rows]
    data = workdir / "data.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    template = PromptTemplate()
    texts = [template.render(r["question"]) + template.answer_prefix + r["answer"] for r in rows]
    tokenizer = train_scratch_tokenizer("generative", texts, args.vocab)
    torch.manual_seed(args.seed)
    shape = ScratchModel(n_layer=6, n_embd=512, n_head=8, vocab_size=args.vocab, n_positions=256)
    model = build_scratch(shape, "generative", tokenizer)
    model.save_pretrained(workdir / "init")
    tokenizer.save_pretrained(workdir / "init")
    # nanoGPT's convention: all parameters but the position embeddings (the tied wte is the LM head).
    params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return {"data": str(data), "model": str(workdir / "init"), "params": params, "vocab": len(tokenizer)}


class CountingCollator:
    """Wraps a collator to count computed (B x T), non-padding and supervised tokens."""

    def __init__(self, collate):
        self.collate = collate
        self.computed = self.real = self.supervised = self.batches = self.shared = self.rows = 0

    @property
    def pad_to_multiple_of(self) -> int:
        """The wrapped collator's: qatune's loop sets it (bf16 on CPU, CUDA), and must reach the real one."""
        return self.collate.pad_to_multiple_of

    @pad_to_multiple_of.setter
    def pad_to_multiple_of(self, value: int) -> None:
        self.collate.pad_to_multiple_of = value

    def __call__(self, items):
        batch = self.collate(items)
        self.computed += batch["input_ids"].numel()
        self.real += int(batch["attention_mask"].sum())
        self.supervised += int((batch["labels"][:, 1:] != -100).sum())
        self.batches += 1
        self.rows += len(items)
        self.shared += batch.get("shared_prefix", 0)
        return batch


# ------------------------------------------------------------------------------------------ arms


def arm_qatune(args, paths) -> dict:
    from qatune.config import load_config
    from qatune.train import fit, prepare

    precision = "bf16" if args.bf16 else "fp32"
    config = load_config(None, [
        f"model.name_or_path={paths['model']}", f"data.train_file={paths['data']}", "train.epochs=1",
        f"train.batch_size={args.batch_size}", f"train.learning_rate={args.lr}", "train.weight_decay=0.0",
        "train.warmup_steps=0", "train.max_grad_norm=1.0", f"train.precision={precision}",
        "train.logging_steps=10", f"seed={args.seed}", "train.group_by_length=true",
    ])
    prepared = prepare(config)
    counter = CountingCollator(prepared.collator)
    prepared.collator = counter
    start = time.perf_counter()
    fit(prepared, None, progress=False)
    seconds = time.perf_counter() - start
    result = _result(seconds, counter, _training_set_loss(prepared.model, prepared.tokenizer, prepared.train_records))
    # The attribute says the lean path matched the model (objectives.objective_for takes it in every precision).
    result["lean_path"] = bool(getattr(prepared.model, "_qatune_lean_path", False))
    result["shared_prefix_mean"] = counter.shared / max(counter.batches, 1)
    result["row_tokens_mean"] = counter.real / max(counter.rows, 1)
    return result


def arm_trainer(args, paths) -> dict:
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
        example = encoder.example(record, 256)
        labels = [-100] * example.prompt_length + example.input_ids[example.prompt_length :]
        features.append({"input_ids": example.input_ids, "labels": labels})
    counter = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100,
                                                      return_tensors="pt"))
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.batch_size, learning_rate=args.lr, num_train_epochs=1,
            weight_decay=0.0, warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=1.0, seed=args.seed,
            report_to=[], save_strategy="no", logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
            train_sampling_strategy="group_by_length", bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=features, data_collator=counter,
                          processing_class=tokenizer)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return _result(seconds, counter, _training_set_loss(model, tokenizer, records))


def _training_set_loss(model, tokenizer, records) -> float:
    """Loss of the final model over the whole training set, by the same code for both arms."""
    from qatune.inference.evaluate import causal_lm_eval_loss
    from qatune.model.folder import ModelInfo

    return causal_lm_eval_loss(model, tokenizer, ModelInfo(task="generative", max_length=256), records, 64)


def _result(seconds, counter, final_loss) -> dict:
    return {"seconds": seconds, "computed_tokens": counter.computed, "real_tokens": counter.real,
            "supervised_tokens": counter.supervised, "final_loss": final_loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5, help="Alternating rounds (qatune, Trainer) to run.")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    parser.add_argument("--fp32", action="store_true",
                        help="Both arms in fp32 even where bf16 is native (as on a CPU without it).")
    parser.add_argument("--arm", choices=["qatune", "trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.bf16 = not args.fp32 and ((torch.cuda.is_available() and torch.cuda.is_bf16_supported()) or (
        not torch.cuda.is_available() and native_bf16()))

    if args.arm:  # child process: run one arm, print its JSON
        paths = json.loads(args.paths)
        result = arm_qatune(args, paths) if args.arm == "qatune" else arm_trainer(args, paths)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if not SHARED.exists():
        print(f"needs the shared datasets at {SHARED}", file=sys.stderr)
        return 1
    cpu = describe()
    print(headline(cpu), flush=True)
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    with tempfile.TemporaryDirectory() as tmp:
        paths = setup(args, Path(tmp))
        print(f"W1: {args.rows} NQ-open rows, GPT-2 6x512x8 ({paths['params'] / 1e6:.1f}M parameters), vocab "
              f"{paths['vocab']}, batch {args.batch_size}, lr {args.lr}, 1 epoch, "
              f"{'bf16' if args.bf16 else 'fp32 (no native bf16 here)'}, {torch.get_num_threads()} threads", flush=True)
        print(f"matmul peak: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s",
              flush=True)
        runs: dict[str, list[dict]] = {"qatune": [], "trainer": []}
        for round_ in range(args.rounds):
            for arm in ("qatune", "trainer"):
                # Each round shuffles with another seed (both arms alike): the final loss depends on the
                # batch order by about +-0.1 here, so losses are compared as means over the rounds.
                command = [sys.executable, __file__, "--arm", arm, "--paths", json.dumps(paths),
                           f"--rows={args.rows}", f"--batch-size={args.batch_size}", f"--lr={args.lr}",
                           f"--seed={args.seed + round_}"] + (["--fp32"] if args.fp32 else [])
                done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(line[len("RESULT "):])
                runs[arm].append(result)
                print(f"round {round_ + 1} {arm:8} {result['seconds']:7.1f} s  "
                      f"{result['supervised_tokens'] / result['seconds']:7.1f} supervised tok/s  "
                      f"loss {result['final_loss']:.4f}", flush=True)
            paired = runs["trainer"][-1]["seconds"] / runs["qatune"][-1]["seconds"]
            print(f"round {round_ + 1} qatune / Trainer: x{paired:.2f}", flush=True)
    peak = peaks["bf16"] if args.bf16 else peaks["fp32"]
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
            "final_losses": [r["final_loss"] for r in results],
            "mfu": 6 * paths["params"] * best["real_tokens"] / best["seconds"] / peak,
            "mfu_vs_bf16_peak": 6 * paths["params"] * best["real_tokens"] / best["seconds"] / peaks["bf16"],
        }
    print()
    print(f"{'':8} {'supervised tok/s':>16} {'tokens/s':>9} {'padding':>8} {'peak RSS':>9} {'mean loss':>10} "
          f"{'MFU':>6}")
    for arm, s in summary.items():
        print(f"{arm:8} {s['supervised_tokens_per_s']:16.1f} {s['real_tokens_per_s']:9.1f} "
              f"{100 * s['padding_share']:7.1f}% {s['peak_rss_mb']:7.0f}MB {s['final_loss']:10.4f} "
              f"{100 * s['mfu']:5.1f}%")
    ratio = summary["qatune"]["supervised_tokens_per_s"] / summary["trainer"]["supervised_tokens_per_s"]
    per_round = [t["seconds"] / q["seconds"] for q, t in zip(runs["qatune"], runs["trainer"])]
    gaps = [q["final_loss"] - t["final_loss"] for q, t in zip(runs["qatune"], runs["trainer"])]
    spread = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    print(f"\nqatune / Trainer supervised tokens/s: x{ratio:.2f} (best of {args.rounds} alternating runs each); "
          f"per round {', '.join(f'x{r:.2f}' for r in per_round)} (median x{statistics.median(per_round):.2f})")
    print(f"final training-set loss, qatune minus Trainer, mean over {len(gaps)} seeds: {statistics.mean(gaps):+.4f} "
          f"(standard error {spread:.4f}; per seed {', '.join(f'{g:+.3f}' for g in gaps)})")
    lean = runs["qatune"][0]
    print(f"qatune's GPT-2 lean path: {'on' if lean['lean_path'] else 'off'}; shared prompt prefix "
          f"{lean['shared_prefix_mean']:.1f} tokens per batch on average, rows {lean['row_tokens_mean']:.1f} tokens "
          f"on average; supervised positions {100 * lean['supervised_tokens'] / lean['computed_tokens']:.0f}% of the "
          f"computed ones")
    print(f"MFU = 6 x {paths['params'] / 1e6:.1f}M parameters x non-padding tokens/s / "
          f"{'bf16' if args.bf16 else 'fp32'} matmul peak; against the bf16 peak it would be "
          f"{100 * summary['qatune']['mfu_vs_bf16_peak']:.0f}% (bf16 {'native' if native_bf16() else 'emulated'} here)")
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu, "peaks": peaks, "runs": runs, "summary": summary,
                                         "ratio": ratio, "args": {k: v for k, v in vars(args).items() if k != "paths"}},
                                        indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
