"""The playground's evidence view in a real browser (Debian's headless Chromium, Selenium) against a real
``clef-gguf serve`` on the tiny model: asked for in the Options, the selected question's spans are
highlighted in the state exactly where the API's own answer puts them (a text state and a JSON state,
rendered as the server renders it), with their shares; occlusion's Δp is listed; switching the question
switches the highlights; with the grid asked for, each picture's patch grid is a heat map of the API's
grid. Screenshots go to ``$CLEF_UI_SCREENSHOTS`` (else the test's tmp dir)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from clef_gguf.pipeline.encode import render
from test_ui_browser import (  # the page's own helpers and fixtures
    api_answer, assert_answered, assert_console_clean, browser, by_id, decide, give_files, installed_browser,
    open_page, press, server, set_value, shot, shots, thumbnails, wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import data_uri, encode, picture  # noqa: E402

__all__ = ["browser", "installed_browser", "server", "shots"]  # fixtures, used by name

QUESTIONS = {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
             "team": {"type": "choice", "instructions": "Which team?",
                      "criteria": {"billing": "Payments and refunds", "tech": "Bugs", "sales": "New deals"}}}
TEXT_STATE = "The invoice page crashes since Monday and I was charged twice for order 1182."
JSON_STATE = {"ticket": "Refund not received after 14 days", "amount": 129.5, "tags": ["billing", "late"],
              "small": 1e-05, "big": 1e16}


def fill(driver, state: str, json_mode: bool, mode: str) -> None:
    by_id(driver, "state-mode-json" if json_mode else "state-mode-text").click()
    set_value(driver, by_id(driver, "state"), state)
    by_id(driver, "questions-view-json").click()
    set_value(driver, by_id(driver, "questions-json"), json.dumps(QUESTIONS))
    Select(by_id(driver, "opt-evidence")).select_by_value(mode)


def marks(driver) -> list[dict]:
    return [{"text": m.text, "rank": int(m.get_attribute("data-rank"))}
            for m in driver.find_elements(By.CSS_SELECTOR, "#evidence-view .evidence-state mark")]


def expected(block: dict) -> list[dict]:
    return sorted(({"text": s["text"], "rank": i + 1, "start": s["start"]} for i, s in enumerate(block["spans"])),
                  key=lambda s: s["start"])


@pytest.mark.parametrize("json_mode", [False, True])
def test_the_selected_questions_spans_are_highlighted_where_the_api_puts_them(browser, server, shots, json_mode):
    state = json.dumps(JSON_STATE) if json_mode else TEXT_STATE
    open_page(browser, server)
    fill(browser, state, json_mode, "occlusion")
    decide(browser)
    assert_answered(browser)
    wait(browser, lambda d: by_id(d, "evidence").is_displayed(), "the evidence view")
    body = {"state": JSON_STATE if json_mode else TEXT_STATE, "questions": QUESTIONS, "evidence": {"mode": "occlusion"}}
    api = api_answer(server, json.dumps(body))["evidence"]
    rendered = render(body["state"])
    view = by_id(browser, "evidence-view")
    assert view.find_element(By.CSS_SELECTOR, ".evidence-state").text == rendered
    for qid in ("urgent", "team"):
        Select(by_id(browser, "evidence-question")).select_by_value(qid)
        block = api["questions"][qid]
        assert marks(browser) == [{"text": s["text"], "rank": s["rank"]} for s in expected(block)]
        items = [li.text for li in view.find_elements(By.CSS_SELECTOR, ".evidence-spans li")]
        assert len(items) == len(block["spans"])
        for item, span in zip(items, block["spans"]):
            assert item.startswith(f"“{span['text']}” {100 * span['share']:.1f}%") and "Δp" in item
        assert f"Attention of “{block['option']}”" in view.text
        assert f"Occlusion: {api['reruns']} re-runs" in view.text
        shot(browser, shots, f"evidence-{'json' if json_mode else 'text'}-{qid}")
    assert_console_clean(browser)


def test_no_evidence_asked_no_view(browser, server):
    open_page(browser, server)
    fill(browser, TEXT_STATE, False, "")
    decide(browser)
    assert_answered(browser)
    assert not by_id(browser, "evidence").is_displayed()


def test_each_pictures_patch_grid_is_a_small_heat_map_on_request(browser, server, shots):
    pngs = {"wide.png": encode(picture(48, 16, 2)), "square.png": encode(picture(32, 32, 1))}
    open_page(browser, server)
    fill(browser, "Two pictures of the parcel.", False, "attention")
    press(by_id(browser, "opt-evidence-grid"), Keys.SPACE)
    give_files(browser, "paste", pngs, "state")
    thumbnails(browser, 2)
    decide(browser)
    assert_answered(browser)
    wait(browser, lambda d: by_id(d, "evidence").is_displayed(), "the evidence view")
    body = {"state": "Two pictures of the parcel.", "questions": QUESTIONS,
            "images": [data_uri(data) for data in pngs.values()], "evidence": {"mode": "attention", "grid": True}}
    api = api_answer(server, json.dumps(body))["evidence"]
    for qid in ("urgent", "team"):
        Select(by_id(browser, "evidence-question")).select_by_value(qid)
        pictures = api["questions"][qid]["pictures"]
        maps = browser.find_elements(By.CSS_SELECTOR, "#evidence-view .evidence-heatmap")
        assert len(maps) == len(pictures) == 2
        for number, (figure, want) in enumerate(zip(maps, pictures), 1):
            grid = figure.find_element(By.CSS_SELECTOR, ".evidence-grid")
            assert grid.get_attribute("aria-label") == \
                f"Picture #{number}: attention over its {want['rows']} × {want['cols']} patches"
            cells = grid.find_elements(By.TAG_NAME, "span")
            heat = [float(x) for x in browser.execute_script(
                "return [...arguments[0].children].map((c) => c.style.getPropertyValue('--heat'))", grid)]
            flat = [x for row in want["grid"] for x in row]
            assert len(cells) == want["rows"] * want["cols"] == len(flat)
            assert max(heat) == 1.0 and heat.index(1.0) == flat.index(max(flat))
            assert grid.size["width"] > 0 and grid.size["height"] > 0  # drawn, not only in the DOM
            colours = {c.value_of_css_property("background-color") for c in cells}
            assert cells[0].size["width"] > 0 and len(colours) > 1  # painted by strength
            assert figure.find_element(By.TAG_NAME, "figcaption").text == f"#{number} {100 * want['share']:.1f}%"
        shot(browser, shots, f"evidence-grid-{qid}")
    assert_console_clean(browser)
