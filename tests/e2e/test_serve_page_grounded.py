"""The page of `qatune serve` for a run that reads a passage: its "answer from the passage" choice, set to the run's
own setting, decides whether the answer is a span of the passage (Debian's Chromium via selenium)."""

import pytest

from qatune.data.spans import in_passage
from tests.prompt_runs import context_run
from tests.serve_runs import ServerProcess

pytestmark = pytest.mark.slow
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ELSEWHERE = "the sky is grey and the sea is blue."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(context_run(tmp_path_factory.mktemp("page-grounded")))  # its free answers are anything
    yield process
    assert process.stop() == 0, "".join(process.log)


def test_the_page_answers_from_the_passage_unless_told_not_to(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(server.url + "/")
    wait.until(lambda b: b.find_element(By.ID, "model-id").text == "run")
    choice = Select(browser.find_element(By.ID, "grounded"))
    assert browser.find_element(By.ID, "grounded-box").is_displayed() and choice.first_selected_option.text == "yes"

    def ask():
        browser.execute_script("document.body.dataset.state = ''")
        browser.find_element(By.ID, "ask").click()
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "answered")
        assert browser.find_element(By.ID, "error").text == ""
        return browser.find_element(By.ID, "answer").text

    browser.find_element(By.ID, "question").send_keys("what is item 3?")
    browser.find_element(By.ID, "context").send_keys(ELSEWHERE)
    held = ask()
    choice.select_by_visible_text("no")
    free = ask()
    assert in_passage(held, ELSEWHERE) and not in_passage(free, ELSEWHERE), (held, free)
