"""What every benchmark records about the machine it ran on, how it writes its JSON, and shared data slices.

Imported by the scripts beside it (``python bench/NAME.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
"""The /proc/cpuinfo flags that decide torch's CPU kernels (recorded with every result)."""


def describe() -> dict:
    """The CPU's model name, core count, its vector flags and whether it does bf16 natively (AVX512-BF16 or AMX)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    info = {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "flags": [f for f in VECTOR_FLAGS if f in flags]}
    caps = {name: os.environ[name] for name in ISA_CAPS if name in os.environ}
    return {**info, "isa_caps": caps} if caps else info


AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""Environment that keeps torch's kernels (ATen, oneDNN, MKL) to AVX2: this CPU as an fp32-only one (an AVX2
machine's fp32 matmul speed, bf16 emulated) for the "CPU without native bf16" measurements."""
ISA_CAPS = (*AVX2_ONLY, "DNNL_MAX_CPU_ISA")


def describe_torch() -> dict:
    """describe() plus torch's version and thread count, and the CUDA GPU's name (None without one)."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {**describe(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "gpu": gpu}


def native_bf16() -> bool:
    """As qatune decides it: the CPU's flags, unless oneDNN is held below them."""
    from qatune.train.device import bf16_native

    return bf16_native("cpu", unknown=False)


def matmul_peak(dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matrix product in ``dtype`` (median of ``repeats`` after warm-up): the peak
    MFU figures divide by. 8192 on a GPU; 256 for emulated bf16 on CPU (it would take minutes)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    slow = dtype == torch.bfloat16 and device == "cpu" and not native_bf16()
    if slow:
        n = 256
    if device == "cuda":
        n = 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(2 if slow else repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def headline(info: dict) -> str:
    flags = " ".join(info.get("flags", [])) or "none of " + " ".join(VECTOR_FLAGS)
    return (f"CPU: {info['cpu']} ({info['cores']} cores; avx512_bf16={info['avx512_bf16']}, "
            f"amx_bf16={info['amx_bf16']}; flags: {flags})" + (f"; GPU: {info['gpu']}" if info.get("gpu") else "")
            + (f"; kernels capped: {info['isa_caps']}" if info.get("isa_caps") else ""))


def json_option(parser: argparse.ArgumentParser, script: str) -> None:
    """``--json PATH``, by default the script's own path with .json (the file the README may quote)."""
    parser.add_argument("--json", type=Path, default=Path(script).with_suffix(".json"), metavar="PATH",
                        help="where to write the results (default: %(default)s)")


def per_batch_options(doc: str, script: str, rows: int = 48, passes: int = 3,
                      more: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[argparse.Namespace, dict]:
    """The options of a script that times one change per batch (``--rows``, ``--passes``, ``--json`` and what
    ``more`` adds), parsed; then the machine, described and printed. Returns (options, machine)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--passes", type=int, default=passes)
    if more is not None:
        more(parser)
    json_option(parser, script)
    args = parser.parse_args()
    info = describe_torch()
    print(headline(info), flush=True)
    return args, info


def write_json(path: Path, results: dict) -> None:
    """``results`` and when they were measured, as indented JSON."""
    path.write_text(json.dumps({**results, "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n",
                    encoding="utf-8")
    print(f"wrote {path}")


def timed_pass(batches: list, arms: list, step, number: int) -> dict[str, float]:
    """One pass over ``batches``: each batch stepped once per arm (``(name, batch -> batch)`` pairs), the arms'
    order alternating from batch to batch and from pass to pass. The summed seconds of each arm's steps."""
    seconds = {name: 0.0 for name, _ in arms}
    for i, batch in enumerate(batches):
        for name, shape in arms if (i + number) % 2 == 0 else reversed(arms):
            step_batch = shape(batch)
            start = time.perf_counter()
            step(step_batch)
            seconds[name] += time.perf_counter() - start
    return seconds


def timed_passes(batches: list, arms: list, step, passes: int) -> tuple[list[dict[str, float]], float, str]:
    """``passes`` timed passes (:func:`timed_pass`) of two arms, the new way first and the old way second, each
    printed with its ratio: the old way's seconds over the new way's (how many times faster the new way is).
    Returns the passes (each arm's seconds and the ratio), their median ratio, and the ratios as text."""
    (new, _), (old, _) = arms
    done = []
    for number in range(passes):
        seconds = timed_pass(batches, arms, step, number)
        ratio = seconds[old] / seconds[new]
        done.append({**seconds, "ratio": ratio})
        print(f"pass {number + 1}: {new} {seconds[new]:.2f} s, {old} {seconds[old]:.2f} s: x{ratio:.3f}", flush=True)
    median = statistics.median(p["ratio"] for p in done)
    return done, median, ", ".join(f"x{p['ratio']:.3f}" for p in done)


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
