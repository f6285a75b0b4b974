"""Per-epoch validation: best/ and early stopping."""

import json

from qatune.train import train
from qatune.train import validation as validation_module
from qatune.train.checkpoint import find_checkpoint
from tests.conftest import resume_config


def test_early_stopping(tmp_path, monkeypatch):
    scores = iter([50.0, 40.0, 45.0, 60.0])
    monkeypatch.setattr(validation_module, "metrics_from", lambda info, records, predictions, loss_sum, count: {
        "exact_match": 0.0, "f1": next(scores), "loss": 1.0, "perplexity": 2.7, "num_examples": len(records)})
    config = resume_config(tmp_path, "train.epochs=4", "data.validation_fraction=0.25",
                           "train.early_stopping_patience=2")
    run = train(config, output_dir=tmp_path / "run", progress=False)
    status = json.loads((run / "run.json").read_text())
    assert status["result"]["best_eval"]["epoch"] == 1           # stopped after epochs 2 and 3 did not improve
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert len(evals) == 3
    assert (run / "best" / "model.safetensors").is_file() and (run / "final" / "model.safetensors").is_file()
    assert json.loads((find_checkpoint(run) / "trainer_state.json").read_text())["best_checkpoint"] == "step-0000003"
