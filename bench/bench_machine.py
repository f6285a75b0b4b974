"""What every benchmark records about the machine it ran on, and shared data slices.

Imported by the scripts beside it (``python bench/NAME.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import csv
import os
import platform
from pathlib import Path


def describe() -> dict:
    """The CPU's model name, core count and whether it does bf16 natively (AVX512-BF16 or AMX)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in text, "amx_bf16": "amx_bf16" in text}


def native_bf16() -> bool:
    info = describe()
    return info["avx512_bf16"] or info["amx_bf16"]


def headline(info: dict) -> str:
    return (f"CPU: {info['cpu']} ({info['cores']} cores; avx512_bf16={info['avx512_bf16']}, "
            f"amx_bf16={info['amx_bf16']})")


def write_nq_rows(shared: Path, rows: int, path: Path) -> Path:
    """The first ``rows`` NQ-open rows as a question/answer CSV (the W1 data)."""
    with open(shared / "nq_open" / "nq_open.csv", encoding="utf-8", newline="") as f:
        picked = list(csv.DictReader(f))[:rows]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(picked)
    return path


W1_CONFIG = """
seed: {seed}
model:
  scratch: {{n_layer: 6, n_embd: 512, n_head: 8, vocab_size: 4096, n_positions: 256}}
data: {{train_file: {data}}}
train: {{epochs: 1, batch_size: 16, learning_rate: 5.0e-4, weight_decay: 0.0, max_grad_norm: 1.0,
        logging_steps: 10, precision: {precision}}}
"""
"""W1 as a qatune config (GPT-2 6x512x8 from scratch, batch 16, one epoch): format with seed, data, precision."""
