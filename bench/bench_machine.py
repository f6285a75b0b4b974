"""What every benchmark records about the machine it ran on, where its results go, and how it runs its arms.

Imported by the scripts of bench/ (``python bench/NAME.py`` puts this folder on sys.path; the scripts of
bench/quality/ and bench/probes/ add it: ``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
"""The /proc/cpuinfo flags that decide torch's CPU kernels (recorded with every result)."""

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""Environment that keeps torch's kernels (ATen, oneDNN, MKL) to AVX2: a CPU with native bf16 measured as one
without it (an AVX2 machine's fp32 speed, bf16 emulated)."""
ISA_CAPS = (*AVX2_ONLY, "DNNL_MAX_CPU_ISA")

CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
"""What every benchmark's child processes run with: nothing from a model hub, no tokenizer threads."""


def _cpuinfo() -> tuple[str, set[str]]:
    text = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return model, flags


def describe() -> dict:
    """The CPU's model name, core count, its vector flags and whether it does bf16 natively (AVX512-BF16 or AMX),
    and the kernel caps set in the environment, if any."""
    model, flags = _cpuinfo()
    info = {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "flags": [f for f in VECTOR_FLAGS if f in flags]}
    caps = {name: os.environ[name] for name in ISA_CAPS if name in os.environ}
    return {**info, "isa_caps": caps} if caps else info


def describe_torch() -> dict:
    """describe() plus torch's version and thread count, and the CUDA GPU's name (None without one)."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {**describe(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "gpu": gpu}


def headline(info: dict) -> str:
    """One line: the CPU, its flags, the GPU and any kernel caps (every script prints it first)."""
    flags = " ".join(info.get("flags", [])) or "none of " + " ".join(VECTOR_FLAGS)
    return (f"CPU: {info['cpu']} ({info['cores']} cores; avx512_bf16={info['avx512_bf16']}, "
            f"amx_bf16={info['amx_bf16']}; flags: {flags})" + (f"; GPU: {info['gpu']}" if info.get("gpu") else "")
            + (f"; kernels capped: {info['isa_caps']}" if info.get("isa_caps") else ""))


def gpu_name() -> str | None:
    """The CUDA GPU's name, or None (asked of torch; without torch, of nvidia-smi)."""
    try:
        import torch
    except ImportError:
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.splitlines()[0].strip() if done.stdout.strip() else None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def machine_name() -> str:
    """The folder of bench/results/ this machine's results go to: the GPU where there is one (``h200``), else the
    CPU's family and what decides its matrix products (``xeon-amx``, ``epyc-avx512-bf16``, ``epyc-avx2``).
    QATUNE_BENCH_MACHINE overrides it."""
    if os.environ.get("QATUNE_BENCH_MACHINE"):
        return os.environ["QATUNE_BENCH_MACHINE"]
    gpu = gpu_name()
    if gpu:
        return _slug(re.sub(r"^(NVIDIA|AMD)\s+", "", gpu))
    model, flags = _cpuinfo()
    family = next((name for word, name in (("xeon", "xeon"), ("epyc", "epyc"), ("ryzen", "ryzen"), ("core", "core"),
                                           ("intel", "intel"), ("amd", "amd")) if word in model.lower()),
                  platform.machine().lower() or "cpu")
    isa = next((name for flag, name in (("amx_bf16", "amx"), ("avx512_bf16", "avx512-bf16"), ("avx512f", "avx512"),
                                        ("avx2", "avx2")) if flag in flags), "")
    return f"{family}-{isa}" if isa else family


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "machine"


def results_path(stem: str, suffix: str = "") -> Path:
    """bench/results/<this machine>/<stem><suffix>.json: where a benchmark writes by default (QATUNE_BENCH_RESULTS,
    as bench/headline.py --out sets it, names another folder)."""
    folder = os.environ.get("QATUNE_BENCH_RESULTS")
    return (Path(folder) if folder else RESULTS / machine_name()) / f"{stem}{suffix}.json"


def json_option(parser: argparse.ArgumentParser, stem: str) -> None:
    """``--json PATH``; without it, the script writes :func:`results_path` (``stem``, and the suffix it adds for
    a non-default variant: a forced precision, capped kernels)."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help=f"where to write the results (default: bench/results/<this machine>/{stem}.json)")


def probe_parser(doc: str | None, stem: str, rounds: int) -> argparse.ArgumentParser:
    """The options every probe takes: ``--rounds`` (each variant once per round) and ``--json``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds (each variant once per round)")
    json_option(parser, stem)
    return parser


def comparison_parser(doc: str | None, stem: str, rows: int, rounds: int) -> argparse.ArgumentParser:
    """The options of a side-by-side training comparison (qatune's arms against an anchor's): rows, rounds, seed,
    both arms' precision, one qatune arm per ``train.speedups`` setting, where to write, and the hidden ones a
    child process takes to run one arm."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds (every arm once per round)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="both arms' precision (auto: bf16 where native, else fp32)")
    parser.add_argument("--speedups", nargs="+", default=["auto"], metavar="SETTING",
                        help="train.speedups of each qatune arm: auto, off, all or a comma-separated list of paths")
    json_option(parser, stem)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    return parser


def native_bf16() -> bool:
    """As qatune decides it on CPU: the CPU's flags, unless oneDNN is held below them."""
    from qatune.model.precision import bf16_native

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


def write_json(path: Path, results: dict) -> None:
    """``results`` and when they were measured, as indented JSON (folders made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**results, "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2, default=str)
                    + "\n", encoding="utf-8")
    print(f"wrote {path}", flush=True)


def alternating(rounds: int, arms: Sequence[str]) -> Iterator[tuple[int, str]]:
    """(round, arm) in the order the arms run: every arm once per round, the order reversed every other round,
    so that neither arm always runs first (on a warm or a busy machine)."""
    for number in range(rounds):
        for arm in arms if number % 2 == 0 else reversed(arms):
            yield number, arm


def child_result(command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> dict:
    """Run one arm in a fresh process (clean peak RSS, its own kernel caches) and return the JSON it printed on
    a line starting with ``RESULT``; a failed arm stops the benchmark with the end of its output."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, check=False,
                          env={**os.environ, **CHILD_ENV, **(env or {})})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-5000:])
        raise SystemExit(f"an arm failed (exit {done.returncode}): {' '.join(command)[:300]}")
    return json.loads(line[len("RESULT "):])


def print_result(result: dict) -> None:
    """What a child prints for :func:`child_result`."""
    print("RESULT " + json.dumps(result, default=str), flush=True)
