"""The chat page at `/`, driven in headless Chromium (Debian's `chromium`, through playwright)
against a real `serve` of the default model that requires an API key.

Where Chromium or playwright is missing the browser test is skipped, with the reason, so that
`make test` stays usable on a machine without them. With `COMPILED_ENGINE_REQUIRE_BROWSER=1` (set
by `.ci/run`, which installs Chromium) it fails instead: the chat page is part of the product."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from tests.server_process import ABORTED, ServerProcess, metric, running_server, wait_until_aborted_and_idle

KEY = "page-test-key"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
REQUIRE_BROWSER = "COMPILED_ENGINE_REQUIRE_BROWSER"
# Every text the reply's element is given while it streams, recorded as each render happens (a
# MutationObserver sees every change, where polling would only sample some).
RECORD_RENDERS = """() => {
    window.renders = [];
    new MutationObserver(records => {
        for (const record of records)
            if (record.target.matches(".message.assistant .content"))
                for (const node of record.addedNodes) window.renders.push(node.textContent);
    }).observe(document.getElementById("messages"), {childList: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--kv-cache-memory-gib", "0.05", "--enforce-eager", "--api-key", KEY]
    with running_server(tmp_path_factory.mktemp("chat_page"), *args) as process:
        yield process


def _cannot_run(reason: str) -> NoReturn:
    """Skip the browser test, or fail it where the browser is required (CI)."""
    if os.environ.get(REQUIRE_BROWSER) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_BROWSER}=1 requires the browser test to run")
    pytest.skip(f"{reason}; the chat page is not tested in a browser here")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        _cannot_run("Chromium is not installed (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _cannot_run("playwright is not installed (the dev extra)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


STATS_DONE = "document.getElementById('stats').textContent.includes('tokens/s')"


def test_the_page_is_served_without_the_key_and_its_calls_need_it(server: ServerProcess) -> None:
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/chat/chat.js" in page.text and "https://" not in page.text  # nothing from elsewhere
    for name, kind in (("chat.js", "javascript"), ("chat.css", "text/css")):
        asset = httpx.get(f"{server.url}/chat/{name}", timeout=10)
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
        assert "https://" not in asset.text and "http://" not in asset.text
    assert httpx.get(f"{server.url}/chat/missing.js", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401


def test_chatting_in_a_browser(server: ServerProcess, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    problems: list[str] = []
    page.on("console", lambda message: message.type == "error" and problems.append(message.text))
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(f"{server.url}/")

    # Without the key: the server's 401 is shown as a readable message, and nothing is lost.
    page.fill("#max-tokens", "48")
    page.fill("#temperature", "0")
    page.fill("#input", "What is the capital of France?")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert "API key" in page.inner_text("#error") and "401" in page.inner_text("#error")
    assert page.input_value("#input") == "What is the capital of France?"  # back for another try
    assert page.locator(".message").count() == 0

    # With the key: the reply is shown as it streams, each piece added to what came before, then
    # the finished reply shows its stats.
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.evaluate(RECORD_RENDERS)
    page.fill("#input", "Write a short poem about the sea.")
    page.click("#send")
    page.wait_for_function(STATS_DONE, timeout=120_000)
    stats = page.inner_text("#stats")
    assert "tokens/s" in stats and "time to first token" in stats and "cached prompt tokens" in stats
    renders: list[str] = page.evaluate("window.renders")
    reply = page.evaluate("document.querySelector('.message.assistant .content').textContent")
    assert len(set(renders)) >= 3 and renders[-1] == reply != "", renders  # shown in pieces, to the end
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(renders)), renders
    assert page.is_hidden("#error")
    assert page.locator("#model option").first.inner_text() == "SmolLM2-135M-Instruct"

    # A second turn carries the first: the server receives every earlier message.
    page.fill("#input", "And one about the moon?")
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#send")
    sent = json.loads(request.value.post_data)["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[0]["content"] == "Write a short poem about the sea." and sent[1]["content"]
    page.wait_for_function(STATS_DONE, timeout=120_000)

    # Stop midway: the request is aborted and the server frees its pages.
    aborted = metric(server, ABORTED)
    page.fill("#max-tokens", "400")
    page.fill("#input", "Tell me a long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function(
        "document.querySelectorAll('.message.assistant .content').length === 3 && "
        "[...document.querySelectorAll('.message.assistant .content')].pop().textContent.length > 20",
        timeout=120_000,
    )
    page.click("#stop")
    page.wait_for_function("document.getElementById('stats').textContent.includes('stopped')", timeout=30_000)
    wait_until_aborted_and_idle(server, aborted)  # the engine ended it before its 400 tokens
    page.wait_for_function("document.getElementById('status').textContent.includes('running 0')", timeout=10_000)
    screenshot = tmp_path / "chat-page.png"
    page.screenshot(path=str(screenshot))
    if os.environ.get("CHAT_PAGE_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["CHAT_PAGE_SCREENSHOT"])
    assert screenshot.stat().st_size > 10_000

    # Kept in localStorage: the conversation survives a reload; model output is text, never HTML.
    hostile = "Try <script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\"> and\n```python\nprint('<b>hi</b>')\n```\n"
    page.evaluate(
        "text => localStorage.setItem('compiled_engine.chat', JSON.stringify([{role: 'assistant', content: text}]))",
        hostile,
    )
    page.reload()
    message = page.locator(".message.assistant .content").first
    assert "<script>window.pwned = 1</script>" in message.inner_text()
    assert page.evaluate("window.pwned") is None
    assert page.locator("#messages script, #messages img, #messages b").count() == 0
    assert page.locator(".code pre").inner_text() == "print('<b>hi</b>')\n"
    assert page.locator(".code .copy").count() == 1

    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    page.reload()
    assert page.locator(".message").count() == 0 and page.input_value("#api-key") == KEY  # the key is remembered
    # The only errors are the browser's notes on the expected 401s of the keyless tries.
    assert [p for p in problems if "401" not in p] == [], problems


def test_no_chat_page_turns_it_off(default_model_dir: Path, tmp_path: Path) -> None:
    """Also a server without the request log: a finished request leaves no line."""
    args = ["--kv-cache-memory-gib", "0.05", "--enforce-eager", "--no-chat-page", "--disable-log-requests"]
    with running_server(tmp_path, *args) as server:
        assert httpx.get(f"{server.url}/", timeout=10).status_code == 404
        assert httpx.get(f"{server.url}/chat/chat.js", timeout=10).status_code == 404
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert "request_id=" not in server.log_text()
