"""The system's headless Chromium for the tests that drive a page in a browser: the one place that
finds it and decides what a missing one means.

The browser and its driver are Debian's (``apt-get install chromium chromium-driver``); the suite
never downloads one. Without them a browser test is skipped, with a reason naming what is missing
and the command that installs it, unless ``CLEF_REQUIRE_BROWSER=1`` (set by .ci/run once it has
installed both): then a missing browser fails the test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PACKAGES = ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver"))
INSTALL = "apt-get install chromium chromium-driver"
REQUIRE_ENV = "CLEF_REQUIRE_BROWSER"

# headless, and nothing that reaches beyond 127.0.0.1 on its own
HEADLESS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
            "--no-first-run", "--disable-background-networking", "--disable-sync",
            "--disable-component-update", "--disable-default-apps", "--disable-extensions")


def required() -> bool:
    """Whether this run must have the browser (CI): a missing one fails instead of skipping."""
    return os.environ.get(REQUIRE_ENV) == "1"


def missing_browser() -> list[str]:
    """What of the system browser is not installed, as ``"PATH (package)"``; empty when both are."""
    return [f"{path} ({package})" for path, package in PACKAGES
            if not (path.is_file() and os.access(path, os.X_OK))]


def system_browser() -> tuple[Path, Path]:
    """(chromium, chromedriver), or the test ends here: skipped, or failed under
    ``CLEF_REQUIRE_BROWSER=1``, with what is missing and how to install it."""
    missing = missing_browser()
    if missing:
        reason = (f"the system browser is not installed: {', '.join(missing)} missing; install "
                  f"it with `{INSTALL}` (the suite never downloads a browser)")
        if required():
            pytest.fail(f"{reason}. {REQUIRE_ENV}=1: this run requires the browser tests.",
                        pytrace=False)
        pytest.skip(f"{reason}; {REQUIRE_ENV}=1 makes this a failure")
    return CHROMIUM, CHROMEDRIVER


@contextlib.contextmanager
def chromium(args: Iterable[str] = (), capabilities: dict | None = None) -> Iterator:
    """A Selenium driver of the system's headless Chromium (``system_browser``'s rule first);
    quit on exit. Selenium's own manager, which would download a browser, must not run."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    browser, driver_path = system_browser()

    def no_download(*_args, **_kwargs):
        raise AssertionError("selenium-manager must not run: the system browser is used")

    options = Options()
    options.binary_location = str(browser)
    for arg in (*HEADLESS, *args):
        options.add_argument(arg)
    for name, value in (capabilities or {}).items():
        options.set_capability(name, value)
    with pytest.MonkeyPatch.context() as patch:  # for the driver's whole life
        patch.setattr(SeleniumManager, "binary_paths", no_download)
        driver = webdriver.Chrome(service=Service(executable_path=str(driver_path)),
                                  options=options)
        try:
            yield driver
        finally:
            driver.quit()
