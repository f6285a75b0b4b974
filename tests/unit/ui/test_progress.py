"""The live view of a training, from the run directory and the end of its progress bar."""

import json

from qatune.ui.progress import RowBars, thin, training_progress

BAR = "train:  40%|####      | 8/20 [00:04<00:06,  2.00step/s, loss=1.2000, lr=1.00e-03, tok_s=900]"


def write_run(run_dir, lines, status="running"):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n{\"event\": \"tr",
                                           encoding="utf-8")  # the last line half written
    (run_dir / "run.json").write_text(json.dumps({"status": status}), encoding="utf-8")
    (run_dir / "config.yaml").write_text("train:\n  epochs: 4\n", encoding="utf-8")


def test_curves_step_epoch_speed_and_time_left(tmp_path):
    write_run(tmp_path / "run", [
        {"event": "train", "step": 1, "epoch": 1, "loss": 3.0, "tokens_per_s": 800.0},
        {"event": "train", "step": 5, "epoch": 1, "loss": 2.0, "tokens_per_s": 850.0},
        {"event": "eval", "epoch": 1, "step": 5, "loss": 2.5, "exact_match": 10.0, "f1": 20.0},
        {"event": "train", "step": 8, "epoch": 2, "loss": float("nan"), "tokens_per_s": 900.0},
    ])
    found = training_progress(tmp_path / "run", ["loading", BAR])
    assert (found["status"], found["step"], found["total_steps"]) == ("running", 8, 20)
    assert (found["epoch"], found["epochs"], found["tokens_per_s"]) == (2, 4, 900.0)
    assert (found["elapsed_s"], found["remaining_s"]) == (4, 6)
    assert found["train"] == [[1, 3.0], [5, 2.0], [8, None]]  # a non-finite loss is no number JSON can carry
    assert found["validation"] == [[5, 2.5, 10.0, 20.0]]
    json.dumps(found, allow_nan=False)


def test_a_run_not_started_yet_and_a_finished_one(tmp_path):
    empty = training_progress(tmp_path / "none")
    assert (empty["status"], empty["step"], empty["train"], empty["total_steps"]) == (None, 0, [], None)
    write_run(tmp_path / "done", [{"event": "train", "step": 20, "epoch": 4, "loss": 0.5}], status="complete")
    (tmp_path / "done" / "run.json").write_text(json.dumps({"status": "complete", "result": {"steps": 20}}))
    done = training_progress(tmp_path / "done", [BAR])
    assert (done["step"], done["remaining_s"], done["result"]) == (20, None, {"steps": 20})


def test_a_long_curve_is_thinned_keeping_its_last_point():
    points = [[step, 1.0] for step in range(1, 2502)]
    thinned = thin(points, 1000)
    assert len(thinned) <= 1001 and thinned[0] == [1, 1.0] and thinned[-1] == [2501, 1.0]


def test_the_bars_of_rows_a_command_draws_read_as_they_come():
    """eval --compare answers with the tuned model, then the other: each bar's rows and time left, which of the two
    draws, a drawing split between two reads, the cursor moves around a second bar."""
    bars = RowBars()
    assert bars.current() is None
    bars.feed("loading the run\n\rgenerate:   0%|          | 0/200 [00:00<?, ?row/s]\x1b[A")
    assert bars.current() == {"desc": "generate", "done": 0, "total": 200, "elapsed_s": 0, "remaining_s": None,
                              "bar": 1, "active": True}
    bars.feed("\rgenerate:  40%|####      | 80/200 [00:10<00:1")  # the rest of this drawing comes next
    assert bars.current()["done"] == 0
    bars.feed("5,  8.00row/s]\rgenerate: 100%|##########| 200/200 [00:25<00:00,  8.00row/s]\n")
    assert (bars.current()["done"], bars.current()["active"]) == (200, False)
    bars.feed("\rgenerate:   0%|          | 0/200 [00:00<?, ?row/s]\rgenerate:  10%|#         | 20/200 "
              "[01:02<1:02:03,  2.00row/s]")
    assert {k: bars.current()[k] for k in ("bar", "done", "elapsed_s", "remaining_s")} == {
        "bar": 2, "done": 20, "elapsed_s": 62, "remaining_s": 3723}


def test_validation_while_a_training_runs(tmp_path):
    """Validation's bar after training's steps: the rows it answered and the time it has left, until training's
    bar is drawn again; its EM and F1 per epoch from metrics.jsonl."""
    bars = RowBars()
    bars.feed("\r" + BAR + "\n\ranswer:  50%|#####     | 6/12 [00:03<00:03,  2.00row/s]\x1b[A")
    validating = bars.current()
    assert (validating["desc"], validating["done"], validating["total"], validating["remaining_s"]) == (
        "answer", 6, 12, 3)
    write_run(tmp_path / "run", [
        {"event": "train", "step": 10, "epoch": 1, "loss": 2.0},
        {"event": "eval", "epoch": 1, "step": 10, "loss": 1.5, "exact_match": 25.0, "f1": 40.5,
         "num_examples": 12},
    ])
    found = training_progress(tmp_path / "run", [BAR], validating)
    assert found["validating"]["done"] == 6
    assert found["evaluations"] == [{"epoch": 1, "step": 10, "loss": 1.5, "exact_match": 25.0, "f1": 40.5,
                                     "rows": 12}]
    assert [(c["name"], c["label"], c["digits"]) for c in found["validation_columns"]] == [
        ("loss", "loss", 3), ("exact_match", "exact match", 1), ("f1", "F1", 1)]
    bars.feed("\r" + BAR)
    assert bars.current() is None  # training goes on: no rows being answered
    (tmp_path / "run" / "run.json").write_text(json.dumps({"status": "complete"}))
    assert training_progress(tmp_path / "run", [BAR], validating)["validating"] is None
