"""`make demo` as a user runs it, timed: its wall time, and the before/after scores it prints.

Runs `make demo` in the repository (the virtualenv already installed, so installation is not timed), then reads
the two evaluations it wrote (the untouched model, the fine-tuned one) and the answer it generated. Writes
bench/results/<this machine>/make_demo.json; README quotes it.

    python bench/probes/make_demo.py          # about 5 minutes on 2 cores with native bf16
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import describe, headline, results_path, write_json

ROOT = Path(__file__).resolve().parents[2]
EVALS = {"base": ROOT / "runs" / "smollm2-demo-base" / "eval-xquad_demo.json",
         "fine_tuned": ROOT / "runs" / "smollm2-demo" / "eval-xquad_demo.json"}


def main() -> int:
    info = describe()
    print(headline(info), flush=True)
    if not (ROOT / ".venv" / ".installed").is_file():
        raise SystemExit("install first (make install): the demo's own time is measured, not the installation's")
    for path in EVALS.values():
        path.unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"make demo failed:\n{(done.stdout + done.stderr)[-3000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    scores = {}
    for arm, path in EVALS.items():
        metrics = json.loads(path.read_text(encoding="utf-8"))
        scores[arm] = {key: metrics[key] for key in ("exact_match", "f1", "loss", "num_examples")}
    answer = done.stdout.strip().splitlines()[-1]
    print(f"make demo: {seconds / 60:.1f} min wall ({usage.ru_utime + usage.ru_stime:.0f} CPU seconds); "
          f"EM {scores['base']['exact_match']:.1f} -> {scores['fine_tuned']['exact_match']:.1f}, "
          f"F1 {scores['base']['f1']:.1f} -> {scores['fine_tuned']['f1']:.1f}; answer: {answer}")
    write_json(results_path("make_demo"), {
        "benchmark": "make demo", "machine": info, "wall_seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime, "scores": scores, "answer": answer})
    return 0


if __name__ == "__main__":
    sys.exit(main())
