"""What each step runs and what it reads back: the held-out rows compared on, the comparison's rows flips first,
the export's check line, final/ as a zip."""

import csv
import json
import shutil
import zipfile
from types import SimpleNamespace

import pytest

from qatune.config import load_config
from qatune.data.spreadsheet import load_from_config, split_validation
from qatune.ui import PageError
from qatune.ui.sheet import Choices, write_page_config
from qatune.ui.steps import compare_args, compare_result, export_result, train_args, zip_final
from qatune.ui.workspace import Workspace
from tests.conftest import ROOT


@pytest.fixture
def workspace(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    (workspace.root / "sheets").mkdir()
    shutil.copy(ROOT / "examples" / "data" / "faq.csv", workspace.root / "sheets" / "faq.csv")
    return workspace


def a_run(workspace, **changes):
    """A run directory as training leaves it, as far as these steps read it: its resolved config."""
    written = write_page_config(workspace, Choices(**{"sheet": "faq.csv", "question": "question",
                                                      "answers": ["answer"], "model": "scratch", "run": "faq",
                                                      **changes}))
    run_dir = workspace.root / written["run"]
    run_dir.mkdir(parents=True)
    config = load_config(workspace.root / written["config"])
    (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    return run_dir, config


def test_train_from_a_config_again_or_resumed():
    assert train_args("configs/faq.yaml", None, False) == ["train", "--config", "configs/faq.yaml"]
    assert train_args("configs/faq.yaml", None, True) == ["train", "--config", "configs/faq.yaml", "--overwrite"]
    assert train_args(None, "runs/faq", False) == ["train", "--resume", "runs/faq"]


def test_compare_on_the_rows_validation_held_out(workspace, monkeypatch):
    run_dir, config = a_run(workspace, held_out=0.2)
    args, _ = compare_args(workspace, "runs/faq", "base", None)
    assert args == ["eval", "runs/faq", "--data", "runs/faq/held-out.csv", "--compare", "base", "--json"]
    monkeypatch.chdir(workspace.root)
    records, _ = load_from_config(config.data, config.data.train_file)
    _, validation = split_validation(records, 0.2, config.seed)
    with open(run_dir / "held-out.csv", encoding="utf-8") as f:
        held_out = list(csv.DictReader(f))
    assert [(r["question"], r["answer"]) for r in held_out] == [(r.question, r.answer) for r in validation]
    assert len(held_out) == 30


def test_compare_on_a_sheet_or_with_another_run_and_nothing_outside(workspace):
    a_run(workspace)
    (workspace.root / "runs" / "older").mkdir()
    args, data = compare_args(workspace, "runs/faq", "runs/older", "faq.csv")
    assert (args[3], args[5], data) == ("sheets/faq.csv", "runs/older", "sheets/faq.csv")
    with pytest.raises(PageError, match="not a path inside the workspace"):
        compare_args(workspace, "runs/faq", "../../elsewhere", None)
    with pytest.raises(PageError, match="no sheet"):
        compare_args(workspace, "runs/faq", "base", "missing.csv")


def test_a_run_without_held_out_rows_asks_for_a_sheet(workspace):
    a_run(workspace, held_out=0.0)
    with pytest.raises(PageError, match="holds no rows out"):
        compare_args(workspace, "runs/faq", "base", None)


def test_the_rows_that_flipped_come_first(workspace, tmp_path):
    (workspace.root / "runs" / "faq").mkdir(parents=True)
    rows = [("1", "same"), ("2", "wrong->right"), ("3", "same"), ("4", "right->wrong")]
    with open(workspace.root / "runs" / "faq" / "compare-x.csv", "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([("row", "change"), *rows])
    output = tmp_path / "out.json"
    output.write_text(json.dumps({"exact_match": 50.0, "compare": {"files": {"csv": "runs/faq/compare-x.csv"}}}))
    job = SimpleNamespace(state="done", output_text=output.read_text)
    found = compare_result(workspace, job)
    assert [row["row"] for row in found["rows"]] == ["4", "2", "1", "3"]
    assert found["metrics"] == {"exact_match": 50.0} and found["rows_total"] == 4


def test_the_export_check_line_and_its_files():
    log = ["writing", "check on 15 rows of the run's validation rows of sheets/faq.csv: f16: next-token agreement "
           "100.0% at 402 positions, 4/4 answers identical", "Ollama: ollama create NAME -f exports/faq.Modelfile"]
    job = SimpleNamespace(state="done", log_lines=lambda _count: log, extra={"gguf": "exports/faq-f16.gguf"})
    found = export_result(job)
    assert found["check"]["rows"] == 15 and found["check"]["line"].startswith("f16: next-token agreement 100.0%")
    assert (found["gguf"], found["modelfile"]) == ("exports/faq-f16.gguf", "exports/faq-f16.Modelfile")


def test_final_as_a_zip(tmp_path):
    final = tmp_path / "run" / "final"
    (final / "sub").mkdir(parents=True)
    (final / "qatune.json").write_text("{}")
    (final / "sub" / "weights.bin").write_bytes(b"\x00" * 10)
    archive = zip_final(tmp_path / "run", tmp_path / "run-final.zip")
    with zipfile.ZipFile(archive) as opened:
        assert sorted(opened.namelist()) == ["final/qatune.json", "final/sub/weights.bin"]
    with pytest.raises(PageError, match="has no final/ model yet"):
        zip_final(tmp_path / "nothing", tmp_path / "x.zip")
