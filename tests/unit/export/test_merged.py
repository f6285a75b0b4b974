"""qatune export --merge: a plain transformers folder with the LoRA adapters merged, answering and scoring
as the adapter run does."""

import json

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.kinds import answer_questions
from qatune.model.folder import load_model_folder
from tests.lora_runs import LORA_ROWS

pytest.importorskip("peft")


def test_eval_generate_and_merged_export_agree(lora_run, tmp_path):
    run, _ = lora_run
    questions = [q for q, _ in LORA_ROWS]
    adapter = load_model_folder(run)
    from_adapter = answer_questions(adapter.model, adapter.tokenizer, adapter.info, questions)
    result = CliRunner().invoke(cli, ["export", str(run), "--merge", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output + result.stderr
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in plain.named_parameters())
    merged = load_model_folder(tmp_path / "merged")
    assert answer_questions(merged.model, merged.tokenizer, merged.info, questions) == from_adapter
    metrics = json.loads(CliRunner().invoke(cli, ["eval", str(run), "--data", str(run.parent / "qa.csv"),
                                                  "--json"]).stdout)
    first_train_loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert metrics["num_examples"] == 12 and 0 < metrics["loss"] < first_train_loss
    from qatune.data.spreadsheet import load_from_config
    from qatune.evaluation.evaluate import evaluate_records

    records, _ = load_from_config(merged.config.data, run.parent / "qa.csv")
    merged_metrics, _ = evaluate_records(merged.model, merged.tokenizer, merged.info, records)
    assert metrics["loss"] == pytest.approx(merged_metrics["loss"], rel=1e-4)   # adapter run == merged export
