"""The playground page in a real browser: Debian's headless Chromium driven by Selenium, against a
real ``clef-gguf serve`` on the tiny model.

Checked: a request with all three question types built through the form with the keyboard, whose
bars (width and number) equal the API's own answer to the same request; the questions' JSON view
round-trips (key order and numbers as written); errors land next to the field they name; ids made of
markup render as text; the API key is asked once; with fine-tunes served beside the base, the model
picker sends the chosen one as ``model`` and the answer names it; no request leaves 127.0.0.1 and
the console stays clean. Pictures given by the file picker, a drop and a paste are sent in order as
data URIs and answered as the API answers the same body, a removed one leaves the request, a run
from the history brings them back, the copies carry them; 33 pictures are refused in the page in the
server's words with nothing sent, and the server's refusal of a picture is shown at the pictures.
Screenshots of each state go to ``$CLEF_UI_SCREENSHOTS`` (else the test's tmp dir);
``CLEF_UI_README_PNG=1`` also writes docs/ui.png, the README's picture.

The browser and its driver are the system's (``apt-get install chromium chromium-driver``, as CI
does), found by ``browser_helpers``: the suite never downloads one. Without them these tests are
skipped with that reason, before any server starts; under ``CLEF_REQUIRE_BROWSER=1`` (CI) they fail.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from browser_helpers import chromium, system_browser
from server_helpers import DEADLINE_S, REPO, serve_process, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import data_uri, encode, picture  # noqa: E402

MAX_LENGTH = 1024  # a small window, so that a long state is refused with field "state"
XSS = "<img src=x onerror=alert(1)>"
WIDE, NARROW = (1280, 800), (420, 860)


def ordered(text: str) -> list:
    """JSON with every object as a list of pairs: equality then checks key order too."""
    return json.loads(text, object_pairs_hook=lambda pairs: [[k, v] for k, v in pairs])


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def installed_browser() -> None:
    """The browser rule before anything else of the module (the servers): skip or fail at once."""
    system_browser()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("CLEF_UI_SCREENSHOTS")
    out = Path(where) if where else tmp_path_factory.mktemp("ui-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _serve(tmp_path_factory, tiny_model_dir, *flags: str, env: dict | None = None):
    return serve_process(tmp_path_factory.mktemp("ui-serve"), "--model", str(tiny_model_dir),
                         "--threads", "1", "--max-length", str(MAX_LENGTH), *flags, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with _serve(tmp_path_factory, tiny_model_dir) as (proc, url, _port):
        wait_healthy(proc, url)
        yield url


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model_dir):
    with _serve(tmp_path_factory, tiny_model_dir, env={"CLEF_GGUF_API_KEY": "s3cret"}) as \
            (proc, url, _port):
        wait_healthy(proc, url)
        yield url


@pytest.fixture(scope="module")
def tuned_server(tmp_path_factory, tiny_model_dir, tiny_fine_tunes):
    """The tiny model and its fine-tunes "a" and "b" (``--adapter NAME=DIR``); the base answers by
    default."""
    adapters = [f"--adapter={name}={path}" for name, path in tiny_fine_tunes.items()]
    with _serve(tmp_path_factory, tiny_model_dir, *adapters) as (proc, url, _port):
        wait_healthy(proc, url)
        yield url


@pytest.fixture()
def browser():
    with chromium([f"--window-size={WIDE[0]},{WIDE[1]}"],
                  {"goog:loggingPrefs": {"performance": "ALL", "browser": "ALL"}}) as driver:
        viewport(driver, *WIDE)
        yield driver


# ------------------------------------------------------------------ helpers
def viewport(driver, width: int, height: int) -> None:
    """Size the window so that the page itself gets width x height pixels."""
    driver.set_window_size(width, height)
    inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
    driver.set_window_size(2 * width - inner[0], 2 * height - inner[1])


def wait(driver, condition, what: str):
    return WebDriverWait(driver, DEADLINE_S).until(lambda d: condition(d), message=what)


def by_id(driver, element_id: str):
    return driver.find_element(By.ID, element_id)


def open_page(driver, url: str) -> None:
    driver.get(f"{url}/")
    wait(driver, lambda d: by_id(d, "model-status").text.startswith("Model:"), "the model's name")


def press(element, key: str = Keys.ENTER) -> None:
    """Activate a control from the keyboard."""
    element.send_keys(key)


def focused(driver):
    return driver.switch_to.active_element


def set_value(driver, element, value: str) -> None:
    """Replace a text control's content as typing would (an input event), for long texts."""
    driver.execute_script("arguments[0].value = arguments[1];"
                          "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));",
                          element, value)


def decide(driver) -> None:
    """Ctrl+Enter, then wait until the page says this attempt ended (answered or refused)."""
    before = driver.find_element(By.TAG_NAME, "body").get_attribute("data-decisions") or "0"
    by_id(driver, "state").send_keys(Keys.CONTROL, Keys.ENTER)
    wait(driver, lambda d: (d.find_element(By.TAG_NAME, "body").get_attribute("data-decisions")
                            or "0") != before, "the decision to end")


def assert_answered(driver) -> None:
    shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".field-error") if e.text]
    assert by_id(driver, "answers-status").text.startswith("Answered by"), shown


def shot(driver, shots: Path, name: str) -> None:
    driver.save_screenshot(str(shots / f"{name}.png"))


def sent_requests(driver) -> list[dict]:
    """What the page sent since the last look, from the performance log (which this drains): each
    a CDP request ({url, method, postData, ...})."""
    out = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            out.append(message["params"]["request"])
    return out


def assert_local_only(driver, url: str, requests: list[dict] | None = None) -> None:
    urls = [r["url"] for r in (sent_requests(driver) if requests is None else requests)]
    assert urls, "the performance log recorded no request"
    # blob: URLs of this origin are the pictures' thumbnails, made by the page from bytes it holds
    elsewhere = [u for u in urls if not u.startswith((f"{url}/", f"blob:{url}/"))]
    assert not elsewhere, elsewhere


def api_answer(url: str, body: str) -> dict:
    """The API's own answer to a request body, sent as a script would."""
    out = httpx.post(f"{url}/v1/systemone", content=body.encode(),
                     headers={"Content-Type": "application/json"}, timeout=DEADLINE_S)
    assert out.status_code == 200, out.text
    return out.json()


def assert_console_clean(driver, allowed: tuple[tuple[str, int], ...] = ()) -> None:
    """No console error; only the API refusals (path, status) this test caused may appear:
    Chrome logs every 4xx a fetch gets as a network error."""
    bad = []
    for entry in driver.get_log("browser"):
        if entry["level"] != "SEVERE":
            continue
        expected = entry.get("source") == "network" and any(
            path in entry["message"] and f"status of {status}" in entry["message"]
            for path, status in allowed)
        if not expected:
            bad.append(entry)
    assert not bad, bad


def assert_copies_answer(driver, answers: dict) -> None:
    """The copied curl and avrik-sdk snippets run as they are and get ``answers``."""
    for button, cmd in (("copy-curl", ["bash", "-c"]), ("copy-avrik", [sys.executable, "-c"])):
        press(by_id(driver, button))
        snippet = by_id(driver, "copy-output").text
        ran = subprocess.run([*cmd, snippet], capture_output=True, text=True, timeout=DEADLINE_S)
        assert ran.returncode == 0, (snippet, ran.stderr)
        assert json.loads(ran.stdout)["answers"] == answers, button


def card(driver, index: int):
    return driver.find_elements(By.CSS_SELECTOR, "#questions-form > li")[index]


def delete_all_questions(driver) -> None:
    while driver.find_elements(By.CSS_SELECTOR, "#questions-form > li"):
        button = card(driver, 0).find_element(By.XPATH, ".//button[text()='Delete']")
        press(button)


def type_into_focused(driver, text: str) -> None:
    focused(driver).send_keys(text)


def field(container, label: str):
    """The control a <label> names, by the label's text (what a screen reader announces)."""
    lab = container.find_element(By.XPATH, f".//label[normalize-space(text())='{label}']")
    return container.find_element(By.ID, lab.get_attribute("for"))


def bars(driver, qid: str) -> dict[str, dict]:
    section = next(s for s in driver.find_elements(By.CSS_SELECTOR, "#results .answer")
                   if s.get_attribute("data-qid") == qid)
    out = {}
    for row in section.find_elements(By.CSS_SELECTOR, ".bar-row"):
        fill = row.find_element(By.CSS_SELECTOR, ".bar-fill")
        track = row.find_element(By.CSS_SELECTOR, ".bar-track")
        out[row.get_attribute("data-option")] = {
            "number": float(row.find_element(By.CSS_SELECTOR, ".bar-value").text),
            "style": float(fill.value_of_css_property("width").removesuffix("px")) /
            float(track.value_of_css_property("width").removesuffix("px")),
            "declared": float(driver.execute_script("return arguments[0].style.width", fill)
                              .removesuffix("%")),
            "track_px": track.size["width"],
            "chosen": "chosen" in row.get_attribute("class").split()}
    return out


def assert_bars_are(driver, answers: dict) -> None:
    """The page's bars (numbers, widths, the chosen row) and expected level are ``answers``, the
    API's ``answers`` for the example's urgent / team / anger questions."""
    assert [s.get_attribute("data-qid") for s in
            driver.find_elements(By.CSS_SELECTOR, "#results .answer")] == ["urgent", "team", "anger"]
    p_true = answers["urgent"]["noul"]
    want = {"urgent": {"true": p_true, "false": round(1 - p_true, 4)},
            "team": answers["team"]["probabilities"], "anger": answers["anger"]["probabilities"]}
    chosen = {"urgent": "true" if p_true >= 0.5 else "false", "team": answers["team"]["choice"],
              "anger": max(answers["anger"]["probabilities"],
                           key=answers["anger"]["probabilities"].get)}
    for qid, probs in want.items():
        shown = bars(driver, qid)
        assert list(shown) == list(probs), qid
        for option, p in probs.items():
            bar = shown[option]
            assert bar["number"] == p, (qid, option)
            assert bar["declared"] == pytest.approx(100 * p, abs=1e-9), (qid, option)
            assert bar["style"] == pytest.approx(p, abs=1.0 / bar["track_px"]), (qid, option)
            assert bar["chosen"] == (option == chosen[qid]), (qid, option)
    expected_level = driver.find_element(By.CSS_SELECTOR, '.answer[data-qid="anger"] .score').text
    assert float(expected_level) == answers["anger"]["score"]


STATE = "Refund 1182 not received after 14 days; the customer writes for the third time."
EXPECTED_QUESTIONS = [
    ["urgent", [["type", "noul"], ["instructions", "Is this urgent?"]]],
    ["team", [["type", "choice"], ["instructions", "Which team?"],
              ["criteria", [["billing", "Payments and refunds"], ["tech", None],
                            ["sales", "New deals"]]]]],
    ["anger", [["type", "score"], ["instructions", "How angry is the customer?"],
               ["criteria", ["calm", "annoyed", "furious"]]]],
]


def build_request_with_the_keyboard(driver) -> None:
    delete_all_questions(driver)
    state = by_id(driver, "state")
    state.clear()
    state.send_keys(STATE)
    # noul: adding a question moves the focus to its id field
    press(by_id(driver, "add-noul"))
    type_into_focused(driver, "urgent")
    set_text = lambda c, label, text: field(c, label).send_keys(text)  # noqa: E731
    set_text(card(driver, 0), "Instructions", "Is this urgent?")
    # choice: two option rows come with it, a third is added
    press(by_id(driver, "add-choice"))
    type_into_focused(driver, "team")
    set_text(card(driver, 1), "Instructions", "Which team?")
    set_text(card(driver, 1), "Option 1 id", "billing")
    rows = card(driver, 1).find_elements(By.CSS_SELECTOR, ".option")
    field(rows[0], "Description").send_keys("Payments and refunds")
    set_text(card(driver, 1), "Option 2 id", "tech")  # no description: null
    press(card(driver, 1).find_element(By.XPATH, ".//button[text()='Add option']"))
    type_into_focused(driver, "sales")  # the new option's id has the focus
    rows = card(driver, 1).find_elements(By.CSS_SELECTOR, ".option")
    field(rows[2], "Description").send_keys("New deals")
    # score: two levels come with it, a third is added
    press(by_id(driver, "add-score"))
    type_into_focused(driver, "anger")
    set_text(card(driver, 2), "Instructions", "How angry is the customer?")
    set_text(card(driver, 2), "Level 0", "calm")
    set_text(card(driver, 2), "Level 1", "annoyed")
    press(card(driver, 2).find_element(By.XPATH, ".//button[text()='Add level']"))
    set_text(card(driver, 2), "Level 2", "furious")


# A drop anywhere on the page (dragover first, as a real drag) or a paste of files, each as the
# browser hands them to the page: File objects in a DataTransfer.
GIVE_FILES = """
const [how, files, targetId] = arguments;
const dt = new DataTransfer();
for (const [name, b64] of files) {
  dt.items.add(new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, {type: "image/png"}));
}
const target = document.getElementById(targetId);
if (how === "paste") {
  const paste = new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true});
  target.dispatchEvent(paste);
  return [paste.defaultPrevented];
}
const over = new DragEvent("dragover", {dataTransfer: dt, bubbles: true, cancelable: true});
target.dispatchEvent(over);
const highlighted = document.body.classList.contains("dragging");
const drop = new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true});
target.dispatchEvent(drop);
return [over.defaultPrevented, highlighted, drop.defaultPrevented,
        document.body.classList.contains("dragging")];
"""


def give_files(driver, how: str, files: dict[str, bytes], target: str) -> list:
    return driver.execute_script(GIVE_FILES, how, [[name, base64.b64encode(data).decode()]
                                                   for name, data in files.items()], target)


def thumbnails(driver, count: int) -> list:
    """Once ``count`` thumbnails are there and drawn: each one's (alt, natural width, its Remove
    button's label)."""
    wait(driver, lambda d: d.execute_script(
        "const imgs = document.querySelectorAll('#images-list img');"
        "return imgs.length === arguments[0] && [...imgs].every((i) => i.complete);", count),
        f"{count} thumbnails")
    return [(li.find_element(By.TAG_NAME, "img").get_attribute("alt"),
             driver.execute_script("return arguments[0].naturalWidth", li.find_element(By.TAG_NAME, "img")),
             li.find_element(By.TAG_NAME, "button").get_attribute("aria-label"))
            for li in driver.find_elements(By.CSS_SELECTOR, "#images-list li")]


def copied_json(driver) -> dict:
    press(by_id(driver, "copy-json"))
    return json.loads(by_id(driver, "copy-output").text)


def posted(driver) -> list[str]:
    """The bodies the page POSTed since the last look."""
    return [r["postData"] for r in sent_requests(driver) if r["method"] == "POST"]


# ------------------------------------------------------------------ tests
def test_form_request_bars_equal_the_api(browser, server, shots):
    open_page(browser, server)
    assert not by_id(browser, "model-picker-row").is_displayed()  # one model: nothing to pick
    shot(browser, shots, "01-loaded")
    build_request_with_the_keyboard(browser)
    shot(browser, shots, "02-form")
    # the request the page sends, as its "Copy as JSON" shows it
    press(by_id(browser, "copy-json"))
    sent = by_id(browser, "copy-output").text
    assert ordered(sent) == [["state", STATE], ["questions", EXPECTED_QUESTIONS]]
    decide(browser)
    assert_answered(browser)
    api = api_answer(server, sent)
    answers = api["answers"]
    assert_bars_are(browser, answers)
    assert by_id(browser, "tokens").text == str(api["usage"]["input_tokens"])
    shot(browser, shots, "03-decided")
    if os.environ.get("CLEF_UI_README_PNG"):
        browser.save_screenshot(str(REPO / "docs" / "ui.png"))
    # the run is in the history, and a baseline compares the next run with it
    assert len(browser.find_elements(By.CSS_SELECTOR, "#history li")) == 1
    press(by_id(browser, "pin-baseline"))
    by_id(browser, "state").send_keys(" Cancel my account now!")
    decide(browser)
    assert_answered(browser)
    press(by_id(browser, "copy-json"))
    after = httpx.post(f"{server}/v1/systemone", content=by_id(browser, "copy-output").text.encode(),
                       headers={"Content-Type": "application/json"}, timeout=DEADLINE_S).json()
    rows = browser.find_elements(By.CSS_SELECTOR, '.answer[data-qid="team"] .bar-row:not(.head)')
    for row, (option, p) in zip(rows, after["answers"]["team"]["probabilities"].items(), strict=True):
        assert float(row.find_element(By.CSS_SELECTOR, ".bar-value").text) == p
        assert float(row.find_element(By.CSS_SELECTOR, ".baseline-value").text) == \
            answers["team"]["probabilities"][option]
        delta = row.find_element(By.CSS_SELECTOR, ".bar-delta").text.replace("−", "-")
        assert float(delta) == pytest.approx(p - answers["team"]["probabilities"][option], abs=1e-9)
    shot(browser, shots, "04-compared")
    # the copied curl and avrik-sdk snippets run as they are and get the same answers
    assert_copies_answer(browser, after["answers"])
    # a run from the history loads back into the form
    oldest = browser.find_elements(By.CSS_SELECTOR, "#history li")[-1]
    press(oldest.find_element(By.XPATH, ".//button[text()='Load']"))
    assert by_id(browser, "state").get_attribute("value") == STATE
    # narrow window: nothing wider than the window
    viewport(browser, *NARROW)
    assert browser.execute_script("return document.documentElement.scrollWidth <= "
                                  "document.documentElement.clientWidth")
    shot(browser, shots, "05-narrow")
    # dark theme from the OS setting
    light = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    viewport(browser, *WIDE)
    browser.execute_script("window.scrollTo(0, 0)")
    dark = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    assert dark != light
    shot(browser, shots, "06-dark")
    assert_local_only(browser, server)
    assert_console_clean(browser)


def test_questions_json_view_round_trips(browser, server, shots):
    open_page(browser, server)
    press(by_id(browser, "questions-view-json"), Keys.SPACE)
    view = by_id(browser, "questions-json")
    assert view.is_displayed() and not by_id(browser, "questions-form-view").is_displayed()
    example = ordered(view.get_attribute("value"))
    assert [q[0] for q in example] == ["urgent", "team", "anger"]
    # integer-like keys keep their order and 1.0 stays 1.0 (JSON.parse would change both)
    edited = ('{"2": {"type": "choice", "instructions": 1.0, "criteria": {"10": "ten", "9": null}},\n'
              ' "1": {"type": "noul", "criteria": {"true": "yes"}, "note": "kept"},\n'
              ' "b": {"type": "score", "criteria": ["lo", "hi"]}}')
    set_value(browser, view, edited)
    press(by_id(browser, "questions-view-form"), Keys.SPACE)
    ids = [c.find_element(By.CSS_SELECTOR, "input.qid").get_attribute("value")
           for c in browser.find_elements(By.CSS_SELECTOR, "#questions-form > li")]
    assert ids == ["2", "1", "b"]
    options = [i.get_attribute("value") for i in
               card(browser, 0).find_elements(By.CSS_SELECTOR, "input.option-id")]
    assert options == ["10", "9"]
    instructions = field(card(browser, 0), "Instructions")
    assert instructions.get_attribute("value") == "1.0" and instructions.get_attribute("readonly")
    shot(browser, shots, "07-json-to-form")
    press(by_id(browser, "questions-view-json"), Keys.SPACE)
    back = view.get_attribute("value")
    assert ordered(back) == ordered(edited) and '"instructions": 1.0' in back
    # a broken JSON view is named at its field and keeps the form view shut
    set_value(browser, view, '{"q": {"type": "noul"},}')
    assert "Not valid JSON" in by_id(browser, "questions-json-error").text
    press(by_id(browser, "questions-view-form"), Keys.SPACE)
    assert view.is_displayed() and view.get_attribute("aria-invalid") == "true"
    assert_local_only(browser, server)
    assert_console_clean(browser)


def test_errors_are_shown_at_their_field(browser, server, shots):
    open_page(browser, server)
    state = by_id(browser, "state")
    # checked as typed: JSON state that does not parse
    press(by_id(browser, "state-mode-json"), Keys.SPACE)
    set_value(browser, state, '{"ticket": "refund", ')
    error = by_id(browser, "state-error")
    assert "Not valid JSON" in error.text and state.get_attribute("aria-invalid") == "true"
    decide(browser)
    assert by_id(browser, "answers-status").text == "No decision yet."  # nothing was sent
    shot(browser, shots, "08-state-json-error")
    set_value(browser, state, '{"ticket": "refund", "amount": 10.0}')
    assert error.text == "" and state.get_attribute("aria-invalid") is None
    # refused by the server: a state too long for the window names the field "state"
    press(by_id(browser, "state-mode-text"), Keys.SPACE)
    set_value(browser, state, "refund please " * 2000)
    decide(browser)
    assert "context_too_large" in error.text and "field state" in error.text
    assert by_id(browser, "request-error").text == ""
    shot(browser, shots, "09-state-too-long")
    # a question's error goes into that question's card
    set_value(browser, state, "short")
    press(by_id(browser, "questions-view-json"), Keys.SPACE)
    set_value(browser, by_id(browser, "questions-json"),
              '{"ok": {"type": "noul"}, "bad": {"type": "choice", "criteria": {}}}')
    press(by_id(browser, "questions-view-form"), Keys.SPACE)
    decide(browser)
    message = card(browser, 1).find_element(By.CSS_SELECTOR, "[data-error=question]").text
    assert "invalid_criteria" in message and "questions.bad.criteria" in message
    assert card(browser, 0).find_element(By.CSS_SELECTOR, "[data-error=question]").text == ""
    shot(browser, shots, "10-question-error")
    assert_local_only(browser, server)
    assert_console_clean(browser, allowed=(("/v1/systemone", 413), ("/v1/systemone", 422)))


def test_markup_in_ids_and_state_renders_as_text(browser, server, shots):
    open_page(browser, server)
    set_value(browser, by_id(browser, "state"), f"{XSS} <script>alert(2)</script>")
    press(by_id(browser, "questions-view-json"), Keys.SPACE)
    questions = {XSS: {"type": "choice", "instructions": XSS, "criteria": {XSS: XSS, "b": None}},
                 "s": {"type": "score", "criteria": [XSS, "<b>bold</b>"]}}
    set_value(browser, by_id(browser, "questions-json"), json.dumps(questions))
    press(by_id(browser, "questions-view-form"), Keys.SPACE)
    assert by_id(browser, "questions-error").text == ""
    decide(browser)
    assert_answered(browser)
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert browser.find_elements(By.TAG_NAME, "img") == []
    assert browser.find_elements(By.CSS_SELECTOR, "#results b, #results script") == []
    heads = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#results .answer h3 .qid")]
    assert heads == [XSS, "s"]
    labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#results .option-label")]
    assert XSS in labels and f"0 · {XSS}" in labels and "1 · <b>bold</b>" in labels
    assert XSS in by_id(browser, "history").text
    assert card(browser, 0).find_element(By.CSS_SELECTOR, "input.qid").get_attribute("value") == XSS
    shot(browser, shots, "11-markup-as-text")
    assert_local_only(browser, server)
    assert_console_clean(browser)


def test_api_key_is_asked_once(browser, keyed_server, shots):
    browser.get(f"{keyed_server}/")  # the page and its assets load without the key
    key_form = by_id(browser, "key-form")
    wait(browser, lambda d: key_form.is_displayed(), "the key form")
    assert focused(browser) == by_id(browser, "api-key")
    shot(browser, shots, "12-api-key")
    type_into_focused(browser, "s3cret")
    press(by_id(browser, "api-key"))  # Enter submits the form
    wait(browser, lambda d: by_id(d, "model-status").text.startswith("Model:"), "the model")
    assert not key_form.is_displayed()
    decide(browser)
    assert_answered(browser)
    # the key lives in this tab's session storage only: nothing of it in local storage
    assert browser.execute_script("return Object.values(sessionStorage).includes('s3cret')")
    assert "s3cret" not in browser.execute_script("return JSON.stringify(localStorage)")
    browser.refresh()  # kept for the tab's session
    wait(browser, lambda d: by_id(d, "model-status").text.startswith("Model:"), "the model")
    assert not by_id(browser, "key-form").is_displayed()
    assert_local_only(browser, keyed_server)
    assert_console_clean(browser, allowed=(("/v1/models", 401),))


def test_model_picker_sends_the_chosen_fine_tune(browser, tuned_server, tiny_fine_tunes, shots):
    listed = httpx.get(f"{tuned_server}/v1/models", timeout=DEADLINE_S).json()["models"]
    base = next(m["name"] for m in listed if m["default"])
    open_page(browser, tuned_server)
    picker = field(by_id(browser, "model"), "Model")  # labelled, the default preselected
    assert picker.get_attribute("id") == "model-picker" and picker.is_displayed()
    options = picker.find_elements(By.TAG_NAME, "option")
    assert [(o.get_attribute("value"), o.is_selected()) for o in options] == \
        [(base, True), ("a", False), ("b", False)]
    # nothing picked: the default answers, and the request names it
    decide(browser)
    assert_answered(browser)
    assert by_id(browser, "answers-status").text == f"Answered by {base}"
    # the fine-tune picked from the keyboard: the request names it, it answers, the bars are its own
    picker.send_keys(Keys.ARROW_DOWN)
    assert picker.get_attribute("value") == "a"
    assert by_id(browser, "model-status").text.startswith("Model: a")
    decide(browser)
    assert_answered(browser)
    assert by_id(browser, "answers-status").text == "Answered by a"
    shot(browser, shots, "13-fine-tune")
    requests = sent_requests(browser)
    assert_local_only(browser, tuned_server, requests)
    posted = [r["postData"] for r in requests if r["method"] == "POST"]
    assert [json.loads(body)["model"] for body in posted] == [base, "a"]
    by_base, by_a = (api_answer(tuned_server, body) for body in posted)
    assert by_a["model"] == "a" and by_a["answers"] != by_base["answers"]  # it is another model
    assert_bars_are(browser, by_a["answers"])
    # the copies name it too: curl runs as it is; the Python one loads the fine-tune's directory
    press(by_id(browser, "copy-json"))
    assert json.loads(by_id(browser, "copy-output").text)["model"] == "a"
    press(by_id(browser, "copy-curl"))
    ran = subprocess.run(["bash", "-c", by_id(browser, "copy-output").text], capture_output=True,
                         text=True, timeout=DEADLINE_S)
    assert json.loads(ran.stdout)["answers"] == by_a["answers"], ran.stderr
    press(by_id(browser, "copy-python"))
    assert f'adapters={{"a": {json.dumps(str(tiny_fine_tunes["a"]))}}}' in \
        by_id(browser, "copy-output").text
    # a run again from the history asks its own model again, whatever is picked now
    picker.send_keys(Keys.ARROW_DOWN)
    assert picker.get_attribute("value") == "b"
    newest = browser.find_elements(By.CSS_SELECTOR, "#history li")[0]
    assert newest.find_element(By.CSS_SELECTOR, ".what").text.endswith("(a)")
    press(newest.find_element(By.XPATH, ".//button[text()='Run again']"))
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-decisions")
         == "3", "the run again to end")
    assert picker.get_attribute("value") == "a"
    assert by_id(browser, "answers-status").text == "Answered by a"
    assert_bars_are(browser, by_a["answers"])
    assert_local_only(browser, tuned_server)
    assert_console_clean(browser)


def test_pictures_picked_dropped_and_pasted_bars_equal_the_api(browser, server, shots, tmp_path):
    pngs = {f"p{i}.png": encode(picture(40 + 8 * i, 24, seed=i)) for i in range(3)}
    uris = [data_uri(data) for data in pngs.values()]
    (tmp_path / "p0.png").write_bytes(pngs["p0.png"])
    open_page(browser, server)
    # the file picker, a drop onto another part of the page, a paste into the state
    by_id(browser, "images-input").send_keys(str(tmp_path / "p0.png"))
    thumbnails(browser, 1)
    assert give_files(browser, "drop", {"p1.png": pngs["p1.png"]}, "results") == [True, True, True, False]
    thumbnails(browser, 2)
    state = by_id(browser, "state").get_attribute("value")
    assert give_files(browser, "paste", {"p2.png": pngs["p2.png"]}, "state") == [True]
    assert by_id(browser, "state").get_attribute("value") == state  # nothing pasted as text
    assert thumbnails(browser, 3) == [
        (f"Picture {i + 1} (p{i}.png)", 40 + 8 * i, f"Remove picture {i + 1} (p{i}.png)") for i in range(3)]
    shot(browser, shots, "14-pictures")
    # sent in order as data URIs; the bars are the API's answer to the same body
    assert copied_json(browser)["images"] == uris
    sent_requests(browser)
    decide(browser)
    assert_answered(browser)
    [body] = posted(browser)
    assert json.loads(body)["images"] == uris
    api = api_answer(server, body)
    assert_bars_are(browser, api["answers"])
    text_only = api_answer(server, json.dumps({k: v for k, v in json.loads(body).items() if k != "images"}))
    assert api["usage"]["input_tokens"] > text_only["usage"]["input_tokens"]  # the pictures reached it
    assert by_id(browser, "tokens").text == str(api["usage"]["input_tokens"])
    assert by_id(browser, "pictures-used").text.startswith("3 ")
    # the vision tower's time, from the Server-Timing header's vision entry
    assert by_id(browser, "vision-row").is_displayed()
    assert by_id(browser, "vision-time").text.endswith(" ms")
    # asked again, the pictures' tokens come from the cache, as they did for the API's ask
    decide(browser)
    assert posted(browser) == [body]
    cached = api["usage"].get("cached_media_tokens")
    assert by_id(browser, "cached-media-row").is_displayed() == (cached is not None)
    assert by_id(browser, "cached-media").text == ("" if cached is None else str(cached))
    shot(browser, shots, "15-pictures-decided")
    # the second one removed from the keyboard: the focus moves to the next Remove, the request drops it
    press(browser.find_elements(By.CSS_SELECTOR, "#images-list button")[1])
    assert [t[0] for t in thumbnails(browser, 2)] == ["Picture 1 (p0.png)", "Picture 2 (p2.png)"]
    assert focused(browser).get_attribute("aria-label") == "Remove picture 2 (p2.png)"
    assert copied_json(browser)["images"] == [uris[0], uris[2]]
    decide(browser)
    assert_answered(browser)
    [body] = posted(browser)
    assert json.loads(body)["images"] == [uris[0], uris[2]]
    after = api_answer(server, body)
    assert_bars_are(browser, after["answers"])
    # the copied curl and avrik-sdk snippets carry the pictures and get the same answers
    assert_copies_answer(browser, after["answers"])
    press(by_id(browser, "copy-python"))
    assert uris[2] in by_id(browser, "copy-output").text
    # a run from the history brings its pictures back
    press(by_id(browser, "images-list").find_element(By.TAG_NAME, "button"))
    press(by_id(browser, "images-list").find_element(By.TAG_NAME, "button"))
    assert by_id(browser, "images-list").find_elements(By.TAG_NAME, "li") == []
    oldest = browser.find_elements(By.CSS_SELECTOR, "#history li")[-1]
    press(oldest.find_element(By.XPATH, ".//button[text()='Load']"))
    assert [t[:2] for t in thumbnails(browser, 3)] == [(f"Picture {i + 1}", 40 + 8 * i) for i in range(3)]
    assert copied_json(browser)["images"] == uris
    assert_local_only(browser, server)
    assert_console_clean(browser)


def test_pictures_over_the_limit_or_refused_are_named_at_the_pictures(browser, server, shots):
    open_page(browser, server)
    plain = copied_json(browser)
    tiny = encode(picture(8, 8))
    give_files(browser, "drop", {f"t{i}.png": tiny for i in range(33)}, "pictures")
    thumbnails(browser, 33)
    # the server's own refusal of the same request, word for word, before anything is sent
    refused = httpx.post(f"{server}/v1/systemone", json={**plain, "images": [data_uri(tiny)] * 33},
                         timeout=DEADLINE_S)
    assert refused.status_code == 413
    err = refused.json()["error"]
    message = f"{err['message']} ({err['code']}, field {err['field']})"
    error = by_id(browser, "images-error")
    assert error.text == message
    sent_requests(browser)
    decide(browser)
    assert posted(browser) == [] and error.text == message
    assert focused(browser) == by_id(browser, "images-input")
    assert by_id(browser, "answers-status").text == "No decision yet."
    shot(browser, shots, "16-too-many-pictures")
    # one removed: under the limit again; all removed, a file that is no picture the server reads:
    # its refusal is shown at the pictures, naming the picture
    press(by_id(browser, "images-list").find_element(By.TAG_NAME, "button"))
    assert error.text == ""
    for _ in range(32):  # each Remove hands the focus to the next one
        press(focused(browser))
    assert browser.find_elements(By.CSS_SELECTOR, "#images-list li") == []
    give_files(browser, "paste", {"broken.png": b"not a png"}, "state")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#images-list li"), "the broken picture")
    decide(browser)
    assert "invalid_media" in error.text and "field images.0" in error.text, error.text
    assert by_id(browser, "request-error").text == ""
    assert_local_only(browser, server)
    assert_console_clean(browser, allowed=(("/v1/systemone", 422),))
