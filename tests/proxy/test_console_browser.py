"""The operator console in a real browser (issue 27): headless Chromium (Debian's `chromium`,
driven by the `playwright` package; nothing downloads a browser) against stepguard in this
process, its admin app with the console on a loopback port, the agent a real HTTP client of
its proxy whose held call waits while the browser decides it.

Marked `browser`: each test starts Chromium (a few seconds), so the module is bounded in count
and time (`-m "not browser"` leaves it out). The first three also write the screenshots that
docs/console.md shows (docs/img/console-*.png)."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from consoletest import (
    OPERATOR_SECRET,
    PLANTED,
    VIEWER_SECRET,
    Console,
    doc,
    steps,
)

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "img"
WAIT_MS = 15_000

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]


def _need_chromium() -> None:
    if Path(CHROMIUM).exists():
        return
    reason = f"no {CHROMIUM}: apt-get install chromium (deploy/install-test-deps.sh)"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason}; CI is set, so this test may not be skipped")
    pytest.skip(reason)


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    _need_chromium()
    from playwright.async_api import async_playwright

    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        context = await browser.new_context(viewport={"width": 1280, "height": 800})
        context.set_default_timeout(WAIT_MS)
        made = await context.new_page()
        try:
            yield made
        finally:
            await browser.close()


async def sign_in(page: Any, c: Console, secret: str = OPERATOR_SECRET,
                  where: str = "runs") -> None:
    await page.goto(c.url + where)
    await page.wait_for_url("**/ui/signin**")
    await page.fill("#token", secret)
    await page.click("#signin")
    await page.wait_for_url(f"**/ui/{where}")


async def listening(page: Any) -> None:
    """Wait until the live feed's EventSource is open. A locator, not `wait_for_function`: a
    string predicate is re-evaluated with `eval`, which the console's CSP refuses."""
    await page.locator("#feed-state", has_text=re.compile(r"^Listening")).wait_for()


def shot(name: str) -> str:
    SHOTS.mkdir(parents=True, exist_ok=True)
    return str(SHOTS / f"console-{name}.png")


async def test_signing_in_with_an_operator_token_opens_the_runs_list(page, console):
    c = await console()
    await sign_in(page, c)
    assert "alice (operator)" in await page.inner_text("header")
    assert await page.locator("#runs").is_visible()


async def test_a_halted_run_is_found_by_filter_and_its_failed_boundary_is_highlighted(
        page, console):
    c = await console()
    for run in ("order-1041", "order-1042", "order-1043"):
        assert (await c.call("lookup", {"ticket": run}, run=run)).status == 200
    assert (await c.call("audit", {"ok": False}, run="order-1042")).status == 422
    assert (await c.call("audit", {"ok": True}, run="order-1043")).status == 200
    await sign_in(page, c)
    await page.select_option("#f-status", "halted")
    await page.click("#f-apply")
    await page.wait_for_url("**status=halted**")
    rows = page.locator("#runs tbody tr")
    assert await rows.count() == 1
    assert "order-1042" in await rows.first.inner_text()
    await page.screenshot(path=shot("runs"), full_page=True)
    await page.click("text=order-1042")
    await page.wait_for_url("**/ui/runs/order-1042")
    first = page.locator("li.first-failure")
    assert await first.count() == 1
    text = await first.inner_text()
    assert "audit" in text and "first failed boundary" in text
    assert "input.ok == true" in text and "the audit must be ok" in text
    # highlighted: its own border and background, unlike the events that passed
    colour = await first.evaluate("e => getComputedStyle(e).backgroundColor")
    other = await page.locator("li.event:not(.first-failure)").first.evaluate(
        "e => getComputedStyle(e).backgroundColor")
    assert colour != other
    await page.screenshot(path=shot("run"), full_page=True)


async def test_approving_a_held_call_lets_the_agents_waiting_request_complete(page, console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    waiting = c.calling("refund", {"ticket": "T-1", "amount": 120, "currency": "EUR"})
    hold = await c.held()
    await sign_in(page, c, where="holds")
    row = page.locator(f'tr[data-decision="{hold["decision_id"]}"]')
    assert hold["digest"] in await row.inner_text()
    assert '"amount": 120' in await row.inner_text()
    await page.screenshot(path=shot("holds"), full_page=True)
    assert not waiting.done()
    approve = row.locator("form:has(button.approve)")
    await approve.locator('input[name="reason"]').fill("ticket checked with the customer")
    await approve.locator("button").click()
    await page.wait_for_url("**/ui/holds?done=approved")
    reply = await waiting
    assert reply.status == 200
    assert c.tools.hits("/refund") == 1
    approved = [e for e in await c.sg.store.history("r1") if e.get("action") == "approve"]
    assert [(e["operator"], e["reason"]) for e in approved] == [
        ("alice", "ticket checked with the customer")]


async def test_rejecting_a_held_call_gives_the_agent_the_refusal(page, console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    waiting = c.calling("refund", {"ticket": "T-1", "amount": 9000})
    hold = await c.held()
    await sign_in(page, c, where="holds")
    reject = page.locator(f'tr[data-decision="{hold["decision_id"]}"] '
                          "form:has(button.reject)")
    await reject.locator('input[name="reason"]').fill("far too large")
    await reject.locator("button").click()
    await page.wait_for_url("**/ui/holds?done=rejected")
    reply = await waiting
    assert reply.status == 403
    assert reply.json["title"] == "Hold rejected"
    assert c.tools.hits("/refund") == 0


async def test_a_hold_decided_elsewhere_is_marked_on_the_open_holds_page(page, console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    waiting = c.calling("refund", {"ticket": "T-1", "amount": 5})
    hold = await c.held()
    await sign_in(page, c, where="holds")
    decided = await c.admin.post("/runs/r1/reject", json={
        "decision_id": hold["decision_id"], "reason": "from the CLI"},
        headers={"Authorization": f"Bearer {OPERATOR_SECRET}"})
    assert decided.status == 200
    assert (await waiting).status == 403
    row = page.locator(f'tr.hold.decided[data-decision="{hold["decision_id"]}"]')
    await row.wait_for()
    assert "decided elsewhere" in await row.inner_text()


async def test_a_violation_arrives_in_the_live_feed(page, console):
    c = await console()
    await sign_in(page, c, where="violations")
    await listening(page)
    assert await page.locator("#feed tbody tr").count() == 0
    assert (await c.call("audit", {"ok": False}, run="r-feed")).status == 422
    row = page.locator("#feed tbody tr", has_text="r-feed")
    await row.wait_for()
    text = await row.inner_text()
    assert "audit" in text and "precondition" in text and "halt" in text


async def test_a_replay_of_a_stricter_candidate_shows_the_runs_it_would_halt(
        page, console, console_tools):
    c = await console()
    for run, amount in (("small", 50), ("medium", 500), ("large", 5000)):
        assert (await c.call("charge", {"amount": amount}, run=run)).status == 200
    stricter = steps()
    stricter["charge"]["precondition"] = [{"expr": "input.amount < 100",
                                           "drift": "precondition",
                                           "message": "at most 99 without a review"}]
    candidate = doc(console_tools.url, steps=stricter, contract_version=2)
    await sign_in(page, c, where="replay")
    await page.fill("#contract", yaml.safe_dump(candidate, sort_keys=False))
    await page.fill("#since", "")
    await page.click("#run-replay")
    await page.locator("#summary").wait_for()
    assert "2 would now halt" in await page.inner_text("#summary")
    halts = await page.inner_text("#replay-halts")
    assert "medium" in halts and "large" in halts and "small" not in halts
    assert "at most 99 without a review" in halts


async def test_a_viewer_token_reads_and_cannot_act(page, console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    waiting = c.calling("refund", {"ticket": "T-1", "amount": 7})
    hold = await c.held()
    await sign_in(page, c, VIEWER_SECRET, where="holds")
    assert "victor (viewer)" in await page.inner_text("header")
    assert await page.locator("button.approve").count() == 0
    assert "operators decide" in await page.inner_text("#holds")
    await page.goto(c.url + "runs/r1")
    assert await page.locator("form#resume, form#cancel").count() == 0
    # a hand-made request with the viewer's session is refused all the same
    refused = await page.request.post(c.url + "runs/r1/approve", form={
        "decision_id": hold["decision_id"], "reason": "me too", "csrf": "guess"})
    assert refused.status == 403
    assert not waiting.done()
    assert (await c.sg.store.load("r1")).holds
    waiting.cancel()


async def test_an_action_without_the_csrf_token_is_refused(page, console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1"})
    await sign_in(page, c)
    await page.goto(c.url + "runs/r1")
    await page.evaluate("document.querySelector('#cancel input[name=csrf]').remove()")
    await page.fill('#cancel input[name="reason"]', "no token in this form")
    await page.click("#cancel button")
    await page.locator("#error").wait_for()
    assert "CSRF" in await page.inner_text("#error")
    assert (await c.sg.store.load("r1")).status == "active"


async def test_a_planted_secret_never_appears_in_any_page(page, console):
    c = await console()
    await c.call("lookup", {"ticket": "T-1", "password": PLANTED})
    waiting = c.calling("refund", {"ticket": "T-1", "amount": 3, "api_key": PLANTED})
    await c.held()
    await sign_in(page, c, where="violations")
    await listening(page)
    assert (await c.call("audit", {"ok": False, "token": PLANTED}, run="r2")).status == 422
    await page.locator("#feed tbody tr", has_text="r2").wait_for()
    pages = {"violations": await page.content()}
    for where in ("runs", "runs/r1", "runs/r2", "holds", "contracts", "replay"):
        await page.goto(c.url + where)
        pages[where] = await page.content()
    for where, html in pages.items():
        assert PLANTED not in html, where
        assert OPERATOR_SECRET not in html, where
    assert "[REDACTED]" in pages["runs/r1"] and "[REDACTED]" in pages["holds"]
    waiting.cancel()

