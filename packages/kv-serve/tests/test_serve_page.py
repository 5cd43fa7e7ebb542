"""The page ``GET /`` serves, driven in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium).

It loads the page, sends a chat message, sees the answer stream in (several events) and
equal the server's own non-streamed answer from the official ``openai`` client, watches the
pool view's counters move, and with the demo tool offered and required sees the tool call
shown. ``.ci/run`` installs the browser and sets ``KV_REQUIRE_BROWSER=1`` so that a missing
one fails there instead of skipping. ``KV_PAGE_SCREENSHOT=path.png`` saves a screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from serve_support import Serve

from kv_serve._server import RunningServer
from kv_testing import build_tiny_model, build_tiny_tokenizer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
MODEL = "tiny-gemma3-tools"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER) and not os.environ.get("KV_REQUIRE_BROWSER"),
    reason="needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
)


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    tokenizer = build_tiny_tokenizer(tools=True)
    model = build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=len(tokenizer))
    return serve(model, tokenizer, model_name=MODEL, max_running=4, max_context=2048, page_size=16)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM and DRIVER, "chromium and chromedriver must be installed"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,860",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def counter(driver: Any, name: str) -> int:
    from selenium.webdriver.common.by import By

    return int(driver.find_element(By.ID, f"stat-{name}").text)


def send(driver: Any, text: str) -> Any:
    """Type ``text``, send it, wait for the answer to finish; the answer's element."""
    from selenium.webdriver.common.by import By

    before = len(driver.find_elements(By.CSS_SELECTOR, ".assistant"))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()
    answers = wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, ".assistant")[before:], "an answer box"
    )
    wait_for(lambda: answers[0].get_attribute("data-done") == "true", "the answer to finish")
    return answers[0]


def test_the_page_chats_streams_and_shows_the_pool(served: RunningServer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(served.url + "/")
    body = browser.find_element(By.TAG_NAME, "body")
    wait_for(lambda: int(body.get_attribute("data-polls") or 0), "the first poll of /status")
    assert browser.find_element(By.ID, "model").text == f"model: {MODEL}"
    assert browser.find_element(By.ID, "pool-full").is_displayed()
    generated = counter(browser, "generation_tokens")

    answer = send(browser, "Tell me about the river")
    assert "error" not in (answer.get_attribute("class") or ""), answer.text
    text = answer.find_element(By.CSS_SELECTOR, ".text").text
    assert int(answer.get_attribute("data-chunks") or 0) > 1  # streamed, not one reply
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none")
    same = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the river"}],
        max_tokens=64,
        temperature=0,
    )
    # The browser renders the streamed deltas; the same request answered whole agrees.
    assert text.strip() == (same.choices[0].message.content or "").strip()
    # The pool view's counters moved (it polls /status twice a second).
    wait_for(lambda: counter(browser, "generation_tokens") > generated, "the counters to move")
    assert counter(browser, "decode_tokens") > 0 and counter(browser, "steps") > 0
    status = httpx.get(served.url + "/status").json()
    assert status["model"] == MODEL and status["chat"] is True
    assert {p["name"] for p in status["sub_pools"]} == {"full", "sliding-w8"}

    browser.find_element(By.ID, "offer-tool").click()
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, "tool-choice")).select_by_value("required")
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("160")
    called = send(browser, "What is the weather in Paris?")
    shown = called.find_elements(By.CSS_SELECTOR, ".tool")
    assert shown, (called.get_attribute("class"), called.text)
    assert shown[0].text.startswith("tool call get_weather(")
    arguments = shown[0].text[len("tool call get_weather(") : -1]
    assert isinstance(json.loads(arguments)["city"], str)
    if os.environ.get("KV_PAGE_SCREENSHOT"):
        browser.save_screenshot(os.environ["KV_PAGE_SCREENSHOT"])
