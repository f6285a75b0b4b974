"""The page of `qatune serve` for a run whose prompt names a column besides the question: a box per column,
the server's 400 shown when it is left empty, an answer once it is filled in (Debian's Chromium via selenium)."""

import pytest
from tests.e2e.test_serve_page import CHROMEDRIVER, CHROMIUM
from tests.prompt_runs import score_run
from tests.serve_runs import ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                       reason="Debian's chromium and chromium-driver are not installed"),
]
webdriver = pytest.importorskip("selenium.webdriver")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture
def browser(tmp_path):
    """As test_serve_page's: headless Chromium."""
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1200,760",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


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
