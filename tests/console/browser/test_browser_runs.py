"""The runs list and one run's page in Chromium (SPEC v2.2 §10b): live without a reload,
answers through the typed form with the CLI's refusals per field, the read-only rule, and a
node's HTML output shown as text."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page, expect

from tests.console.browser.conftest import Console, shot

ASK = """\
name: ask
entry: prep
nodes:
  prep:
    kind: compute
    set:
      ready: "'yes'"
  review:
    kind: human
    message: "How many, and may it ship?"
    questions:
      - name: count
        type: int
        description: how many copies
      - name: approved
        type: bool
  record:
    kind: compute
    set:
      total: outputs.review.count * 2
edges:
  - from: prep
    to: review
  - from: review
    to: record
"""

HTML_OUT = """\
name: htmlout
entry: shout
nodes:
  shout:
    kind: tool
    run: "printf '%s' '<script>window.__owned = 1</script><b id=\\"injected\\">bold</b>'"
"""


def paused_run(console: Console, page: Page) -> str:
    """Launch `ASK` and open its page; the page itself shows it pause (live)."""
    run_id = console.launch(ASK)
    page.goto(f"/ui/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("paused_waiting_human")
    return run_id


def test_browser_runs_page_shows_a_run_launched_after_it_loaded_without_a_reload(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    operator.goto("/ui/runs")
    expect(operator.locator("#counts")).to_be_visible()
    operator.evaluate("window.__loadedOnce = 'yes'")  # gone if the page reloads

    run_id = console.up.launch("examples/hello.yaml", "name=Ada")["run_id"]  # the CLI

    row = operator.locator(f'tr[data-run="{run_id}"]')
    expect(row).to_be_visible()
    expect(row.locator(".status")).to_have_text("finished")
    expect(operator.locator('#counts [data-status="finished"]')).to_be_visible()
    assert operator.evaluate("window.__loadedOnce") == "yes"
    shot(operator, tmp_path, "runs")

    operator.goto("/ui/runs?status=finished&workflow=hello")
    expect(operator.locator(f'tr[data-run="{run_id}"]')).to_be_visible()
    operator.goto("/ui/runs?status=queued&workflow=hello")
    expect(operator.locator(f'tr[data-run="{run_id}"]')).to_have_count(0)


def test_browser_answer_a_paused_run_in_the_form_and_see_it_finish(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    run_id = paused_run(console, operator)
    expect(operator.locator("#prompt")).to_have_text("How many, and may it ship?")
    shot(operator, tmp_path, "run-paused")

    operator.fill("#answer-count", "3")
    operator.select_option("#answer-approved", "yes")
    operator.click("#answer-form button[type=submit]")

    expect(operator.locator("#flash")).to_contain_text("answered: attempt 2 queued")
    expect(operator.locator("#run-status")).to_have_text("finished")
    expect(operator.locator('#timeline tr[data-type="run_finished"]')).to_have_count(1)
    expect(operator.locator('#outputs [data-node="record"]')).to_contain_text('"total": 6')
    shot(operator, tmp_path, "run-finished")
    assert console.run(run_id)["outputs"]["review"] == {"count": 3, "approved": True}


def test_browser_a_wrongly_typed_answer_shows_the_fields_error_as_the_cli_refuses_it(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    run_id = paused_run(console, operator)
    operator.fill("#answer-count", "many")
    operator.select_option("#answer-approved", "yes")
    operator.click("#answer-form button[type=submit]")

    cli = console.up.cli("resume", run_id, "--answer", "count=many", "--answer", "approved=yes")
    assert cli.returncode == 3, cli.stderr
    error = operator.locator("#error-count")
    # Beside its field, the error need not name the field again (every wrong answer gets its own).
    expect(error).to_contain_text("answers_invalid: expected an int, got str 'many'")
    expect(operator.locator("#error-approved")).to_have_count(0)
    expect(operator.locator("#answer-count")).to_have_value("many")  # kept to correct
    shown = error.inner_text()
    assert "answer 'count': expected an int, got str 'many'" in cli.stderr, cli.stderr
    assert "correct the named answer" in shown and "correct the named answer" in cli.stderr
    shot(operator, tmp_path, "run-answer-error")
    assert console.run(run_id)["status"] == "paused_waiting_human"


def test_browser_a_write_is_refused_without_the_token(
    visitor: Page, console: Console, tmp_path: Path
) -> None:
    run_id = paused_run(console, visitor)
    expect(visitor.locator("#read-only")).to_contain_text("log in with the operator token")
    cancel = visitor.locator("#cancel-form button")
    expect(cancel).to_be_disabled()

    cancel.evaluate("b => b.removeAttribute('disabled')")  # what a hand-made POST would do
    cancel.click()
    expect(visitor.locator("#problem")).to_contain_text("forbidden")
    shot(visitor, tmp_path, "refused")
    assert console.run(run_id)["status"] == "paused_waiting_human"


def test_browser_an_html_laden_output_is_rendered_as_text(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    run_id = console.launch(HTML_OUT)
    operator.goto(f"/ui/runs/{run_id}")
    output = operator.locator('#outputs [data-node="shout"] pre')
    expect(output).to_contain_text('<script>window.__owned = 1</script><b id="injected">bold</b>')
    expect(operator.locator("#injected")).to_have_count(0)
    assert operator.evaluate("window.__owned === undefined")
    shot(operator, tmp_path, "run-html-output")


def test_browser_cancel_resume_and_rewind_from_the_run_page(
    operator: Page, console: Console, tmp_path: Path
) -> None:
    run_id = paused_run(console, operator)
    status = operator.locator("#run-status")

    operator.click("#cancel-form button")
    expect(operator.locator("#flash")).to_contain_text("cancelled")
    expect(status).to_have_text("cancelled")

    operator.fill("#resume-form input[name=max_iterations]", "50")
    operator.click("#resume-form button[type=submit]")
    expect(operator.locator("#flash")).to_contain_text("resumed: attempt 2 queued")
    expect(status).to_have_text("paused_waiting_human")  # back at its question, live
    expect(operator.locator("#budget")).to_contain_text("/ 50")

    operator.reload()  # the page drawn while paused has the rewind form
    operator.select_option("#rewind-form select[name=node]", "prep")
    operator.click("#rewind-form button[type=submit]")
    expect(operator.locator("#flash")).to_contain_text("rewound to prep (dropped prep, review)")
    expect(status).to_have_text("paused_operator")
    shot(operator, tmp_path, "run-rewound")

    operator.click("#resume-form button[type=submit]")
    expect(status).to_have_text("paused_waiting_human")
    operator.fill("#answer-count", "1")
    operator.select_option("#answer-approved", "no")
    operator.click("#answer-form button[type=submit]")
    expect(status).to_have_text("finished")
    run = console.run(run_id)
    assert (run["attempt"], run["outputs"]["record"]) == (4, {"total": 2})


def test_browser_a_live_page_says_when_the_console_server_stops_answering(
    operator: Page, console: Console
) -> None:
    """A page whose server was gone kept saying "live" (an operator walkthrough): its live
    stream failing now shows a banner, which goes once the stream flows again."""
    gone = operator.locator("#server-gone")
    operator.route("**/ui/runs/live*", lambda route: route.abort())
    operator.goto("/ui/runs")
    expect(gone).to_be_visible(timeout=15_000)
    expect(gone).to_contain_text("not answering")
    operator.unroute("**/ui/runs/live*")
    expect(gone).to_be_hidden(timeout=30_000)  # the extension reconnects by itself
