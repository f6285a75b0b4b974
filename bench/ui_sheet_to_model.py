"""A new user's path through `qatune ui`, timed: from dropping a 500-row sheet on the page to a compared SmolLM2 model
answering on it, through the HTTP API the page itself calls.

The sheet is the first 500 rows of NQ-open (question, answer: a support team's FAQ stands in for it). The steps are
the page's, with what a person clicks: upload the sheet, accept init's guesses with the packaged
smollm2-135m-instruct and its settings, one epoch in the page's epochs field (--epochs), check, train, compare with
the base model on the held-out rows (eval --compare), load the tuned model behind serve's page and ask it one
question. Each step's wall time is recorded, from the request that starts it to the moment the page would show its
result (the page polls once a second; this polls every POLL_S), with the CPU time of qatune ui and its commands, and
the load average during the run: the machine may be shared.

Writes bench/results/<this machine>/ui_sheet_to_model.json.

    nice -n 10 python bench/ui_sheet_to_model.py                # minutes on 2 cores
    python bench/ui_sheet_to_model.py --rows 100 --epochs 1 --json /tmp/ui-quick.json
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

from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json
from workloads import SHARED, need_shared_data

STEM = "ui_sheet_to_model"
POLL_S = 0.25
QUESTION = "who wrote the song love yourself by justin bieber"


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
    """The calls the page makes, against a `qatune ui` started here."""

    def __init__(self, workspace: Path, load: Load):
        self.load = load
        self.process = subprocess.Popen([sys.executable, "-m", "qatune", "ui", "--workspace", str(workspace),
                                         "--port", "0"], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                        env={**os.environ, **CHILD_ENV})
        self.url = ""
        for line in self.process.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/", line)
            if found:
                self.url = found.group(1)
                break
        if not self.url:
            raise SystemExit("qatune ui did not start")
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def call(self, method: str, path: str, body: object = None, raw: bytes | None = None) -> dict:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            raise SystemExit(f"{method} {path}: {exc.code} {exc.read().decode()}") from None

    def until_done(self, job: dict) -> dict:
        while job["state"] == "running":
            time.sleep(POLL_S)
            self.load.sample()
            job = self.call("GET", f"/api/jobs/{job['id']}")
        if job["state"] != "done":
            raise SystemExit(f"{job['command']} ended {job['state']}: {job['error']}\n" + "\n".join(job["log"]))
        return job

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500, help="rows of the sheet dropped on the page")
    parser.add_argument("--epochs", type=int, default=1, help="the page's epochs field")
    json_option(parser, STEM)
    args = parser.parse_args()
    need_shared_data()
    machine = describe()
    print(headline(machine), flush=True)
    load = Load()
    load.sample()
    with tempfile.TemporaryDirectory(prefix="qatune-ui-bench-") as folder:
        sheet = Path(folder) / "faq.csv"
        with open(SHARED / "nq_open" / "nq_open.csv", encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))[: args.rows]
        with open(sheet, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["question", "answer"])
            writer.writeheader()
            writer.writerows(rows)
        page = Page(Path(folder) / "workspace", load)
        try:
            result = walk(page, sheet, args.epochs, load)
        finally:
            page.stop()
    load.sample()
    # qatune ui and every command it ran (each waited for): what a machine of its own would spend, whatever else ran
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    write_json(args.json or results_path(STEM), {
        "benchmark": "qatune ui: a 500-row sheet to a compared SmolLM2 model answering on the page",
        "machine": machine, "sheet": f"the first {args.rows} rows of nq_open/nq_open.csv (question, answer)",
        **result, "cpu_seconds": round(cpu.ru_utime + cpu.ru_stime, 1), "load_average_1min": load.summary()})


def walk(page: Page, sheet: Path, epochs: int | None, load: Load) -> dict:
    seconds: dict[str, float] = {}
    started = time.perf_counter()

    def step(name: str, since: float) -> float:
        now = time.perf_counter()
        seconds[name] = round(now - since, 1)
        print(f"{name:<8} {seconds[name]:7.1f} s", flush=True)
        return now

    mark = started
    described = page.call("POST", "/api/sheets?name=faq.csv", raw=sheet.read_bytes())
    guesses = described["guesses"]
    written = page.call("POST", "/api/configs", {
        "sheet": described["sheet"], "question": guesses["question"]["column"],
        "answers": [guesses["answer"]["column"]], "context": guesses["context"]["column"],
        "held_out": described["held_out"], "model": "smollm2-135m-instruct", "epochs": epochs, "run": described["run"]})
    mark = step("sheet", mark)
    check = page.until_done(page.call("POST", "/api/check", {"config": written["config"]}))
    if not check["result"]["ok"]:
        raise SystemExit(f"check found errors: {check['result']['findings']}")
    mark = step("check", mark)
    train = page.call("POST", "/api/train", {"config": written["config"]})
    name = train["target"].split("/")[-1]
    while True:
        time.sleep(POLL_S)
        load.sample()
        progress = page.call("GET", f"/api/runs/{name}/progress")
        if progress["job"]["state"] != "running":
            break
    if progress["status"] != "complete":
        raise SystemExit(f"training ended {progress['status']}: {progress['job']['error']}")
    mark = step("train", mark)
    compare = page.until_done(page.call("POST", "/api/compare", {"run": train["target"], "other": "base"}))
    compared = compare["result"]["compare"]
    mark = step("compare", mark)
    page.call("POST", "/api/try", {"run": train["target"]})
    answer = page.call("POST", "/try/v1/answer", {"question": QUESTION})
    step("answer", mark)
    total = round(time.perf_counter() - started, 1)
    print(f"{'total':<8} {total:7.1f} s", flush=True)
    metrics = compare["result"]["metrics"]
    return {
        "wall_seconds": total, "step_seconds": seconds,
        "commands": [written["command"], check["command"], train["command"], compare["command"],
                     f"qatune serve {train['target']}"],
        "config": written["yaml"], "steps": progress["step"], "tokens_per_s_last": progress["tokens_per_s"],
        "held_out_rows": compared["counts"]["rows"],
        "compare": {"tuned": {k: metrics[k] for k in ("exact_match", "f1", "loss")},
                    "base": {k: d["other"] for k, d in compared["deltas"].items()},
                    "right_to_wrong": compared["counts"]["right_to_wrong"],
                    "wrong_to_right": compared["counts"]["wrong_to_right"]},
        "question": QUESTION, "answer": answer["answer"],
    }


if __name__ == "__main__":
    main()
