"""Grounded decoding on the shipped configs/smollm2-qa.yaml run: held-out EM/F1 and generation time, off and on.

1. Trains configs/smollm2-qa.yaml as shipped (or takes --run, a finished run of it).
2. Answers the 200 held-out XQuAD rows of examples/data/xquad_eval.csv (other Wikipedia articles than training's)
   with generate.grounded off and on, in one process, batch by batch: the rows in the batches qatune eval makes
   (sorted by prompt length), each batch answered by both arms back to back, which arm first alternating from
   batch to batch, so that both see the same machine (it may be shared with other work). The run's own generate
   settings otherwise (greedy, its max_new_tokens and precision). The grounded arm's time includes building each
   row's allowed answers; the cost is the ratio of the arms' summed times (wall and CPU), with each batch's.
3. Records EM/F1 of each arm (as qatune eval computes them), the share of answers that are spans of their passage,
   the rows grounding changed (right -> wrong, wrong -> right), both arms' F1 on the rows whose free answer is in
   its passage and on the rest (with the most grounding could gain), where each arm's F1 is lost (answers longer or
   shorter than the gold one, or another phrase altogether), and the load average at the start and end of each
   round.

Writes bench/results/<this machine>/grounded_qa.json.

    python bench/quality/grounded_qa.py                               # train, then 2 rounds (~35 min on 2 cores)
    python bench/quality/grounded_qa.py --run runs/smollm2-qa --rounds 3
    python bench/quality/grounded_qa.py --set seed=44 --set data.eval_file=null --rounds 1 --json /tmp/seed44.json
    python bench/quality/grounded_qa.py --config configs/smollm2-demo.yaml --eval-file examples/data/xquad_demo.csv \
        --rounds 1 --json bench/results/<this machine>/grounded_qa_demo.json       # make demo's run and rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import ROOT, describe_torch, headline, json_option, results_path, write_json

STEM = "grounded_qa"
CONFIG = ROOT / "configs" / "smollm2-qa.yaml"
EVAL_FILE = ROOT / "examples" / "data" / "xquad_eval.csv"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def by_free_answer(records: list, answers: dict[str, list[str]], contexts: list[str | None]) -> dict[str, object]:
    """F1 of both arms on the rows whose free answer is a span of its passage and on the rest, and the ceiling.

    Grounding changes only what the free model would have written outside the passage, so its gain is bounded by
    those rows: ``ceiling_gain_f1`` is the gain if every one of them became the gold answer, and
    ``gain_at_in_passage_f1`` the gain if they were answered as well as the free model answers the others.
    """
    from qatune.data.spans import in_passage
    from qatune.inference.metrics import best_scores

    rows = len(records)
    groups: dict[str, list[int]] = {"in_passage": [], "outside": []}
    for i, (answer, context) in enumerate(zip(answers["off"], contexts)):
        groups["in_passage" if in_passage(answer, context or "") else "outside"].append(i)
    f1 = {arm: [best_scores(got, r.answers)[1] for got, r in zip(answers[arm], records)] for arm in ("off", "on")}

    def mean(arm: str, group: str) -> float | None:
        picked = [f1[arm][i] for i in groups[group]]
        return round(100 * sum(picked) / len(picked), 2) if picked else None

    result: dict[str, object] = {
        group: {"rows": len(indices), "f1_off": mean("off", group), "f1_on": mean("on", group)}
        for group, indices in groups.items()}
    outside = groups["outside"]
    inside_f1 = sum(f1["off"][i] for i in groups["in_passage"]) / max(len(groups["in_passage"]), 1)
    result["ceiling_gain_f1"] = round(100 * sum(1 - f1["off"][i] for i in outside) / rows, 2)
    result["gain_at_in_passage_f1"] = round(100 * sum(inside_f1 - f1["off"][i] for i in outside) / rows, 2)
    return result


def differences(shipped: object, trained: object) -> dict[str, list[object]]:
    """The config keys whose values the run's config has other than ``shipped``: {key: [shipped, run's]}."""
    def flat(value: object, prefix: str = "") -> dict[str, object]:
        if isinstance(value, dict):
            return {k: v for key, inner in value.items() for k, v in flat(inner, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    ours, theirs = flat(shipped.model_dump(mode="json")), flat(trained.model_dump(mode="json"))
    return {key: [ours.get(key), theirs.get(key)] for key in sorted(set(ours) | set(theirs))
            if ours.get(key) != theirs.get(key)}


def answer_kinds(got: list[str], records: list) -> dict[str, dict[str, object]]:
    """How each answer relates to its gold answer (the one it scores best against), as SQuAD normalises both:
    exact, longer (holds the gold answer's words), shorter (its words inside the gold answer's), overlapping (some
    words shared) or disjoint (none: another phrase altogether); per kind the rows, the F1 points they lose over all
    rows and the first three."""
    from qatune.inference.metrics import best_scores, normalize_answer

    kinds: dict[str, dict[str, object]] = {}
    lost: dict[str, float] = {}
    for answer, record in zip(got, records):
        gold = max(record.answers or [""], key=lambda g: best_scores(answer, [g])[1])
        ours, theirs = normalize_answer(answer), normalize_answer(gold)
        kind = ("exact" if ours == theirs else "longer" if theirs and f" {theirs} " in f" {ours} "
                else "shorter" if ours and f" {ours} " in f" {theirs} "
                else "overlapping" if set(ours.split()) & set(theirs.split()) else "disjoint")
        entry = kinds.setdefault(kind, {"rows": 0, "f1_lost": 0.0, "examples": []})
        entry["rows"] += 1
        lost[kind] = lost.get(kind, 0.0) + 100 * (1 - best_scores(answer, record.answers)[1]) / len(got)
        if kind != "exact" and len(entry["examples"]) < 3:
            entry["examples"].append({"question": record.question, "gold": gold, "answer": answer})
    for kind, entry in kinds.items():
        entry["f1_lost"] = round(lost[kind], 2)
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None, help="a finished run of --config")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the config to train (default: smollm2-qa.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a change to --config, as qatune train --set takes it (repeatable)")
    parser.add_argument("--eval-file", type=Path, default=EVAL_FILE, help="the held-out rows (default: xquad_eval.csv)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each arm once per round)")
    parser.add_argument("--rows", type=int, default=None, help="only the first ROWS held-out rows")
    json_option(parser, STEM)
    args = parser.parse_args()
    if args.set and args.run is not None:
        parser.error("--set changes the config this script trains; a finished --run is scored as it was trained")

    import logging

    from qatune.config import load_config
    from qatune.data.generative import PromptEncoder
    from qatune.data.spans import in_passage, passage_answers
    from qatune.data.spreadsheet import load_from_config
    from qatune.data.templates import PromptTemplate
    from qatune.inference.generate import generate_answers, prompt_budget
    from qatune.inference.grounding import no_answer_text
    from qatune.inference.metrics import best_scores, corpus_scores
    from qatune.inference.run_model import load_run_model
    from qatune.model.sources import model_max_positions

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result: dict[str, object] = {"cpu": {**describe_torch(), "load_average_at_start": load()}}
    print(headline(result["cpu"]), flush=True)
    run = args.run
    if run is None:
        from qatune.train import train

        work = Path(tempfile.mkdtemp(prefix="grounded-qa-"))
        start = time.perf_counter()
        run = train(load_config(args.config, [*args.set, f"output_dir={work / 'run'}"]), overwrite=True, progress=False)
        result["train_wall_s"] = round(time.perf_counter() - start)
    loaded = load_run_model(run)
    records, _ = load_from_config(loaded.config.data, args.eval_file)
    records = records[: args.rows] if args.rows else records
    questions, contexts = [r.question for r in records], [r.context for r in records]
    generate = loaded.config.generate
    shipped = f"{args.config.resolve().relative_to(ROOT)} as shipped"
    if args.set:
        shipped = f"{args.config.resolve().relative_to(ROOT)} with --set {' --set '.join(args.set)}"
    result["run"] = {"config": shipped if args.run is None else str(run), "seed": loaded.config.seed,
                     "differs_from_config": differences(load_config(args.config), loaded.config),
                     "grounding": loaded.info.grounding, "no_answer": no_answer_text(loaded.info),
                     "generate": {"max_new_tokens": generate.max_new_tokens, "precision": generate.precision,
                                  "grounded (the run's setting)": generate.grounded},
                     "batch_size": loaded.config.train.eval_batch_size}
    result["eval"] = {"file": str(args.eval_file.resolve().relative_to(ROOT)), "rows": len(records)}
    trained, _ = load_from_config(loaded.config.data, ROOT / loaded.config.data.train_file)
    result["training_answers"] = passage_answers(trained).to_json()  # what generate.grounded auto decides from

    template = PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix)
    encoder = PromptEncoder(loaded.tokenizer, template)
    budget = prompt_budget(model_max_positions(loaded.model.config, loaded.tokenizer), generate.max_new_tokens)
    lengths = [len(encoder.prompt_ids(q, c, budget) or []) for q, c in zip(questions, contexts)]
    order = sorted(range(len(records)), key=lambda i: lengths[i])  # as qatune eval batches them
    size = loaded.config.train.eval_batch_size
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    answers: dict[str, list[str]] = {}
    wall: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    rounds = []
    generate_answers(loaded.model, loaded.tokenizer, loaded.info, questions[:2], contexts[:2], generate, size, False)
    for number in range(args.rounds):  # after one untimed call: the first timed one pays no warm-up
        got: dict[str, list[str]] = {"off": [""] * len(records), "on": [""] * len(records)}
        seconds: dict[str, list[float]] = {"off": [], "on": []}
        cpu_seconds: dict[str, list[float]] = {"off": [], "on": []}
        before = load()
        for index, batch in enumerate(batches):
            for arm in ("off", "on") if (index + number) % 2 == 0 else ("on", "off"):
                start, start_cpu = time.perf_counter(), time.process_time()
                out = generate_answers(loaded.model, loaded.tokenizer, loaded.info, [questions[i] for i in batch],
                                       [contexts[i] for i in batch], generate.model_copy(update={"grounded": arm}),
                                       size, False)
                seconds[arm].append(round(time.perf_counter() - start, 2))
                cpu_seconds[arm].append(round(time.process_time() - start_cpu, 2))
                for i, answer in zip(batch, out):
                    got[arm][i] = answer
        for arm in ("off", "on"):
            if arm in answers and answers[arm] != got[arm]:
                raise SystemExit(f"round {number}: the {arm} arm's answers differ from its first round's")
            answers[arm] = got[arm]
            wall[arm].append(round(sum(seconds[arm]), 1))
            cpu[arm].append(round(sum(cpu_seconds[arm]), 1))
        rounds.append({"round": number, "load_before": before, "load_after": load(), "batch_wall_s": seconds,
                       "batch_cpu_s": cpu_seconds,
                       "batch_ratios": [round(b / a, 3) for a, b in zip(seconds["off"], seconds["on"])]})
        print(f"round {number}: off {wall['off'][-1]} s, on {wall['on'][-1]} s (load {before} -> {load()})",
              flush=True)

    golds = [r.answers for r in records]
    no_answer = (no_answer_text(loaded.info) or "").casefold()
    arms = {}
    for arm, got in answers.items():
        found = sum(in_passage(a, c or "") or (bool(a) and a.casefold() == no_answer) for a, c in zip(got, contexts))
        arms[arm] = {**{k: round(v, 2) for k, v in corpus_scores(got, golds).items()},
                     "in_passage": round(100 * found / len(got), 1), "empty": sum(not a for a in got),
                     "answer_kinds": answer_kinds(got, records),
                     "generation_s": wall[arm], "generation_cpu_s": cpu[arm]}
    ratios = [round(on / off, 3) for off, on in zip(wall["off"], wall["on"])]
    changed = [(r, best_scores(off, r.answers)[0], best_scores(on, r.answers)[0], off, on)
               for r, off, on in zip(records, answers["off"], answers["on"]) if off != on]
    result["arms"] = arms
    result["grounding_gain"] = {"exact_match": round(arms["on"]["exact_match"] - arms["off"]["exact_match"], 2),
                                "f1": round(arms["on"]["f1"] - arms["off"]["f1"], 2)}
    result["cost"] = {"time_ratio_on_over_off": ratios, "median": statistics.median(ratios),
                      "cpu_time_ratio_on_over_off": [round(on / off, 3) for off, on in zip(cpu["off"], cpu["on"])],
                      "median_batch_ratio": statistics.median(r for one in rounds for r in one["batch_ratios"]),
                      "required": "at most 1.2"}
    result["changed_rows"] = {
        "count": len(changed), "wrong_to_right": sum(on > off for _, off, on, _, _ in changed),
        "right_to_wrong": sum(off > on for _, off, on, _, _ in changed),
        "examples": [{"question": r.question, "gold": r.answers[0], "off": a, "on": b}
                     for r, _, _, a, b in changed[:12]]}
    result["where_grounding_can_help"] = by_free_answer(records, answers, contexts)
    result["rounds"] = rounds
    print(f"off: {arms['off']}\non:  {arms['on']}\ntime on/off: {ratios}", flush=True)
    write_json(args.json or results_path(STEM), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
