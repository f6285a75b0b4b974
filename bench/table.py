"""The headline table of docs/performance.md, built from the results files in bench/results/<machine>/.

Every row is one headline results file (or one qatune arm of it) and cites it. The table goes between two
marker lines in docs/performance.md, which nothing else writes; the rest of the page is written by hand.

    python bench/table.py           # rewrite the table in docs/performance.md
    python bench/table.py --print   # print it instead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from bench_machine import RESULTS, ROOT

DOC = ROOT / "docs" / "performance.md"
START = "<!-- headline table: written by bench/table.py from bench/results/; edits here are overwritten -->"
END = "<!-- end of headline table -->"

VARIANTS = {"": "", "_fp32": "both arms forced to fp32", "_bf16": "both arms forced to bf16",
            "_avx2_only": "torch's kernels capped to AVX2", "_fp32_avx2_only": "fp32, kernels capped to AVX2"}
"""What a file name's suffix says about how the benchmark was run on that machine."""


def times(values: list[float], digits: int = 2) -> str:
    """Per-round ratios and their median, the median in bold."""
    if not values:
        return "–"
    rounds = ", ".join(f"×{v:.{digits}f}" for v in values)
    return f"{rounds}; **×{statistics.median(values):.{digits}f}**"


def arms(data: dict, reference: str) -> list[str]:
    """The qatune arms of a file: those its ``speedups`` names (new files), else ``qatune``."""
    if "speedups" in data:
        return list(data["speedups"])
    return [arm for arm in data["runs"] if arm != reference]


def label(arm: str, base: str) -> str:
    return base if arm == "qatune" else f"{base}, {arm.removeprefix('qatune ')}"


def precision_of(data: dict) -> str:
    if data.get("precision"):
        return data["precision"]
    if "args" in data and "bf16" in data["args"]:
        return "bf16" if data["args"]["bf16"] else "fp32"
    return data.get("parameters", {}).get("precision", "")


# --- one extractor per headline: rows of (comparison, precision, qatune, anchor, ratios)


def w1_loop(data: dict) -> Iterator[tuple[str, str, str, str, str]]:
    for arm in arms(data, "trainer"):
        ratios = (data["ratios"][arm] if isinstance(data.get("ratios"), dict) else
                  [t["seconds"] / q["seconds"] for q, t in zip(data["runs"][arm], data["runs"]["trainer"])])
        ours, theirs = data["summary"][arm], data["summary"]["trainer"]
        yield (label(arm, "W1 loop vs Trainer"), precision_of(data),
               f"{ours['supervised_tokens_per_s']:.1f} supervised tok/s", f"{theirs['supervised_tokens_per_s']:.1f}",
               times(ratios))


def w1_process(data: dict) -> Iterator[tuple[str, str, str, str, str]]:
    for arm in arms(data, "trainer"):
        ratios = data["ratios"][arm] if isinstance(data["ratios"], dict) else data["ratios"]
        ours, theirs = data["summary"][arm], data["summary"]["trainer"]
        yield (label(arm, "W1 whole process: `qatune train` vs w1_trainer_best.py"), precision_of(data),
               f"{ours['median_seconds']:.1f} s", f"{theirs['median_seconds']:.1f} s", times(ratios))


def w2(data: dict) -> Iterator[tuple[str, str, str, str, str]]:
    for arm in arms(data, "trl"):
        ratios = data["ratios"][arm] if isinstance(data["ratios"], dict) else data["ratios"]
        ours = statistics.median(r["tokens_per_s"] for r in data["runs"][arm])
        theirs = statistics.median(r["tokens_per_s"] for r in data["runs"]["trl"])
        yield (label(arm, "W2 SmolLM2 LoRA vs TRL SFTTrainer"), precision_of(data), f"{ours:.1f} tokens/s",
               f"{theirs:.1f}", times(ratios))


def extractive(data: dict) -> Iterator[tuple[str, str, str, str, str]]:
    trainer = "trainer (run_qa.py)"
    if "runs" not in data:  # one run per arm
        ours, theirs = data["results"]["qatune"], data["results"][trainer]
        yield ("extractive MiniLM vs Trainer + run_qa.py", precision_of(data),
               f"{ours['examples_per_s']:.2f} examples/s, F1 {ours['f1']:.1f}",
               f"{theirs['examples_per_s']:.2f}, F1 {theirs['f1']:.1f}", times([data["examples_per_s_ratio"]]))
        return
    for arm in arms(data, trainer):
        ours, theirs = data["runs"][arm], data["runs"][trainer]
        yield (label(arm, "extractive MiniLM vs Trainer + run_qa.py"), precision_of(data),
               f"{statistics.median(r['examples_per_s'] for r in ours):.2f} examples/s, F1 "
               f"{statistics.mean(r['f1'] for r in ours):.1f}",
               f"{statistics.median(r['examples_per_s'] for r in theirs):.2f}, F1 "
               f"{statistics.mean(r['f1'] for r in theirs):.1f}", times(data["ratios"][arm]))


def serve(data: dict) -> Iterator[tuple[str, str, str, str, str]]:
    top = max(r["clients"] for r in data["results"])
    rows = [r for r in data["results"] if r["clients"] == top]
    on = statistics.median(r["requests_per_s"] for r in rows if r["batching"] == "on")
    off = statistics.median(r["requests_per_s"] for r in rows if r["batching"] == "off")
    ratios = data.get(f"speedups_at_{top}_clients") or [data[f"speedup_at_{top}_clients"]]
    yield (f"`qatune serve`, {top} clients: batching on vs off", "–", f"{on:.1f} requests/s", f"{off:.1f}",
           times(ratios))


def smollm2_qa(data: dict) -> Iterator[tuple[str, str, str, str, str]]:
    qa = data["qa"]
    base, tuned = qa["base"], qa["fine_tuned"]
    yield ("SmolLM2 reading comprehension: fine-tuned vs base, held-out XQuAD", "auto",
           f"F1 {tuned['f1']:.1f}, EM {tuned['exact_match']:.1f}", f"F1 {base['f1']:.1f}, EM {base['exact_match']:.1f}",
           f"F1 {tuned['f1'] - base['f1']:+.1f}")


HEADLINES: dict[str, Callable[[dict], Iterator[tuple[str, str, str, str, str]]]] = {
    "w1_loop_vs_trainer": w1_loop, "w1_process_vs_trainer": w1_process, "w2_lora_vs_trl": w2,
    "extractive_vs_trainer": extractive, "serve_load": serve, "smollm2_qa": smollm2_qa,
}
"""Each headline results file's stem and how its rows are read."""


def machine_line(folder: Path) -> str:
    """What a results folder's files record about their machine."""
    for path in sorted(folder.glob("*.json")):
        info = json.loads(path.read_text()).get("machine") or {}
        if info.get("cpu"):
            flags = ", ".join(info.get("flags", [])) or "flags not recorded"
            gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
            return f"`{folder.name}`: {info['cpu']}, {info['cores']} cores ({flags}){gpu}"
    return f"`{folder.name}`"


def table(results: Path = RESULTS) -> str:
    lines = ["| machine | comparison | precision | qatune | anchor | qatune / anchor per round; **median** | file |",
             "|---|---|---|---|---|---|---|"]
    machines = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        found = False
        for stem, rows in HEADLINES.items():
            for path in sorted(folder.glob(f"{stem}*.json")):
                suffix = path.stem[len(stem):]
                if suffix not in VARIANTS:
                    continue
                data = json.loads(path.read_text())
                where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
                link = f"[{path.name}](../{where})"
                for comparison, precision, ours, theirs, ratios in rows(data):
                    what = f"{comparison} ({VARIANTS[suffix]})" if VARIANTS[suffix] else comparison
                    lines.append(f"| `{folder.name}` | {what} | {precision} | {ours} | {theirs} | {ratios} | {link} |")
                    found = True
        if found:
            machines.append(f"- {machine_line(folder)}")
    return "\n".join([*lines, "", "Machines:", "", *machines])


def write(doc: Path = DOC, results: Path = RESULTS) -> None:
    """Replace the block between the markers in ``doc`` with the table."""
    text = doc.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no headline table markers; add the lines\n{START}\n{END}\nwhere it goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{table(results)}\n{END}{tail}", encoding="utf-8")
    print(f"wrote the headline table in {doc.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the table instead of writing it")
    args = parser.parse_args()
    if args.print:
        print(table())
    else:
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
