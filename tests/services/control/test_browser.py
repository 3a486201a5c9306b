"""The dashboard in a real headless Chromium (Debian's, driven by Playwright): upload a run config,
start the run from the page (refused until the token is entered), watch the loss curve grow over
the event stream, stop the run from the page and see it STOPPED with a checkpoint; the API docs
(/docs, /redoc) list the endpoints with no network but the control plane's own; screenshots are
saved as artifacts.

Run: ``./scripts/test.sh -m browser tests/services/control/test_browser.py`` (it installs
Playwright, the ``browser`` extra; needs ``apt-get install -y chromium``: Playwright's own browser
downloads are never used). Screenshots go to ``$XTOKEN_BROWSER_ARTIFACTS`` (default:
``screenshots/`` under the test's tmp dir)."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil

import pytest
import yaml

from tests.e2e.conftest import corpus_parts
from tests.services.control.conftest import ControlServer, tiny_config

pytestmark = [pytest.mark.browser, pytest.mark.timeout(480)]
logger = logging.getLogger(__name__)

TOKEN = "browser-test-token"
CHROMIUM = os.environ.get("XTOKEN_CHROMIUM", "/usr/bin/chromium")
# a name a careless page would turn into markup (and run: the onerror handler)
HOSTILE_NAME = '<img src=x onerror="document.body.dataset.pwned=1">tiny & <b>bold</b>'


@pytest.fixture
def chromium():
    """A headless Chromium (Debian's binary) under Playwright; skips when either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: ./scripts/test.sh -m browser installs it")
    path = shutil.which(CHROMIUM) or CHROMIUM
    if not os.access(path, os.X_OK):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set XTOKEN_CHROMIUM)"
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=path,
            headless=True,
            # root in a container: no user namespaces for the sandbox; /dev/shm may be small
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def artifacts(tmp_path) -> pathlib.Path:
    """Where the screenshots go: $XTOKEN_BROWSER_ARTIFACTS or <tmp>/screenshots."""
    out = pathlib.Path(os.environ.get("XTOKEN_BROWSER_ARTIFACTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _points(page, chart: str) -> int:
    return int(page.get_attribute(f"#{chart}", "data-points") or 0)


def test_a_run_started_from_the_page_shows_a_growing_loss_curve_and_stops_from_the_page(
    chromium, artifacts, demo, tmp_path
):
    server = ControlServer(tmp_path / "server", token=TOKEN)
    page = None
    problems: list[str] = []
    try:
        (train,), _ = corpus_parts(demo, server.data_root / "c", n=64, parts=1)
        (heldout,), _ = corpus_parts(demo, server.data_root / "h", n=4, parts=1, start=64)
        config = tiny_config(
            **{
                "data.train": "c/part0.jsonl",
                "data.heldout": "h/part0.jsonl",
                # far more steps than the test waits for: it is stopped
                "trainer.schedule.epochs": 50,
                "trainer.schedule.eval_every": 2,
                "trainer.eval.texts": 2,
            }
        )
        config_file = tmp_path / "run.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))

        page = chromium.new_page(viewport={"width": 1500, "height": 1300})

        def on_console(m) -> None:  # the refused start is expected: Chromium logs its 401
            if m.type == "error" and "status of 401" not in m.text:
                problems.append(f"console: {m.text}")

        page.on("console", on_console)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        assert "runs, 0 active" in page.text_content("#health")

        # the config from a file, the name typed; without the token the start is refused
        page.set_input_files("#start-file", str(config_file))
        page.wait_for_function(
            "() => document.querySelector('#start-config').value.includes('student_tokenizer')"
        )
        page.fill("#start-name", HOSTILE_NAME)
        page.click("#start-button")
        page.wait_for_selector(".message.error", timeout=30_000)
        message = page.text_content("#message")
        assert "401" in message and "XTOKEN_CONTROL_TOKEN" in message, message
        with server.client() as c:
            assert c.get("/v1/runs").json()["runs"] == []

        page.fill("#token-input", TOKEN)
        page.click("#token-save")
        assert page.text_content("#token-status") == "token set (this tab)"
        assert page.input_value("#token-input") == ""  # not left on display
        assert TOKEN not in page.url
        page.click("#start-button")
        page.wait_for_function(
            "() => document.querySelector('#run-id').textContent", timeout=30_000
        )
        run_id = page.text_content("#run-id")
        assert page.text_content("#message") == f"started run {run_id} ({HOSTILE_NAME})"

        # the hostile name is shown as text: no element made of it, no handler run
        page.wait_for_selector(f"#runs tr[data-run-id='{run_id}']", timeout=10_000)
        assert (
            page.text_content(f"#runs tr[data-run-id='{run_id}'] td:nth-child(3)") == HOSTILE_NAME
        )
        assert page.locator("#runs img, #runs b, #run-panel img").count() == 0
        assert page.get_attribute("body", "data-pwned") is None

        # the live curve: >= 2 points, then more
        page.wait_for_function(
            "() => +document.querySelector('#chart-loss').dataset.points >= 2", timeout=300_000
        )
        first = _points(page, "chart-loss")
        page.screenshot(path=str(artifacts / "1-first-steps.png"), full_page=True)
        page.wait_for_function(
            f"() => +document.querySelector('#chart-loss').dataset.points > {first}",
            timeout=120_000,
        )
        assert page.get_attribute("#run-state", "data-state") == "RUNNING"
        assert _points(page, "chart-tps") == _points(page, "chart-times") >= 2
        page.wait_for_function(  # the queue is asked every 2 s, the held-out eval every 2 steps
            "() => +document.querySelector('#chart-queue').dataset.points >= 1"
            " && +document.querySelector('#chart-bpb').dataset.points >= 2",
            timeout=60_000,
        )
        for fact in (
            "#fact-step",
            "#fact-loss",
            "#fact-tps",
            "#fact-step-s",
            "#fact-queue",
            "#fact-bpb",
        ):
            assert page.text_content(fact) not in ("", "-"), fact
        assert "samples" in page.text_content("#fact-queue")
        assert page.locator("#split span").count() >= 3  # the latest step's phases
        page.wait_for_selector("#processes tr[data-process='trainer0'] .proc-running")
        roles = page.locator("#processes tbody td:nth-child(2)").all_text_contents()
        assert sorted(roles) == ["collator", "queue", "teacher", "trainer"]
        pids = page.locator("#processes tbody td:nth-child(4)").all_text_contents()
        assert all(p.isdigit() for p in pids), pids
        page.screenshot(path=str(artifacts / "2-running.png"), full_page=True)
        grown = _points(page, "chart-loss")
        assert grown > first

        # stop from the page: STOPPING, then STOPPED with a checkpoint
        page.click("#stop-button")
        page.wait_for_selector("#run-state[data-state='STOPPED']", timeout=240_000)
        page.wait_for_function(
            "() => document.querySelector('#fact-checkpoint').textContent.startsWith('step ')",
            timeout=10_000,
        )
        assert page.is_disabled("#stop-button") and page.is_enabled("#resume-button")
        events = page.locator("#events li").all_text_contents()
        assert any("STOPPING" in e for e in events) and any("STOPPED" in e for e in events)
        with server.client() as c:
            run = c.get(f"/v1/runs/{run_id}").json()
        assert run["state"] == "STOPPED" and run["checkpoint"] is not None, run
        # the curve reaches the step the stop checkpointed
        page.wait_for_function(
            f"() => document.querySelector('#fact-step').textContent === '{run['checkpoint']['step']}'",
            timeout=10_000,
        )
        assert run["name"] == HOSTILE_NAME
        page.wait_for_selector(f"#runs tr[data-run-id='{run_id}'] [data-state='STOPPED']")
        page.wait_for_function(  # the table after the stop: every process ended
            "() => [...document.querySelectorAll('#processes tbody tr td:nth-child(6)')]"
            ".every(td => td.textContent !== 'running')",
            timeout=15_000,
        )
        page.screenshot(path=str(artifacts / "3-stopped.png"), full_page=True)
        assert _points(page, "chart-loss") >= grown
        assert not problems, problems
    except BaseException:
        if page is not None:
            page.screenshot(path=str(artifacts / "failure.png"), full_page=True)
        logger.error("control plane log:\n%s\nbrowser: %s", server.tail(80), problems)
        raise
    finally:
        server.stop()
        logger.info("screenshots in %s", artifacts)


def test_the_api_docs_list_the_endpoints_without_network(chromium, artifacts, tmp_path):
    server = ControlServer(tmp_path / "server")
    outside: list[str] = []
    problems: list[str] = []
    blocked: list[str] = []  # ReDoc's footer asks cdn.redoc.ly for a logo
    try:
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})

        def only_this_server(route) -> None:  # no network but the control plane's own
            if route.request.url.startswith(server.url + "/"):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", only_this_server)
        page = context.new_page()
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        def on_console(m) -> None:  # a load the page's policy refused made no request
            if m.type == "error":
                csp = "Content Security Policy" in m.text
                (blocked if csp else problems).append(m.text)

        page.on("console", on_console)
        page.goto(server.url + "/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=30_000)
        paths = page.eval_on_selector_all(
            ".opblock-summary-path", "nodes => nodes.map(n => n.textContent.trim())"
        )
        assert "/v1/runs" in paths and "/v1/runs/{run_id}/stop" in paths, paths
        page.screenshot(path=str(artifacts / "docs-offline.png"), full_page=False)

        page.goto(server.url + "/redoc")
        page.wait_for_function(
            "() => document.body.innerText.includes('/v1/runs/{run_id}/stop')", timeout=30_000
        )
        page.screenshot(path=str(artifacts / "redoc-offline.png"), full_page=False)
        context.close()
        assert not outside, f"the docs asked the network for {outside}"
        assert not problems, problems
        assert all(server.url not in text for text in blocked), blocked  # only outside loads
    finally:
        server.stop()


def test_two_finished_runs_compared_side_by_side_with_memory_and_events_as_sentences(
    chromium, artifacts, tmp_path
):
    """Two finished runs (their metrics files as the trainer writes them, their events and one
    run's queue depth as the control plane records them): ticked in the list, their curves are
    overlaid on each x axis, smoothing redraws them, the config diff names the key that differs;
    one run opened shows its memory curve, its recorded queue depth (the other: "no queue
    samples"), its events as sentences, and a KD line per teacher (it has two; the other
    run, of one teacher, none)."""
    from services.supervise.events import Exited, Recovering, Restarted
    from tests.services.control.finished_runs import write_finished_run

    runs_root = tmp_path / "server" / "runs"
    crash = Exited(process="trainer0", role="trainer", code=137)
    recovering = Recovering(
        process="trainer0",
        scope="group",
        attempt=2,
        delay_s=2.0,
        reason="trainer0 exited with code 137: restart 2 of 3 (group) in 2.0s",
        code=137,
        max_restarts=3,
    )
    restarted = Restarted(process="trainer0", scope="group", attempt=2, code=137, max_restarts=3)
    start = 1_700_000_000.0
    a = write_finished_run(
        runs_root,
        name="lr-3e-3",
        steps=30,
        start=start,
        evals=(0, 10, 20, 30),
        events=tuple((e.kind, e.data()) for e in (crash, recovering, restarted)),
        queue_samples=20,
        on_policy=True,
        teachers=2,
    )
    b = write_finished_run(
        runs_root,
        name="lr-1e-3",
        steps=24,
        start=start + 500,
        config=tiny_config(**{"trainer.optim.lr": 0.001}),
        loss0=21.0,
        memory_mb=1400.0,
        tokens=512.0,
        evals=(0, 12, 24),
    )
    server = ControlServer(tmp_path / "server")
    problems: list[str] = []
    try:
        page = chromium.new_page(viewport={"width": 1500, "height": 1400})
        page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        assert page.is_hidden("#compare-panel")

        # tick both: the panel overlays one series per run on every chart
        page.check(f"#runs tr[data-run-id='{a}'] input.compare-pick")
        assert page.is_hidden("#compare-panel")  # one run: nothing to compare yet
        assert page.is_hidden("#run-panel")  # ticking is not opening
        page.check(f"#runs tr[data-run-id='{b}'] input.compare-pick")
        page.wait_for_selector("#compare-panel[data-runs='2']", timeout=15_000)
        for chart in ("cmp-loss", "cmp-kd", "cmp-ce", "cmp-bpb", "cmp-tps", "cmp-memory"):
            assert page.get_attribute(f"#{chart}", "data-series") == "2", chart
        assert _points(page, "cmp-loss") == 30 + 24 and _points(page, "cmp-bpb") == 4 + 3
        legend = page.locator("#cmp-loss .u-legend .u-series").all_text_contents()
        assert any(f"lr-3e-3 ({a})" in s for s in legend) and any(
            f"lr-1e-3 ({b})" in s for s in legend
        )
        assert page.locator("#cmp-loss canvas").count() == 1

        # the config diff: only the learning rate differs (run_dir aside)
        assert page.locator("#config-diff tbody tr").all_text_contents() == [
            "trainer.optim.lr0.0030.001"
        ]
        assert page.text_content("#config-diff thead").count("lr-") == 2
        page.screenshot(path=str(artifacts / "compare-steps.png"), full_page=True)

        # the x axis switch and smoothing redraw the same series
        for axis in ("tokens", "time"):
            page.check(f"input[name='compare-x'][value='{axis}']")
            page.wait_for_function(
                "() => document.querySelector('#cmp-loss .u-legend .u-series th').textContent"
                f".includes('{ {'tokens': 'tokens', 'time': 'wall time'}[axis] }')"
            )
            assert page.get_attribute("#cmp-loss", "data-series") == "2"
            assert _points(page, "cmp-loss") == 30 + 24
        page.fill("#compare-smooth", "0.9")
        page.dispatch_event("#compare-smooth", "input")
        assert page.text_content("#compare-smooth-value") == "0.90"
        page.screenshot(path=str(artifacts / "compare-time-smoothed.png"), full_page=True)

        # one run opened: memory curve, recorded queue depth, events as sentences
        page.click(f"#runs tr[data-run-id='{a}'] td:nth-child(3)")
        page.wait_for_function(
            "() => +document.querySelector('#chart-memory').dataset.points === 30", timeout=15_000
        )
        assert page.text_content("#fact-memory") == "1.2 GiB"  # 900 + 10 * 30 MiB
        assert page.is_visible("#chart-on-policy") and _points(page, "chart-on-policy") == 30
        assert page.text_content("#fact-on-policy") == "2 / 1.50 / 3"  # samples, staleness, drops
        assert page.get_attribute("#chart-loss", "data-teachers") == "2"
        legend = page.locator("#chart-loss .u-legend .u-series").all_text_contents()
        assert any("teacher 0" in s for s in legend) and any("teacher 1" in s for s in legend)
        assert _points(page, "chart-loss") == 30
        page.wait_for_function(
            "() => +document.querySelector('#chart-queue').dataset.points === 20", timeout=15_000
        )
        assert page.is_hidden("#queue-empty")
        page.wait_for_selector("#events li[data-kind='restarted']", timeout=15_000)
        events = page.locator("#events li").all_text_contents()
        sentences = page.eval_on_selector_all(  # each line: its clock, then its sentence
            "#events li", "items => items.map(li => li.lastChild.textContent)"
        )
        assert "trainer0 restarted after exit 137, with every trainer rank (attempt 2 of 3)" in (
            sentences
        ), sentences
        assert "trainer0 (trainer) exited with code 137" in sentences
        assert (
            "trainer0 exited with code 137; every trainer rank restarts in 2 s (attempt 2 of 3)"
            in sentences
        )
        assert not [e for e in events if "{" in e], events  # no JSON
        page.screenshot(path=str(artifacts / "run-memory-events.png"), full_page=True)

        # the other run recorded no queue depth: said so, no empty time axis
        page.click(f"#runs tr[data-run-id='{b}'] td:nth-child(3)")
        page.wait_for_selector("#chart-queue[data-empty='1']", timeout=15_000)
        assert page.is_visible("#queue-empty") and page.is_hidden("#chart-queue .plot")
        assert "No queue samples" in page.text_content("#queue-empty")
        page.wait_for_function(  # the steps arrive after the queue history: wait for them
            "() => +document.querySelector('#chart-memory').dataset.points === 24", timeout=15_000
        )
        assert page.is_hidden("#chart-on-policy") and page.is_hidden("#fact-on-policy-box")
        assert page.get_attribute("#chart-loss", "data-teachers") == "0"
        legend = page.locator("#chart-loss .u-legend .u-series").all_text_contents()
        assert not any("teacher" in s for s in legend), legend
        page.screenshot(path=str(artifacts / "run-no-queue-samples.png"), full_page=True)

        # "updated" of a finished run is its last step, long ago, not the state change just now
        updated = page.text_content(f"#runs tr[data-run-id='{a}'] td:nth-child(6)")
        assert "ago" not in updated, updated

        page.click("#compare-clear")
        assert page.is_hidden("#compare-panel")
        assert not page.is_checked(f"#runs tr[data-run-id='{a}'] input.compare-pick")
        assert not problems, problems
    finally:
        server.stop()
