"""What the end of a `qatune` process costs: Python's last garbage-collector sweep, with and without gc.freeze().

At exit Python collects once more over every object still alive; after torch and transformers are
imported and a model was trained that is millions of objects. The `qatune` console script
(`qatune.cli:entry`) calls gc.freeze() after the command returns, which moves them out of that sweep
(files are closed and atexit handlers run as before). This runs the same short command both ways in
fresh processes, alternating, and prints the wall time of each and the difference per round:

    frozen:   python -m qatune train ...        (qatune.cli:entry, as installed)
    default:  python -c "...qatune.cli.main()"  (the same command, no freeze)

The command: `qatune train` on the demo's 150 FAQ rows, a 1-layer scratch GPT-2, one epoch.

    python bench/probes/exit_time.py        # 5 rounds, ~1 minute on 2 cores
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import CHILD_ENV, ROOT, alternating, describe, headline, probe_parser, results_path, write_json

STEM = "exit_time"
COMMAND = ["train", "--config", "configs/tiny-gpt2.yaml", "--set", "train.epochs=1", "--set", "model.scratch.n_layer=1",
           "--overwrite", "--quiet"]
NO_FREEZE = "import sys; from qatune.cli import main; sys.exit(main())"


def wall(command: list[str]) -> float:
    env = {**os.environ, **CHILD_ENV}
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env, cwd=ROOT)
    return time.perf_counter() - start


def main() -> int:
    args = probe_parser(__doc__, STEM, rounds=5).parse_args()
    info = describe()
    print(headline(info), flush=True)
    runs: dict[str, list[float]] = {"frozen": [], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        tail = [*COMMAND, "--output-dir", str(Path(tmp) / "run")]
        commands = {"frozen": [sys.executable, "-m", "qatune", *tail],
                    "default": [sys.executable, "-c", NO_FREEZE, *tail]}
        for round_, name in alternating(args.rounds, ["frozen", "default"]):
            runs[name].append(wall(commands[name]))
            if len(runs["frozen"]) == len(runs["default"]):
                print(f"round {round_ + 1}: frozen {runs['frozen'][-1]:.2f} s, default {runs['default'][-1]:.2f} s, "
                      f"saved {runs['default'][-1] - runs['frozen'][-1]:.2f} s", flush=True)
    saved = [d - f for f, d in zip(runs["frozen"], runs["default"])]
    print(f"\ngc.freeze() at exit saves {statistics.median(saved):.2f} s (median of rounds)")
    write_json(args.json or results_path(STEM), {
        "machine": info, "command": COMMAND, "runs": runs, "saved_seconds": saved,
        "median_saved_seconds": statistics.median(saved)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
