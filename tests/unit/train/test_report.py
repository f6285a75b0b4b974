"""report.md, loss.png and TensorBoard logs at the end of training."""

import csv
import json

from qatune.train import train
from tests.conftest import tiny_config

ROWS = [(f"what is item {i}?", f"thing {i}") for i in range(20)]


def run(tmp_path, *overrides):
    config = tiny_config(tmp_path, ROWS, "train.epochs=3", "train.batch_size=4", "data.validation_fraction=0.5",
                         *overrides)
    return train(config, output_dir=tmp_path / "run", progress=False)


def test_report_and_plot(tmp_path):
    run_dir = run(tmp_path)
    report = (run_dir / "report.md").read_text()
    for heading in ("## Data", "## Training", "## Evaluation", "## The 10 worst validation predictions"):
        assert heading in report
    assert "train_file: qa.csv: 20 rows read, 20 kept" in report
    assert ("- validation: 10 rows held out of the training file (data.validation_fraction=0.5; the same question "
            "never on both sides)") in report.splitlines()
    assert json.loads((run_dir / "run.json").read_text())["data"]["validation"] == {"rows": 10, "fraction": 0.5,
                                                                                    "file": None}
    evaluation = report.split("## Evaluation")[1].split("\n## ")[0].strip().splitlines()
    assert evaluation[0] == "| epoch | step | loss | exact match | F1 | examples |"
    assert [line.split("|")[1].strip() for line in evaluation[2:] if line.startswith("|")] == ["1", "2", "3"]
    assert [line.split("|")[6].strip() for line in evaluation[2:] if line.startswith("|")] == ["10"] * 3
    assert "![loss and learning rate](loss.png)" in report
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(run_dir / "predictions-validation.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10
    table = report.split("## The 10 worst validation predictions")[1].strip().splitlines()[2:]
    assert len(table) == 10
    f1s = [float(line.rsplit("|", 2)[1]) for line in table]
    assert f1s == sorted(f1s)


def test_the_plot_is_drawn_on_its_own_thread_while_the_last_checkpoint_is_written(tmp_path, monkeypatch):
    import threading

    import qatune.train.loop
    import qatune.train.outcome
    import qatune.train.report

    order, drawn = [], []
    draw, start = qatune.train.report._draw, qatune.train.outcome.draw_in_background
    save = qatune.train.loop.save_checkpoint

    def recording_draw(train, evals):
        drawn.append((threading.current_thread().name, [x["step"] for x in train]))
        return draw(train, evals)

    def recording_start(run_dir):
        order.append("plot started")
        return start(run_dir)

    def recording_save(run_dir, state, *args):
        order.append(f"checkpoint {state.step}")
        return save(run_dir, state, *args)

    monkeypatch.setattr(qatune.train.report, "_draw", recording_draw)
    monkeypatch.setattr(qatune.train.outcome, "draw_in_background", recording_start)
    monkeypatch.setattr(qatune.train.loop, "save_checkpoint", recording_save)
    run_dir = run(tmp_path, "train.epochs=2", "train.batch_size=20", "data.validation_fraction=0.0")
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert order == ["checkpoint 1", "plot started", "checkpoint 2"]  # 2 epochs of 1 step
    assert len(drawn) == 1 and drawn[0][0].startswith("qatune-plot") and drawn[0][1] == logged
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_memory_is_measured_and_reported(tmp_path):
    """The process's peak resident set size: in every metrics line, in run.json, and in the report."""
    run_dir = run(tmp_path)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peaks = [line["peak_memory_mb"] for line in lines if line["event"] == "train"]
    status = open("/proc/self/status", encoding="ascii").read()  # this test's process trained the run
    now = int(status.split("VmHWM:")[1].split()[0]) / 1024
    assert peaks == sorted(peaks) and 100 < peaks[0] and peaks[-1] <= now + 0.05  # peaks are rounded to 0.1 MiB
    result = json.loads((run_dir / "run.json").read_text())["result"]
    assert peaks[-1] <= result["peak_memory_mb"] <= now + 0.05
    assert (f"- peak memory: {result['peak_memory_mb'] / 1024:.2f} GiB in the largest process (resident set size "
            "on a CPU, CUDA's allocation on a GPU)") in (run_dir / "report.md").read_text().splitlines()
