"""Grounded beam search on the rows whose free answer leaves the passage: would it answer them better than grounded
greedy decoding does, and what would answering only those rows by beam search add over the 200 held-out rows?

On a finished configs/smollm2-qa.yaml run (--run) and examples/data/xquad_eval.csv: every row answered freely
(greedy, generate.grounded off) and grounded (greedy, on), as qatune eval answers them; then the rows whose free
answer is not a span of its passage answered grounded with beam search (--beams, through model.generate's
num_beams; qatune's grounding processor holds every beam to the passage). Reports EM/F1 over all rows of free,
grounded and "grounded, beams where the free answer left the passage" (each --beams with each --length-penalty), F1
on the rows outside for each, and the seconds each took (the beams arms on their rows only).

    python bench/probes/grounded_beams.py --run /tmp/qa42 --json /tmp/beams42.json      # ~6 minutes on 2 cores
    python bench/probes/grounded_beams.py --combine /tmp/beams42.json /tmp/beams43.json     # the runs side by side
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import ROOT, describe_torch, headline, json_option, results_path, write_json

STEM = "grounded_beams"


def combine(files: list[Path]) -> dict:
    """Several runs' results (each a file this script wrote) side by side: each arm's F1 and EM by run, their mean
    and worst, and the time of grounded decoding with beams on the rows outside over free decoding of all rows."""
    import json
    import statistics

    runs = {str(f): json.loads(f.read_text(encoding="utf-8")) for f in files}
    arms = [arm for arm in next(iter(runs.values()))["arms"] if all(arm in r["arms"] for r in runs.values())]
    over: dict[str, dict] = {}
    for arm in arms:
        f1 = [r["arms"][arm]["all"]["f1"] for r in runs.values()]
        em = [r["arms"][arm]["all"]["exact_match"] for r in runs.values()]
        outside = [r["arms"][arm]["outside"]["f1"] for r in runs.values()]
        over[arm] = {"f1": f1, "f1_mean": round(statistics.mean(f1), 2), "f1_worst": min(f1),
                     "exact_match": em, "exact_match_mean": round(statistics.mean(em), 2),
                     "f1_on_the_rows_outside": outside}
    cost = {}
    for arm in arms:
        if arm.startswith("grounded, "):
            cost[arm] = [round((r["arms"]["grounded"]["seconds"] + r["arms"][arm]["seconds"])
                               / r["arms"]["free"]["seconds"], 3) for r in runs.values()]
    cost["grounded"] = [round(r["arms"]["grounded"]["seconds"] / r["arms"]["free"]["seconds"], 3)
                        for r in runs.values()]
    first = next(iter(runs.values()))
    return {"what": __doc__.split("\n\n")[0], "cpu": first["cpu"], "rows": first["rows"],
            "runs": {name: r["run"] for name, r in runs.items()},
            "outside_rows": [r["outside_rows"] for r in runs.values()], "over_runs": over,
            "time_over_free_decoding": cost,
            "per_run": {r["run"]: {"arms": r["arms"], "outside": r["outside"]} for r in runs.values()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path)
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON", help="files of earlier runs: one summary")
    parser.add_argument("--eval-file", type=Path, default=ROOT / "examples" / "data" / "xquad_eval.csv")
    parser.add_argument("--beams", type=int, nargs="+", default=[4])
    parser.add_argument("--length-penalty", type=float, nargs="+", default=[1.0, 0.0],
                        help="beam search's: a beam's log-likelihood over its length to this power (0: the sum)")
    json_option(parser, STEM)
    args = parser.parse_args()
    if args.combine:
        write_json(args.json or results_path(STEM), combine(args.combine))
        return
    if args.run is None:
        parser.error("--run or --combine is needed")

    from qatune.data.spans import in_passage
    from qatune.data.spreadsheet import load_from_config
    from qatune.inference.generate import generate_answers
    from qatune.inference.grounding import GroundedLogits
    from qatune.inference.metrics import best_scores
    from qatune.inference.run_model import load_run_model

    machine = describe_torch()
    print(headline(machine), flush=True)
    loaded = load_run_model(args.run)
    records, _ = load_from_config(loaded.config.data, args.eval_file)
    questions, contexts = [r.question for r in records], [r.context for r in records]
    generate, size = loaded.config.generate, loaded.config.train.eval_batch_size

    def answer(rows: list[int], grounded: str) -> tuple[list[str], float]:
        start = time.perf_counter()
        got = generate_answers(loaded.model, loaded.tokenizer, loaded.info, [questions[i] for i in rows],
                               [contexts[i] for i in rows], generate.model_copy(update={"grounded": grounded}), size,
                               False)
        return got, round(time.perf_counter() - start, 1)

    every = list(range(len(records)))
    answers, seconds = {}, {}
    for arm, grounded in (("free", "off"), ("grounded", "on")):
        answers[arm], seconds[arm] = answer(every, grounded)
        print(f"{arm}: {seconds[arm]} s", flush=True)
    outside = [i for i in every if not in_passage(answers["free"][i], contexts[i] or "")]
    plain_generate = loaded.model.generate
    for beams, penalty in [(b, p) for b in args.beams for p in args.length_penalty]:
        def beamed(*a, beams=beams, penalty=penalty, **k):
            k["generation_config"] = copy.deepcopy(k["generation_config"])
            k["generation_config"].num_beams = beams
            k["generation_config"].length_penalty = penalty
            for processor in k["logits_processor"]:
                if isinstance(processor, GroundedLogits):
                    processor.beams = beams  # the beams of a row lie side by side
            return plain_generate(*a, **k)

        loaded.model.generate = beamed
        got, took = answer(outside, "on")
        loaded.model.generate = plain_generate
        arm = f"grounded, {beams} beams (length penalty {penalty}) where the free answer left"
        answers[arm] = list(answers["grounded"])
        for i, text in zip(outside, got):
            answers[arm][i] = text
        seconds[arm] = took
        print(f"{arm}: {took} s on {len(outside)} rows", flush=True)

    def scores(texts: list[str], rows: list[int]) -> dict[str, float]:
        pairs = [best_scores(texts[i], records[i].answers) for i in rows]
        return {"exact_match": round(100 * sum(p[0] for p in pairs) / max(len(rows), 1), 2),
                "f1": round(100 * sum(p[1] for p in pairs) / max(len(rows), 1), 2)}

    results = {
        "what": __doc__.split("\n\n")[0],
        "cpu": machine,
        "run": str(args.run),
        "rows": len(records),
        "outside_rows": len(outside),
        "arms": {arm: {"all": scores(texts, every), "outside": scores(texts, outside), "seconds": seconds[arm]}
                 for arm, texts in answers.items()},
        "outside": [{"question": questions[i], "gold": records[i].answers, **{arm: answers[arm][i] for arm in answers}}
                    for i in outside],
    }
    for arm, figures in results["arms"].items():
        print(f"{arm}: F1 {figures['all']['f1']} (outside {figures['outside']['f1']}), "
              f"EM {figures['all']['exact_match']}")
    write_json(args.json or results_path(STEM), results)


if __name__ == "__main__":
    main()
