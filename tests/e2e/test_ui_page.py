"""qatune ui in a real headless browser (Debian's Chromium driven by selenium), the whole path a person takes: a broken
sheet's message (and nothing of it kept), then examples/data/faq.csv uploaded, init's guesses accepted, the config
edited and checked, a tiny model trained (the loss curve moving, the page reloaded mid-training, stopped and resumed,
validation's EM and F1 per epoch), compared with its base, asked a question on serve's page, and taken away: the
answered sheet, final/ as a zip of bf16 weights that qatune generate loads, a GGUF file with how Ollama asks it.

With QATUNE_UI_SCREENSHOTS=DIR (docs/ui for the docs), a screenshot of each step after the Sheet step is written
there (test_ui_newcomer.py takes the Sheet step's, of a sheet of passages)."""

from __future__ import annotations

import csv
import json
import os
import re
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_ok
from tests.serve_runs import QatuneProcess

pytestmark = pytest.mark.slow

FAQ = ROOT / "examples" / "data" / "faq.csv"
WAIT_S = 180


def tiny_pretrained(folder: Path) -> Path:
    """A small GPT-2 and its tokenizer saved as a model folder: what the page fine-tunes as a 'folder in the
    workspace', with a base model to compare against (a model from scratch has none)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from qatune.model.scratch_tokenizer import train_scratch_tokenizer

    with open(FAQ, encoding="utf-8") as f:
        texts = [f"Question: {row['question']}\nAnswer: {row['answer']}" for row in csv.DictReader(f)]
    tokenizer = train_scratch_tokenizer("generative", texts, 600)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def ui(tmp_path):
    pytest.importorskip("fastapi")
    workspace = tmp_path / "workspace"
    tiny_pretrained(workspace / "models" / "tiny-gpt2")
    process = QatuneProcess("ui", "--workspace", str(workspace), "--port", "0")
    yield process, workspace
    assert process.stop(120) == 0, "".join(process.log)


class Page:
    """The browser on qatune ui's page, with the waits and screenshots the test takes."""

    def __init__(self, browser, link: str, downloads: Path):
        from selenium.webdriver.support.ui import WebDriverWait

        self.browser, self.downloads = browser, downloads
        self.wait = WebDriverWait(browser, WAIT_S)
        browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        browser.set_window_size(1280, 900)
        browser.get(link)  # the link qatune ui printed: its token becomes the page's cookie

    def find(self, element_id: str):
        from selenium.webdriver.common.by import By

        return self.browser.find_element(By.ID, element_id)

    def text(self, element_id: str) -> str:
        return self.find(element_id).text

    def data(self, element_id: str, name: str) -> str | None:
        return self.find(element_id).get_attribute(f"data-{name}")

    def until(self, condition, message: str = ""):
        return self.wait.until(lambda _: condition(), message)

    def choose_file(self, element_id: str, path: Path) -> None:
        field = self.find(element_id)
        self.browser.execute_script("arguments[0].classList.remove('hidden')", field)
        field.send_keys(str(path))

    def select(self, element_id: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        Select(self.find(element_id)).select_by_value(value)

    def downloaded(self, name: str) -> Path:
        path = self.downloads / name
        self.until(lambda: path.is_file() and path.stat().st_size > 0, f"{name} was not downloaded")
        return path

    def screenshot(self, name: str) -> None:
        folder = os.environ.get("QATUNE_UI_SCREENSHOTS")
        if not folder:
            return
        self.browser.execute_script("window.scrollTo(0, 0)")
        height = self.browser.execute_script("return document.documentElement.scrollHeight")
        self.browser.set_window_size(1280, min(max(height + 200, 700), 2400))
        Path(folder).mkdir(parents=True, exist_ok=True)
        assert self.browser.save_screenshot(str(Path(folder) / f"{name}.png"))
        self.browser.set_window_size(1280, 900)


def test_from_a_sheet_to_a_tried_compared_exported_model(ui, browser, tmp_path):
    from safetensors import safe_open

    server, workspace = ui
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    # A wrong token is refused; the printed link opens the page and leaves the token out of the address bar.
    browser.get(server.url + "/?token=guess")
    assert "this link's token is not qatune ui's" in browser.page_source
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[\w-]{43}", server.link), server.link
    page = Page(browser, server.link, downloads)
    page.until(lambda: browser.current_url == server.url + "/", "the token stayed in the address bar")

    # A sheet that cannot be read: its message, on the page.
    broken = tmp_path / "broken.csv"
    broken.write_text("question,answer\nwhat?,this,and that\n", encoding="utf-8")
    page.choose_file("file", broken)
    page.until(lambda: page.text("sheet-error"), "no message for the broken sheet")
    assert "line 2 has 3 cells but the header has 2" in page.text("sheet-error")
    assert not page.find("sheet-form").is_displayed()
    assert not (workspace / "sheets" / "broken.csv").exists()  # a sheet that cannot be read is not kept
    assert page.find("sheet-error").value_of_css_property("color") == "rgba(180, 35, 24, 1)"  # an error is red

    # 1. Sheet: faq.csv, init's guesses accepted, the model a folder of the workspace.
    page.choose_file("file", FAQ)
    page.until(lambda: page.find("sheet-form").is_displayed(), "faq.csv's columns were not shown")
    assert "150 rows" in page.text("sheet-summary")
    assert page.find("question").get_attribute("value") == "question"
    assert page.find("answer").get_attribute("value") == "answer"
    assert "its name" in page.text("why-question")
    page.select("model", "__other__")
    page.find("model-other").send_keys("models/tiny-gpt2")
    page.find("epochs").send_keys("20")
    page.find("write-config").click()
    page.until(lambda: page.find("sheet-cli").is_displayed(), "the config was not written")
    assert page.text("sheet-command").startswith("$ qatune init sheets/faq.csv --question question --answer answer")
    assert "--model models/tiny-gpt2" in page.text("sheet-command")
    # The page teaches the config: the learning rate for a model this small, edited in place and saved.
    yaml_box = page.find("config-yaml")
    edited = re.sub(r"learning_rate: [0-9.e-]+", "learning_rate: 0.003", yaml_box.get_attribute("value"))
    yaml_box.clear()
    yaml_box.send_keys(edited)
    page.find("save-config").click()
    page.until(lambda: "saved" in page.text("config-status"))
    assert page.find("config-status").value_of_css_property("color") == "rgba(26, 127, 55, 1)"  # a success is green
    assert "learning_rate: 0.003" in (workspace / "configs" / "faq.yaml").read_text(encoding="utf-8")

    # 2. Check.
    page.find("steps").find_element("css selector", "[data-step=check]").click()
    page.find("run-check").click()
    page.until(lambda: page.data("check-status", "state") == "done", "the check did not end")
    assert page.data("check-status", "ok") == "yes", page.text("check-status")
    assert page.text("check-command") == "$ qatune check --config configs/faq.yaml --json"
    report = page.text("check-report").casefold()
    assert "150 rows read, 150 kept" in report and "15 rows" in report and "memory" in report
    assert "[lr-high]" in report  # each warning with its fix
    assert page.find("check-report").find_elements("css selector", "pre.example mark")  # the trained tokens
    page.screenshot("check")

    # 3. Train: the curve moves; the page reloaded mid-training finds it again; stop, then resume.
    page.find("steps").find_element("css selector", "[data-step=train]").click()
    page.until(lambda: page.find("train-start").is_enabled(), "Start was not enabled once the check passed")
    page.find("train-start").click()
    page.until(lambda: int(page.data("curve", "points") or 0) >= 3, "no loss curve")
    assert page.text("train-command") == "$ qatune train --config configs/faq.yaml"
    first = int(page.data("curve", "points"))
    page.until(lambda: int(page.data("curve", "points")) > first, "the loss curve did not move")
    seen = int(page.data("curve", "points"))
    assert "/ 340" in page.text("stat-step") and "/ 20" in page.text("stat-epoch")
    browser.refresh()
    page.until(lambda: page.data("train-stats", "running") == "yes" and int(page.data("curve", "points") or 0) >= seen,
               "the reloaded page did not find the training")
    assert page.find("step-train").is_displayed()
    page.screenshot("train")
    page.find("train-stop").click()
    page.until(lambda: page.data("train-stats", "status") == "stopped", "the training did not stop")
    stopped_at = int(page.data("train-stats", "step"))
    assert stopped_at < 340 and list((workspace / "runs" / "faq" / "checkpoints").iterdir())
    page.until(lambda: page.find("train-resume").is_displayed())
    page.find("train-resume").click()
    page.until(lambda: page.data("train-stats", "status") == "complete", "the resumed training did not end")
    assert page.text("train-command") == "$ qatune train --resume runs/faq"
    metrics = (workspace / "runs" / "faq" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    losses = [line["loss"] for line in map(json.loads, metrics) if line["event"] == "train"]
    assert losses[-1] < 0.8 * losses[0], losses
    evaluations = [line for line in map(json.loads, metrics) if line["event"] == "eval"]
    assert page.data("validation-table", "rows") == str(len(evaluations)) and len(evaluations) >= 20
    last = page.find("validation-table").find_elements("css selector", "tr")[-1].text.split()
    assert last[:2] == [str(evaluations[-1]["epoch"]), str(evaluations[-1]["step"])]
    assert last[3:5] == [f"{evaluations[-1]['exact_match']:.1f}", f"{evaluations[-1]['f1']:.1f}"]

    # 4. Compare with the base model on the held-out rows.
    page.until(lambda: page.text("train-next") == "Next: compare with the base", "no way on to Compare")
    page.find("train-next").click()
    page.find("run-compare").click()
    page.until(lambda: page.data("compare-status", "state") in ("done", "failed"), "the comparison did not end")
    assert page.data("compare-status", "state") == "done", page.text("compare-status")
    assert page.text("compare-command") == ("$ qatune eval runs/faq --data runs/faq/held-out.csv --compare base "
                                            "--json")
    assert "on 15 rows of runs/faq/held-out.csv" in page.text("compare-status")
    assert "exact_match" in page.text("compare-metrics") and "loss" in page.text("compare-metrics")
    assert len(page.find("compare-rows").find_elements("css selector", "tr")) == 16
    page.screenshot("compare")

    # 5. Try: serve's page in a frame, asked a question.
    page.find("steps").find_element("css selector", "[data-step=try]").click()
    page.until(lambda: page.data("try-status", "state") == "loaded", "the tuned model did not load")
    browser.switch_to.frame(page.find("try-frame"))
    page.until(lambda: page.text("model-id") == "faq", "serve's page did not load the run")
    page.find("question").send_keys("what character did natalie portman play in star wars?")
    page.find("ask").click()
    page.until(lambda: page.find("ask").is_enabled() and page.text("latency"), "no answer")
    assert page.text("error") == ""
    browser.switch_to.default_content()

    # ... and take: the answered sheet, final/ as a zip, a GGUF file checked against the run.
    page.select("answer-sheet", "faq.csv")
    page.find("answer-run").click()
    page.until(lambda: page.data("answer-status", "state") == "done", "the sheet was not answered")
    page.find("answer-status").find_element("css selector", "a").click()
    with open(page.downloaded("answers-faq.csv"), encoding="utf-8") as f:
        answered = list(csv.DictReader(f))
    assert len(answered) == 150 and "answer" in answered[0]
    page.find("download-zip").click()  # bf16 weights by default: a folder qatune loads as it loads final/
    with zipfile.ZipFile(page.downloaded("faq-final.zip")) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "unzipped")
    assert "final/qatune.json" in names and "final/model.safetensors" in names
    with safe_open(tmp_path / "unzipped" / "final" / "model.safetensors", framework="pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    answered = cli_ok("generate", tmp_path / "unzipped" / "final", "what character did natalie portman play in "
                      "star wars?")
    assert answered.stdout.strip()
    page.find("export-run").click()
    page.until(lambda: page.data("export-status", "state") in ("done", "failed"), "the export did not end")
    assert page.data("export-status", "state") == "done", page.text("export-status")
    assert page.text("export-status").startswith("check on 15 rows of the run's validation rows")
    assert {p.name for p in (workspace / "exports").iterdir()} == {"faq-f16.gguf", "faq-f16.Modelfile"}
    usage = page.text("ollama-usage").splitlines()  # beside the download: how Ollama asks it, a held-out question
    assert usage[0] == "ollama create faq-f16 -f faq-f16.Modelfile"
    assert usage[1].startswith("ollama run faq-f16 ") and page.data("ollama", "passage") == "no"
    page.screenshot("try")
