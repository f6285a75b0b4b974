"""How long a command on a GGUF model takes: ``qatune generate`` on the packaged SmolLM2-135M-Instruct file (one
question, 12 new tokens), the whole process timed, with the file read directly (QATUNE_CACHE_DIR=off), converted
into an empty cache (the first command on a file), and read from the converted folder (every later command).

Arms alternate (each once per round, the order reversed every other round); each round's cache is a fresh
temporary folder, converted by its "first" arm (run before "cached" in that round; "cached" gets its own
conversion first when it comes before). The answer of every arm is recorded: it must not change.

Writes bench/results/<this machine>/gguf_cache.json.

    python bench/probes/gguf_cache.py --rounds 2       # ~4 minutes on 2 CPU cores
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import CHILD_ENV, ROOT, alternating, describe, headline, probe_parser, results_path, write_json

STEM = "gguf_cache"
ARMS = ("direct", "first", "cached")
QUESTION = "What is the capital of France?"


def generate(file: Path, cache: str) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "qatune", "generate", str(file), QUESTION, "--max-new-tokens", "12"],
                          capture_output=True, text=True, cwd=ROOT, check=False,
                          env={**os.environ, **CHILD_ENV, "QATUNE_CACHE_DIR": cache})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return seconds, done.stdout.strip()


def main() -> None:
    args = probe_parser(__doc__, STEM, rounds=2).parse_args()
    from qatune.model.sources import PACKAGED_MODELS, resolve_model_path

    file = Path(resolve_model_path("smollm2-135m-instruct")) / str(PACKAGED_MODELS["smollm2-135m-instruct"].gguf_file)
    machine = describe()
    print(headline(machine), flush=True)
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    answers: dict[str, set[str]] = {arm: set() for arm in ARMS}
    caches: dict[int, str] = {}
    for number, arm in alternating(args.rounds, ARMS):
        if number not in caches:
            caches[number] = tempfile.mkdtemp(prefix="qatune-bench-cache-")
        if arm == "cached" and not any(Path(caches[number]).glob("gguf/*/model.safetensors")):
            generate(file, caches[number])  # this round's conversion, untimed
        cache = "off" if arm == "direct" else caches[number]
        if arm == "first":
            cache = tempfile.mkdtemp(prefix="qatune-bench-cache-")
        took, answer = generate(file, cache)
        if arm == "first":
            shutil.rmtree(cache, ignore_errors=True)
        seconds[arm].append(round(took, 2))
        answers[arm].add(answer)
        print(f"round {number + 1} {arm}: {took:.1f} s: {answer!r}", flush=True)
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    medians = {arm: statistics.median(values) for arm, values in seconds.items()}
    results = {
        "what": __doc__.split("\n\n")[0],
        "cpu": machine,
        "file": file.name,
        "file_mb": round(file.stat().st_size / 2**20, 1),
        "rounds": args.rounds,
        "seconds": seconds,
        "median_seconds": medians,
        "cached_over_direct": round(medians["cached"] / medians["direct"], 3),
        "first_over_direct": round(medians["first"] / medians["direct"], 3),
        "answers": {arm: sorted(values) for arm, values in answers.items()},
        "same_answer": len(set().union(*answers.values())) == 1,
    }
    print(f"median: direct {medians['direct']:.1f} s, first (converting) {medians['first']:.1f} s, "
          f"cached {medians['cached']:.1f} s", flush=True)
    write_json(args.json or results_path(STEM), results)


if __name__ == "__main__":
    main()
