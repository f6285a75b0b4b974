"""Tiny LoRA runs for the tests of model/lora.py and export/merged.py."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_config

LORA_ROWS = [(f"what is item {i}?", f"thing {i}") for i in range(12)]


def lora_config(tmp_path, *overrides, task="generative"):
    rows = LORA_ROWS if task == "generative" else [(q, f"The {a} is on shelf {i}.", f"shelf {i}")
                                                   for i, (q, a) in enumerate(LORA_ROWS)]
    return tiny_config(tmp_path, rows, f"task={task}", "model.scratch.n_layer=2", "model.scratch.n_embd=64",
                       "model.lora.r=16", "model.lora.alpha=32", "model.lora.dropout=0.0", "train.learning_rate=1e-2",
                       "train.epochs=20", "train.batch_size=4",
                       *(["data.context_column=context"] if task == "extractive" else []), *overrides)


def train_lora_run(tmp: Path):
    """LoRA on a local 'pretrained' folder: a small model first trained in full for a few epochs. Returns the run
    directory and its config."""
    from qatune.train import train

    base_run = train(lora_config(tmp, "model.lora=null", "train.epochs=3", "train.learning_rate=3e-3"),
                     output_dir=tmp / "pretrained", progress=False)
    config = lora_config(tmp, "model.scratch=null", f"model.name_or_path={base_run / 'final'}",
                         "model.lora.target_modules=[c_attn, c_fc, c_proj]", "train.epochs=20",
                         "train.learning_rate=3e-3")
    return train(config, output_dir=tmp / "run", progress=False), config
