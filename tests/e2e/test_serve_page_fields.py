"""The page of `qatune serve` for a run whose prompt names a column besides the question: a box per column,
the server's 400 shown when it is left empty, an answer once it is filled in (Debian's Chromium via selenium)."""

import pytest

from tests.prompt_runs import score_run
from tests.serve_runs import ServerProcess

pytestmark = pytest.mark.slow
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(score_run(tmp_path_factory.mktemp("page-fields")))
    yield process
    assert process.stop() == 0, "".join(process.log)


def test_the_page_asks_for_the_prompt_columns_and_shows_the_400_without_them(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(server.url + "/")
    wait.until(lambda b: b.find_element(By.ID, "model-id").text == "run")
    assert browser.find_element(By.CSS_SELECTOR, "label[for=field-0]").text == "score"
    assert not browser.find_element(By.ID, "context-box").is_displayed()

    def ask():
        browser.execute_script("document.body.dataset.state = ''")
        browser.find_element(By.ID, "ask").click()
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "answered")
        return browser.find_element(By.ID, "error").text

    browser.find_element(By.ID, "question").send_keys("what is item 1?")
    error = ask()
    assert "needs the column(s) ['score']" in error and '"fields"' in error
    browser.find_element(By.ID, "field-0").send_keys("1")
    assert ask() == ""
    assert "ms" in browser.find_element(By.ID, "latency").text
