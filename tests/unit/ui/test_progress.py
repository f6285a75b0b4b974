"""The live view of a training, from the run directory and the end of its progress bar."""

import json

from qatune.ui.progress import thin, training_progress

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
