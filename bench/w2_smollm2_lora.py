"""W2, a real model: SmolLM2-135M-Instruct with LoRA on reading-comprehension rows, qatune's loop against
TRL's SFTTrainer at its best for this job, side by side.

Workload: the first N rows (default 500) of ../shared/data/squadshifts_new_wiki (question + context ->
answer), rendered with the model's chat template (the user turn holds the context and the question, the
assistant turn the answer), loss on the answer and its end-of-turn token only; LoRA r=16, alpha 32, no
dropout, on q/k/v/o and gate/up/down projections; batch 8, lr 3e-4, one epoch, clipping at 1.0, bf16
autocast where native (else fp32), length-grouped batches.

Both arms start from the same plain safetensors folder (the packaged GGUF dequantized once by qatune and
saved without its quantization mark; TRL cannot train the GGUF-loaded model as it is). TRL: SFTTrainer with
a prompt-completion conversational dataset (so completion_only_loss applies), group_by_length sampling,
padding-free off (on CPU it makes one long row), gradient checkpointing off (TRL's default is on; off is
faster with this much memory). The figure is the loop's tokens/s (non-padding tokens of
the epoch over the training time, set-up excluded in both arms), the final training loss each arm logs (mean
over its last logged window: each arm shuffles its own way, so those windows hold different rows), the
trained model's loss over all its training rows afterwards (mean cross-entropy per answer token, the same
code for both arms, each on the sequences it trained on: the like-for-like loss), and MFU against the
measured bf16 peak (6 x trainable-path parameters is not used: LoRA's backward still runs through the
frozen base, so MFU counts 6 x all parameters; against the fp32 peak where bf16 is not native). That count
includes work neither arm does (the frozen weights' gradients) and, for qatune, the LM head on prompt
positions, so near a compute-bound peak it exceeds 100%: read it as a ratio between the arms.

    python bench/w2_smollm2_lora.py                  # 2 rounds of 500 rows: ~35 minutes on 2 cores, bf16
    python bench/w2_smollm2_lora.py --rows 200 --rounds 3
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

from bench_machine import describe, headline, matmul_peak, native_bf16

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))
OUT = Path(__file__).with_suffix(".json")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
USER = "{context}\n\nQuestion: {question}"
def answer_loss(model, examples: list[tuple[list[int], list[int]]], batch: int = 8) -> float:
    """Mean cross-entropy per supervised token of ``model`` over ``examples`` ((input ids, 0/1 per token: is it
    supervised), the same code for both arms), under bf16 autocast where native, as training ran."""
    import torch
    import torch.nn.functional as F

    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16()):
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


def setup(args, workdir: Path) -> dict:
    from qatune.config import ModelConfig
    from qatune.model.loading import load_pretrained, load_tokenizer

    with open(SHARED / "squadshifts_new_wiki" / "squadshifts_new_wiki.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))[: args.rows]
    data = workdir / "rows.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "context", "answer"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    source = ModelConfig(name_or_path="smollm2-135m-instruct")
    tokenizer = load_tokenizer(source, "generative")
    model = load_pretrained(source, "generative", tokenizer)
    folder = workdir / "smollm2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config, "the saved base must be a plain model"
    return {"data": str(data), "model": str(folder), "params": sum(p.numel() for p in model.parameters())}


def qatune_overrides(model: str, data: str, seed: int = 42) -> list[str]:
    """The W2 workload as qatune config overrides (also used by bench/smollm2_attention.py)."""
    return [
        f"model.name_or_path={model}", f"data.train_file={data}", "data.context_column=context",
        "data.prompt_template=chat", f"data.user_template={USER}", "train.epochs=1", "train.batch_size=8",
        "train.learning_rate=3e-4", "train.weight_decay=0.0", "train.max_grad_norm=1.0", "train.logging_steps=5",
        f"train.precision={'bf16' if native_bf16() else 'fp32'}", f"seed={seed}", "model.lora.r=16",
        "model.lora.alpha=32", "model.lora.dropout=0.0", f"model.lora.target_modules={json.dumps(TARGETS)}",
    ]


def qatune_loop(rows: int, *overrides: str, groups: bool = True):
    """(prepared, loop) for W2's first ``rows`` rows, set up as `qatune train` sets it up, for the scripts that
    time one change per batch (bench/lean_lora.py, last_layer_rows.py, shared_prefix_cache.py,
    prefix_groups.py). ``groups=True``: rows about one context kept together (train.group_by_prefix: true) and
    each group's prefix computed once; ``groups=False``: batches and loss as before group prefixes existed
    (plain length-grouped batches, the batch's common prefix only), as the other scripts measured."""
    from qatune.config import load_config
    from qatune.train import prepare
    from qatune.train.loop import Loop

    wanted = [f"train.group_by_prefix={str(groups).lower()}"]
    with tempfile.TemporaryDirectory() as tmp:
        paths = setup(argparse.Namespace(rows=rows), Path(tmp))
        prepared = prepare(load_config(None, [*qatune_overrides(paths["model"], paths["data"]), *wanted,
                                              *overrides]))
        loop = Loop.setup(prepared, None, None)
    if not groups:
        getattr(loop.objective, "module", loop.objective).groups = False
    return prepared, loop


def first_batch_losses(loop, batch, arms) -> dict[str, float]:
    """The summed loss of ``batch`` in each arm (``(name, batch -> batch)`` pairs), with no update."""
    from qatune.model.objectives import model_inputs

    losses = {name: float(loop.objective(**model_inputs(shape(batch)))["loss_sum"].detach()) for name, shape in arms}
    loop.optimizer.zero_grad(set_to_none=True)
    print("first batch, summed loss: " + ", ".join(f"{name} {loss:.6f}" for name, loss in losses.items()),
          flush=True)
    return losses


def arm_qatune(args, paths) -> dict:
    from qatune.config import load_config
    from qatune.train import fit, prepare

    prepared = prepare(load_config(None, qatune_overrides(paths["model"], paths["data"], args.seed)))
    tokens = sum(len(item) for item in prepared.dataset.items)
    supervised = sum(len(item) - item.prompt_length for item in prepared.dataset.items)
    losses: list[float] = []
    from qatune.train import logs

    write = logs.MetricsLog.write
    logs.MetricsLog.write = lambda self, record: (losses.append(record["loss"]) if record.get("event") == "train"
                                                  else None, write(self, record))[1]
    start = time.perf_counter()
    fit(prepared, None, progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    examples = [(item.input_ids, [0] * item.prompt_length + [1] * (len(item) - item.prompt_length))
                for item in prepared.dataset.items]
    return {"seconds": seconds, "tokens": tokens, "supervised_tokens": supervised, "final_loss": losses[-1],
            "peak_rss_mb": peak, "train_set_loss": answer_loss(prepared.model, examples)}


def arm_trl(args, paths) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    with open(paths["data"], encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": USER.format(context=r["context"].strip(),
                                                            question=r["question"].strip())}],
         "completion": [{"role": "assistant", "content": r["answer"].strip()}]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=tmp, per_device_train_batch_size=8, learning_rate=3e-4, num_train_epochs=1, weight_decay=0.0,
            warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=1.0, seed=args.seed, report_to=[],
            save_strategy="no", logging_steps=5, disable_tqdm=True, dataloader_num_workers=0,
            train_sampling_strategy="group_by_length", bf16=native_bf16(), use_cpu=True,
            completion_only_loss=True, padding_free=False, max_length=1024,
            gradient_checkpointing=False,   # TRL turns it on by default; off is faster where memory allows
        )
        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft, callbacks=[Losses()])
        tokens = sum(len(x) for x in trainer.train_dataset["input_ids"])
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        examples = [(ids, supervised_up_to_end_of_turn(ids, labels, tokenizer.eos_token_id))
                    for ids, labels in zip(trainer.train_dataset["input_ids"], trainer.train_dataset["labels"])]
        train_set_loss = answer_loss(trainer.model, examples)
    return {"seconds": seconds, "tokens": tokens, "final_loss": losses[-1] if losses else float("nan"),
            "peak_rss_mb": peak, "train_set_loss": train_set_loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, default=OUT, metavar="PATH",
                        help="where to write the results (default: %(default)s)")
    parser.add_argument("--arm", choices=["qatune", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        paths = json.loads(args.paths)
        result = arm_qatune(args, paths) if args.arm == "qatune" else arm_trl(args, paths)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    info = describe()
    import torch

    # MFU against the peak of the precision both arms train in (bf16 where native, else fp32).
    precision = "bf16" if native_bf16() else "fp32"
    peak = matmul_peak(torch.bfloat16 if precision == "bf16" else torch.float32, repeats=5)
    print(f"{headline(info)}; {precision} matmul peak {peak / 1e9:.0f} GFLOP/s", flush=True)
    runs: dict[str, list[dict]] = {"qatune": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = setup(args, Path(tmp))
        print(f"W2: {args.rows} squadshifts rows, SmolLM2-135M-Instruct ({paths['params'] / 1e6:.1f}M), LoRA r=16 "
              f"on {', '.join(TARGETS)}, batch 8, lr 3e-4, 1 epoch, {'bf16' if native_bf16() else 'fp32'}",
              flush=True)
        for round_ in range(args.rounds):
            order = ("qatune", "trl") if round_ % 2 == 0 else ("trl", "qatune")
            for arm in order:
                command = [sys.executable, __file__, "--arm", arm, "--paths", json.dumps(paths),
                           f"--rows={args.rows}", f"--seed={args.seed}"]
                done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(done.stdout[-3000:], done.stderr[-5000:], file=sys.stderr)
                    return 1
                result = json.loads(line[len("RESULT "):])
                result["tokens_per_s"] = result["tokens"] / result["seconds"]
                result["mfu"] = 6 * paths["params"] * result["tokens_per_s"] / peak
                runs[arm].append(result)
                print(f"round {round_ + 1} {arm:7} {result['seconds']:7.1f} s  {result['tokens_per_s']:6.1f} tokens/s  "
                      f"final loss {result['final_loss']:.3f}  loss over its training rows "
                      f"{result['train_set_loss']:.3f}  MFU {100 * result['mfu']:.1f}%  "
                      f"peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
            ratio = runs["qatune"][-1]["tokens_per_s"] / runs["trl"][-1]["tokens_per_s"]
            print(f"round {round_ + 1} qatune / TRL tokens/s: x{ratio:.2f}", flush=True)
            # After every round: a run stopped later (a round took 47 minutes without native bf16) keeps these.
            ratios = [q["tokens_per_s"] / t["tokens_per_s"] for q, t in zip(runs["qatune"], runs["trl"])]
            args.json.write_text(json.dumps({
                "machine": info, f"{precision}_peak_flops": peak, "precision": precision, "rows": args.rows,
                "rounds": round_ + 1, "runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios),
                "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
            print(f"wrote {args.json} ({round_ + 1} of {args.rounds} rounds)", flush=True)
    print(f"\nqatune / TRL SFTTrainer tokens/s: median x{statistics.median(ratios):.2f} "
          f"({', '.join(f'x{r:.2f}' for r in ratios)}); final loss qatune "
          f"{statistics.mean(r['final_loss'] for r in runs['qatune']):.3f}, TRL "
          f"{statistics.mean(r['final_loss'] for r in runs['trl']):.3f}; over all training rows afterwards qatune "
          f"{statistics.mean(r['train_set_loss'] for r in runs['qatune']):.3f}, TRL "
          f"{statistics.mean(r['train_set_loss'] for r in runs['trl']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
