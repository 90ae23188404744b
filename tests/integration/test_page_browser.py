"""The page at `/` in headless Chromium (Debian's package, driven by Playwright): type a prompt, see
the answer stream in over /v1/ws, stop a long one, and watch the live /metrics view."""

from __future__ import annotations

import os
import re
import shutil

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# what this closed network needs (no background connections) and a root user in a container needs
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CONDUIT_REQUIRE_BROWSER"):
            pytest.fail(f"no Chromium at {CHROMIUM}, and CONDUIT_REQUIRE_BROWSER is set")
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    from playwright.sync_api import expect

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    expect(page.get_by_test_id("model").locator("option")).to_have_text(["SmolLM2-135M-Instruct"])
    yield page
    page.close()
    assert not errors, errors


def test_a_prompt_streams_its_answer(page):
    from playwright.sync_api import expect

    page.get_by_test_id("max-tokens").fill("32")
    page.get_by_test_id("prompt").fill("What is the capital of France?")
    page.get_by_test_id("prompt").press("Enter")
    answer = page.get_by_test_id("answer").last
    expect(answer).to_have_attribute("data-finish", "stop", timeout=120_000)
    expect(answer.locator(".text")).to_contain_text("Paris")
    expect(page.get_by_test_id("status")).to_contain_text("finished: stop")
    expect(page.get_by_test_id("speed")).to_have_text(re.compile(r"\d+ tokens, [\d.]+ tokens/s"))
    expect(page.get_by_test_id("connection")).to_have_text("connected")


def test_stop_aborts_a_long_answer_and_the_metrics_view_sees_it(page, server):
    from playwright.sync_api import expect

    page.get_by_test_id("max-tokens").fill("2000")
    page.get_by_test_id("ignore-eos").check()
    page.get_by_test_id("prompt").fill("Tell me a very long story about a lighthouse.")
    page.get_by_test_id("send").click()
    answer = page.get_by_test_id("answer").last
    text = answer.locator(".text")
    expect(page.get_by_test_id("speed")).to_have_text(re.compile(r"^([5-9]|\d\d+) tokens"), timeout=120_000)
    expect(page.get_by_test_id("m-running")).to_have_text("1", timeout=10_000)  # the live /metrics view
    page.get_by_test_id("stop").click()
    expect(answer).to_have_attribute("data-finish", "stopped", timeout=30_000)
    expect(page.get_by_test_id("status")).to_contain_text("finished: stopped")
    stopped_at = text.inner_text()
    assert stopped_at.strip()
    expect(page.get_by_test_id("m-running")).to_have_text("0", timeout=10_000)
    assert text.inner_text() == stopped_at  # nothing arrived after the stop
    expect(page.get_by_test_id("send")).to_be_enabled()
    server.wait_idle()
