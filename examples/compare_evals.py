"""Print the results of `qatune eval` side by side: the model before fine-tuning and after, say.

    python examples/compare_evals.py runs/smollm2-demo-base/eval-xquad_demo.json runs/smollm2-demo/eval-xquad_demo.json

Each file is one that `qatune eval` writes (RUN/eval-<data file>.json; with --base, OUTPUT_DIR-base/).
Exact match and F1 are 0-100, higher is better; loss and perplexity are over the answer tokens, lower
is better. Exit code 1 when a file cannot be read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (("exact_match", "EM", "{:.1f}"), ("f1", "F1", "{:.1f}"), ("loss", "loss", "{:.3f}"),
           ("perplexity", "perplexity", "{:.2f}"), ("num_examples", "rows", "{}"))


def read(path: str) -> dict:
    try:
        metrics = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SystemExit(f"error: cannot read {path}: {exc.strerror}; run qatune eval first") from None
    except ValueError:
        raise SystemExit(f"error: {path} is not JSON; pass the eval-<file>.json that qatune eval writes") from None
    if not isinstance(metrics, dict) or "f1" not in metrics:
        raise SystemExit(f"error: {path} holds no qatune eval results (no 'f1')")
    return metrics


def cell(metrics: dict, key: str, form: str) -> str:
    value = metrics.get(key)
    return "n/a" if value is None else form.format(value)


def table(results: list[dict]) -> str:
    names = [str(m.get("model", "?")) for m in results]
    width = max(len("model"), *map(len, names))
    lines = ["model".ljust(width) + "".join(f"{label:>12}" for _, label, _ in COLUMNS)]
    for name, metrics in zip(names, results):
        lines.append(name.ljust(width) + "".join(f"{cell(metrics, key, form):>12}" for key, _, form in COLUMNS))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    results = [read(path) for path in argv]
    files = {m.get("data_path") or m.get("data_file") for m in results}
    if len(files) > 1:
        print(f"note: these results are of different files: {', '.join(sorted(map(str, files)))}", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
