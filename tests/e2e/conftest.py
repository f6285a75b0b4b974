from pathlib import Path

import pytest

from tests.serve_runs import ServerProcess

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.fixture(scope="session")
def grading_run(tmp_path_factory):
    """tests/grading_runs.py's run, trained once a session; modules take a copy (copy_grading_run)."""
    from tests.grading_runs import train_grading_run

    return train_grading_run(tmp_path_factory.mktemp("grading-trained"))


@pytest.fixture(scope="session")
def server(serve_run):
    """A real `qatune serve` on a free loopback port."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    process = ServerProcess(serve_run)
    yield process
    assert process.stop() == 0, "".join(process.log)


@pytest.fixture
def browser(tmp_path):
    """Headless Debian Chromium driven by selenium (the page tests); skipped where it is not installed."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed "
                    "(apt-get install -y chromium chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver")
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
