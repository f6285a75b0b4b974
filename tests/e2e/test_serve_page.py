"""The page of `qatune serve` in a real headless browser (Debian's Chromium driven by selenium): type a
question, read the streamed answer, the latency and the run's summary from the page."""

import os
import shutil

import pytest

from tests.serve_runs import faq_rows

pytestmark = pytest.mark.slow


def test_ask_a_question_and_read_the_answer_from_the_page(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    row = faq_rows(2)[1]
    wait = WebDriverWait(browser, 60)
    browser.get(server.url + "/")
    wait.until(lambda b: b.find_element(By.ID, "model-id").text == "causal")
    summary = browser.find_element(By.ID, "summary").text
    assert "generative (causal)" in summary and "from scratch" in summary and "final train loss" in summary
    wait.until(lambda b: b.execute_script("return document.getElementById('loss-curve').naturalWidth") > 0)
    assert not browser.find_element(By.ID, "context-box").is_displayed()  # the template has no {context}

    browser.find_element(By.ID, "question").send_keys(row["question"])
    browser.find_element(By.ID, "ask").click()
    wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "answered")
    assert browser.find_element(By.ID, "error").text == ""
    assert browser.find_element(By.ID, "answer").text == row["answer"]
    latency = browser.find_element(By.ID, "latency").text
    assert "first token" in latency and "ms" in latency and "tokens" in latency

    screenshot = tmp_path / "serve-page.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
    if os.environ.get("QATUNE_SERVE_SCREENSHOT"):  # where a person wants to look at it
        shutil.copy(screenshot, os.environ["QATUNE_SERVE_SCREENSHOT"])
