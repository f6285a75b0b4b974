"""Gemma 3 270M against SmolLM2 on reading comprehension: grounded_qa.py's rows, budget and scoring, seed by seed.

Each seed trains configs/smollm2-qa.yaml (1,000 SQuADShifts rows, 1 epoch, batch 8, its learning rate and schedule,
the chat prompt with an empty system message) with model.name_or_path set to --model and data.eval_file null (it
changes no weight), in a process of its own (its peak memory is the run's), then scores it on the 200 held-out
XQuAD rows with bench/quality/grounded_qa.py --run (one round: free and grounded). A seed's result is merged into
the JSON beside the seeds already there, so seeds can run one at a time (each under the CPU's lock); the mean and
worst over the seeds measured are recomputed each time, next to SmolLM2's (bench/results/<machine>/grounded_qa.json:
the same config and seeds as shipped) and the issue's aim (grounded F1 >= 65, mean of 3 seeds, within 15 minutes
of training).

--check first records qatune check's estimated peak and training time for that config (full and LoRA), which a
seed's measured peak is set against. --memory measures both on a small run of each model: check's estimated peak
(one process) against the peak of a run on the first --memory-rows rows (full fine-tuning and LoRA; the same rows
for the estimate and the run). --until HH:MM (UTC) starts no seed that the last one's time says would end later.

    python bench/quality/gemma3_qa.py --check --seed 42           # ~15-20 min on 2 cores; grounded_qa_gemma3.json
    python bench/quality/gemma3_qa.py --seed 43 --seed 44 --until 12:40
    python bench/quality/gemma3_qa.py --memory --memory-rows 96
    python bench/quality/gemma3_qa.py --seed 42 --set train.learning_rate=5e-5 --json .../grounded_qa_gemma3_lr5e5.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import CHILD_ENV, ROOT, describe, headline, results_path, write_json

STEM = "grounded_qa_gemma3"
CONFIG = ROOT / "configs" / "smollm2-qa.yaml"
SMOLLM2 = "grounded_qa"
AIM_F1, AIM_TRAIN_S = 65.0, 900


def qatune(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "qatune", *args], capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"qatune {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def peaks(run: Path) -> dict[str, float | None]:
    """The run's peak memory (run.json) and the largest resident set its steps logged (metrics.jsonl)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    rss = [line["rss_mb"] for line in lines if "rss_mb" in line]
    result = json.loads((run / "run.json").read_text(encoding="utf-8")).get("result", {})
    return {"peak_memory_mb": result.get("peak_memory_mb"), "rss_max_mb": max(rss) if rss else None,
            "steps": result.get("steps")}


def estimates(config: Path, model: str) -> dict:
    """qatune check's estimated peak (one process) and training time for the seeds' config, full and LoRA (r 8).
    The first check of a GGUF model converts it: a seed's training time then counts no conversion."""
    found = {}
    for how, extra in (("full", []), ("lora", ["model.lora.r=8"])):
        started = time.perf_counter()
        check = json.loads(qatune(["check", "--config", str(config), *sets(
            [f"model.name_or_path={model}", "data.eval_file=null", *extra]), "--json"]).stdout)
        estimate = next(s for s in check["memory"]["setups"] if s["setup"] == "1 process")
        found[how] = {"batch": check["memory"]["batch"], "estimate_gib": estimate["total_gib"],
                      "estimate_parts_gib": estimate["parts_gib"],
                      "estimated_train_s": (check.get("training_time") or {}).get("seconds"),
                      "check_s": round(time.perf_counter() - started)}
        print(f"check, {how}: {found[how]}", flush=True)
    return found


def one_seed(config: Path, model: str, seed: int, work: Path, rows: int | None = None,
             changes: tuple[str, ...] = ()) -> dict:
    run = work / f"seed{seed}"
    items = [f"model.name_or_path={model}", "data.eval_file=null", f"seed={seed}", *changes]
    started = time.perf_counter()
    qatune(["train", "--config", str(config), *sets(items), "--output-dir", str(run), "--overwrite", "--quiet"])
    train_s = round(time.perf_counter() - started)
    scored = work / f"seed{seed}.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "grounded_qa.py"), "--run", str(run),
                           "--config", str(config), "--rounds", "1", "--json", str(scored),
                           *(["--rows", str(rows)] if rows else [])], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **CHILD_ENV})
    if done.returncode != 0:
        raise SystemExit(f"grounded_qa.py --run {run} failed:\n{done.stderr[-3000:]}")
    found = json.loads(scored.read_text(encoding="utf-8"))
    arms = {arm: {k: v for k, v in values.items() if k != "answer_kinds"} for arm, values in found["arms"].items()}
    return {"config": f"{config.resolve().relative_to(ROOT)} with --set {' --set '.join(items)}",
            "train_wall_s": train_s,
            **peaks(run), "arms": arms, "answer_kinds_on": found["arms"]["on"]["answer_kinds"],
            "grounding_gain": found["grounding_gain"], "cost": found["cost"],
            "changed_rows": {k: v for k, v in found["changed_rows"].items() if k != "examples"},
            "where_grounding_can_help": found["where_grounding_can_help"], "run": found["run"],
            "load_average": [found["cpu"]["load_average_at_start"], found["rounds"][0]["load_after"]]}


def over(seeds: dict[str, dict]) -> dict:
    def stat(values: list[float]) -> dict:
        return {"mean": round(statistics.mean(values), 2), "worst": round(min(values), 2)}

    runs = list(seeds.values())
    return {"seeds": [int(s) for s in seeds],
            "f1": {arm: stat([r["arms"][arm]["f1"] for r in runs]) for arm in ("off", "on")},
            "exact_match": {arm: stat([r["arms"][arm]["exact_match"] for r in runs]) for arm in ("off", "on")},
            "train_wall_s": {"mean": round(statistics.mean(r["train_wall_s"] for r in runs)),
                             "longest": max(r["train_wall_s"] for r in runs)}}


def smollm2(machine_json: Path) -> dict | None:
    """SmolLM2's runs of the same config and seeds (grounded_qa.json), as this script summarises a model's."""
    if not machine_json.is_file():
        return None
    found = json.loads(machine_json.read_text(encoding="utf-8"))
    seeds = found.get("seeds", {})
    return {"source": str(machine_json.relative_to(ROOT)), "over_seeds": found.get("over_seeds"),
            "train_wall_s": {s: r.get("train_wall_s") for s, r in seeds.items()},
            "f1_on": {s: r["arms"]["on"]["f1"] for s, r in seeds.items()},
            "f1_off": {s: r["arms"]["off"]["f1"] for s, r in seeds.items()}}


def memory(config: Path, models: list[str], rows: int, work: Path) -> dict:
    """qatune check's estimate and a measured run's peak on the first ``rows`` rows, full and LoRA, per model."""
    sheet = work / "memory-rows.csv"
    with open(ROOT / "examples" / "data" / "squadshifts_qa.csv", encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header, picked = next(reader), [row for _, row in zip(range(rows), reader)]
    with open(sheet, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([header, *picked])
    found: dict[str, dict] = {}
    for model in models:
        for how, extra in (("full", []), ("lora", ["model.lora.r=8"])):
            items = [f"model.name_or_path={model}", "data.eval_file=null", f"data.train_file={sheet}",
                     "train.logging_steps=1", *extra]
            check = json.loads(qatune(["check", "--config", str(config), *sets(items), "--json"]).stdout)
            estimate = next(s for s in check["memory"]["setups"] if s["setup"] == "1 process")
            run = work / f"memory-{model}-{how}"
            started = time.perf_counter()
            qatune(["train", "--config", str(config), *sets(items), "--output-dir", str(run), "--overwrite",
                    "--quiet"])
            measured = peaks(run)
            found[f"{model} {how}"] = {
                "rows": rows, "batch": check["memory"]["batch"], "estimate_gib": estimate["total_gib"],
                "estimate_parts_gib": estimate["parts_gib"], **measured,
                "estimate_over_peak": round(estimate["total_gib"] * 1024 / max(measured["peak_memory_mb"] or 1, 1), 3),
                "train_s": round(time.perf_counter() - started),
                "estimated_train_s": (check.get("training_time") or {}).get("seconds")}
            print(f"{model} {how}: estimate {estimate['total_gib']:.2f} GiB, peak {measured['peak_memory_mb']} MB",
                  flush=True)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--config", type=Path, default=CONFIG, help="default: configs/smollm2-qa.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a change to --config for every seed (a recipe variant: write it to its own --json)")
    parser.add_argument("--eval-rows", type=int, default=None, help="only the first held-out rows (a dry run)")
    parser.add_argument("--smollm2-model", default="smollm2-135m-instruct",
                        help="--memory's other model ('' for none)")
    parser.add_argument("--seed", type=int, action="append", default=[], help="a seed to train and score (repeatable)")
    parser.add_argument("--until", default=None, metavar="HH:MM",
                        help="UTC: a seed is not started when the last one's time says it would end later")
    parser.add_argument("--check", action="store_true", help="qatune check's estimates for the seeds' config first")
    parser.add_argument("--memory", action="store_true", help="check's estimate against a measured run's peak")
    parser.add_argument("--memory-rows", type=int, default=96)
    parser.add_argument("--json", type=Path, default=None, help=f"default: bench/results/<machine>/{STEM}.json")
    args = parser.parse_args()
    out = args.json or results_path(STEM)
    result = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    result["cpu"] = describe()
    print(headline(result["cpu"]), flush=True)
    result["model"] = args.model
    work = Path(tempfile.mkdtemp(prefix="gemma3-qa-"))
    if args.check:
        result["check"] = estimates(args.config, args.model)
        write_json(out, result)
    last = None
    for seed in args.seed:
        if args.until and last is not None:
            deadline = time.strftime("%Y-%m-%d ", time.gmtime()) + args.until
            ends = time.strftime("%Y-%m-%d %H:%M", time.gmtime(time.time() + last))
            if ends > deadline:
                result.setdefault("not_run", {})[str(seed)] = (f"a seed takes {last:.0f} s here: it would have ended "
                                                               f"at {ends} UTC, after {args.until}")
                print(f"seed {seed} not run: {result['not_run'][str(seed)]}", flush=True)
                write_json(out, result)
                continue
        started = time.time()
        found = one_seed(args.config, args.model, seed, work, args.eval_rows, tuple(args.set))
        last = time.time() - started
        found["seed_wall_s"] = round(last)
        if "check" in result:
            found["estimate_over_peak"] = round(result["check"]["full"]["estimate_gib"] * 1024
                                                / max(found["peak_memory_mb"] or 1, 1), 3)
        result.setdefault("seeds", {})[str(seed)] = found
        print(f"seed {seed}: trained in {found['train_wall_s']} s, F1 free {found['arms']['off']['f1']}, grounded "
              f"{found['arms']['on']['f1']}, peak {found['peak_memory_mb']} MB", flush=True)
        result["over_seeds"] = over(result["seeds"])
        result["smollm2"] = smollm2(results_path(SMOLLM2))
        mean = result["over_seeds"]["f1"]["on"]["mean"]
        result["aim"] = {"grounded_f1_mean": AIM_F1, "train_s": AIM_TRAIN_S, "seeds_measured": len(result["seeds"]),
                         "grounded_f1_short_by": round(max(AIM_F1 - mean, 0.0), 2),
                         "train_s_over_by": max(result["over_seeds"]["train_wall_s"]["longest"] - AIM_TRAIN_S, 0)}
        write_json(out, result)
    if args.memory:
        models = [args.model, args.smollm2_model] if args.smollm2_model else [args.model]
        result["memory"] = memory(args.config, models, args.memory_rows, work)
        write_json(out, result)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
