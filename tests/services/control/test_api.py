"""REST contract of `xtoken control serve`, a real uvicorn server in a subprocess, called with httpx:
bad configs, paths, bodies and tokens are refused with clear errors and the server goes on; a tiny
run reaches SUCCEEDED with its metrics, events (SSE) and logs."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import CHILD_ENV, ROOT, corpus_parts, free_port, wait_for
from tests.services.control.conftest import ControlServer, tiny_config, wait_state

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """One server with a token for the module's contract tests."""
    s = ControlServer(tmp_path_factory.mktemp("control"), token=TOKEN)
    yield s
    s.stop()


def test_healthz_and_openapi_docs_answer_in_milliseconds(api):
    with api.client() as c:
        assert c.get("/healthz").json()["status"] == "ok"
        times = []
        for _ in range(20):  # a response in two writes must not wait for a delayed ACK (40 ms)
            t = time.perf_counter()
            c.get("/healthz")
            times.append(time.perf_counter() - t)
        assert sorted(times)[10] < 0.02, times
        spec = c.get("/openapi.json").json()
        assert "/v1/runs/{run_id}/stop" in spec["paths"]
        assert c.get("/docs").status_code == 200


@pytest.mark.parametrize(
    ("body", "ctype", "key", "pattern"),
    [
        (
            "trainer:\n  optim:\n    lrr: 0.1\n",
            "application/yaml",
            "trainer.optim.lrr",
            "did you mean 'trainer.optim.lr'",
        ),
        (json.dumps({"trainers": "2"}), "application/json", "trainers", "expected int"),
        (
            json.dumps({"teachers": 3, "trainers": 2}),
            "application/json",
            "teachers",
            "teachers would idle",
        ),
        ("trainer: [1, 2\n", "application/yaml", None, "not valid YAML"),
        ('{"trainers": 1,}', "application/json", None, "not valid JSON"),
        ("", "application/json", None, "body is empty"),
        ("[1, 2]", "application/json", None, "a mapping"),
        (
            json.dumps({"data": {"train": "missing.jsonl"}}),
            "application/json",
            "data.train",
            "is not a file",
        ),
        (
            json.dumps(
                {"extra_teachers": [{"tokenizer": "qwen3", "model": "tiny", "projection": "p.pt"}]}
            ),
            "application/json",
            "extra_teachers[0].projection",
            "is not a file",
        ),
    ],
    ids=[
        "unknown-key-yaml",
        "wrong-type",
        "impossible",
        "bad-yaml",
        "bad-json",
        "empty",
        "not-a-mapping",
        "missing-file",
        "missing-projection-of-a-further-teacher",
    ],
)
def test_a_malformed_config_gets_422_naming_the_key_and_the_fix(api, body, ctype, key, pattern):
    with api.client() as c:
        r = c.post("/v1/runs", content=body, headers={"content-type": ctype})
        assert r.status_code == 422, r.text
        assert pattern in r.json()["error"]
        assert r.json().get("key") == key
        assert c.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"data": {"train": "/etc/passwd"}}, "data.train"),
        ({"data": {"train": "../../../etc/passwd"}}, "data.train"),
        ({"run_dir": "/tmp/elsewhere"}, "run_dir"),
        ({"run_dir": "../escape"}, "run_dir"),
        ({"trainer": {"student": {"model": "/usr/lib"}}}, "trainer.student.model"),
        ({"trainer": {"loss": {"projection": "/root/x.pt"}}}, "trainer.loss.projection"),
        ({"student_tokenizer": "/etc/tokenizer.json"}, "student_tokenizer"),
        ({"trainer": {"run_dir": "x"}}, "trainer.run_dir"),
        (
            {"extra_teachers": [{"tokenizer": "qwen3", "model": "/usr/lib"}]},
            "extra_teachers[0].model",
        ),
        (
            {"extra_teachers": [{"tokenizer": "/etc/tok.json", "model": "tiny"}]},
            "extra_teachers[0].tokenizer",
        ),
        (
            {
                "extra_teachers": [
                    {"tokenizer": "qwen3", "model": "tiny", "projection": "/root/p.pt"}
                ]
            },
            "extra_teachers[0].projection",
        ),
        (
            {"extra_teachers": [{"tokenizer": "qwen3", "model": "tiny", "queue": "tcp://h:1"}]},
            "extra_teachers[0].queue",
        ),
    ],
    ids=[
        "absolute-data",
        "dotdot-data",
        "run-dir-abs",
        "run-dir-dotdot",
        "model-dir",
        "projection",
        "tokenizer-file",
        "run-owned",
        "extra-teacher-model",
        "extra-teacher-tokenizer",
        "extra-teacher-projection",
        "extra-teacher-run-owned",
    ],
)
def test_a_path_outside_the_roots_gets_403_naming_the_key(api, config, key):
    with api.client() as c:
        r = c.post("/v1/runs", json=config)
    assert r.status_code == 403, r.text
    assert r.json()["key"] == key
    assert "root" in r.json()["error"] or "control plane" in r.json()["error"]


def test_an_oversize_body_gets_413_and_the_server_goes_on(api):
    big = json.dumps({"data": {"text_field": "x" * (2 << 20)}})
    with api.client() as c:
        r = c.post("/v1/runs", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert "XTOKEN_CONTROL_MAX_BODY_BYTES" in r.json()["error"]

        def chunks():  # no Content-Length: refused as the stream passes the limit
            for _ in range(40):
                yield b" " * 65536

        r = c.post("/v1/runs", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.get("/healthz").status_code == 200


def test_mutating_calls_without_the_token_are_refused_and_reads_are_open(api):
    with api.client(token=None) as anon, api.client(token="wrong") as wrong:
        for c in (anon, wrong):
            r = c.post("/v1/runs", json=tiny_config())
            assert r.status_code == 401
            assert "Bearer" in r.json()["error"]
            assert c.post("/v1/runs/abc/stop").status_code == 401
            assert c.post("/v1/runs/abc/resume").status_code == 401
        assert anon.get("/v1/runs").status_code == 200
        assert not [r for r in anon.get("/v1/runs").json()["runs"] if r["config"] is not None]


def test_a_mutating_call_from_a_page_of_another_origin_is_refused(api):
    """CSRF: any page the user opens could POST to the control plane through the browser."""
    with api.client() as c:
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
        ):
            r = c.post("/v1/runs", json=tiny_config(), headers=headers)
            assert r.status_code == 403 and "another origin" in r.json()["error"], r.text
            assert c.post("/v1/runs/abc/stop", headers=headers).status_code == 403
        # the dashboard's own calls are same-origin; reads stay open
        assert c.post("/v1/runs/abc/stop", headers={"Origin": api.url}).status_code == 404
        assert c.get("/v1/runs", headers={"Origin": "http://evil.example"}).status_code == 200


def test_without_a_token_changes_need_a_loopback_host(server):
    """DNS rebinding: a page of rebound.example resolved to 127.0.0.1 is same-origin to itself."""
    with server.client() as c:
        r = c.post("/v1/runs/abc/stop", headers={"Host": "rebound.example:8000"})
        assert r.status_code == 403 and "XTOKEN_CONTROL_TOKEN" in r.json()["error"]
        assert c.post("/v1/runs/abc/stop", headers={"Host": "localhost:8000"}).status_code == 404


def test_unknown_runs_and_processes_get_clear_errors(api):
    with api.client() as c:
        r = c.get("/v1/runs/nope")
        assert r.status_code == 404 and "GET /v1/runs" in r.json()["error"]
        assert c.post("/v1/runs/nope/stop").status_code == 404
        assert c.get("/v1/runs/nope/events").status_code == 404
        r = c.post("/v1/runs/nope/stop", json={"grace_s": -1})
        assert r.status_code == 422 and "grace_s" in r.json()["error"]


def test_a_non_loopback_bind_without_a_token_is_refused(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "control",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
            "--runs-root",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, **CHILD_ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "refusing to bind '0.0.0.0' without a token" in r.stderr
    assert "XTOKEN_CONTROL_TOKEN" in r.stderr


def test_a_bad_setting_from_the_environment_names_its_flag_and_variable(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "control", "serve", "--runs-root", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, **CHILD_ENV, "XTOKEN_CONTROL_MAX_BODY_BYTES": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--max-body-bytes (XTOKEN_CONTROL_MAX_BODY_BYTES): Input should be greater" in r.stderr


def _collect_sse(url: str, headers: dict, out: list, stop: threading.Event) -> None:
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=60)) as c,
        c.stream("GET", url, headers=headers) as r,
    ):
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                out.append((time.time(), kind, json.loads(line[6:])))
                if kind == "state" and out[-1][2]["data"]["state"] in ("SUCCEEDED", "FAILED"):
                    return
            if stop.is_set():
                return


@pytest.mark.timeout(240)
def test_a_tiny_run_succeeds_with_metrics_events_and_logs(api, demo):
    (corpus,), keys = corpus_parts(demo, api.data_root / "tiny", n=16, parts=1)
    config = tiny_config(**{"data.train": "tiny/part0.jsonl", "run_dir": "tiny-run"})
    with api.client() as c:
        r = c.post("/v1/runs?name=tiny", json=config)
        assert r.status_code == 201, r.text
        run = r.json()
        assert run["name"] == "tiny" and run["state"] in ("PENDING", "STARTING")
        assert run["run_dir"] == str((api.runs_root / "tiny-run").resolve())
        assert run["config"]["data"]["train"] == str(corpus.resolve())
        rid = run["id"]

        def queue_pid() -> int | None:
            procs = c.get(f"/v1/runs/{rid}/processes").json()["processes"]
            return next((p["pid"] for p in procs if p["name"] == "queue" and p["pid"]), None)

        # the run's processes do not inherit the control plane's token
        environ = pathlib.Path(f"/proc/{wait_for(queue_pid, 60, 'its queue')}/environ")
        assert b"XTOKEN_CONTROL_TOKEN=" not in environ.read_bytes()
        # a second run into the same run directory is refused while the first is active
        r = c.post("/v1/runs", json=config)
        assert r.status_code == 409 and "tiny-run" in r.json()["error"]

        events: list = []
        stop = threading.Event()
        t = threading.Thread(
            target=_collect_sse, args=(f"{api.url}/v1/runs/{rid}/events", {}, events, stop)
        )
        t.start()
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 180)
        t.join(30)
        stop.set()
        assert done["state"] == "SUCCEEDED", done
        assert done["step"] == 4 and done["checkpoint"]["step"] == 4
        assert done["latest_metrics"]["loss"] > 0

        kinds = [k for _, k, _ in events]
        states = [e["data"]["state"] for _, k, e in events if k == "state"]
        assert states[:1] == ["PENDING"] and states[-1] == "SUCCEEDED"
        assert "RUNNING" in states and "data_complete" in kinds
        steps = [
            e["data"]["step"]
            for _, k, e in events
            if k == "metrics" and e["data"]["kind"] == "step"
        ]
        assert steps == [1, 2, 3, 4]

        series = c.get(f"/v1/runs/{rid}/metrics").json()
        assert [s["step"] for s in series["steps"]] == [1, 2, 3, 4]
        assert set(series["steps"][0]["times"]) >= {"data_wait", "forward", "backward"}
        assert [
            s["step"] for s in c.get(f"/v1/runs/{rid}/metrics?after_step=2").json()["steps"]
        ] == [3, 4]

        q = c.get(f"/v1/runs/{rid}/queue").json()  # its last figures, asked every 2 s
        assert q["address"] == done["queue"] and q["updated"] > done["created"]
        assert q["stats"]["capacity_bytes"] > 0 and "partitions" in q["stats"]
        history = c.get(f"/v1/runs/{rid}/queue/history").json()["points"]
        assert history and history[-1][0] == q["updated"]  # every figure asked, kept

        # "updated" is its last step; every recorded event came with its sentence
        assert done["updated"] == done["latest_metrics"]["time"] < done["state_changed"]
        recorded = [e for _, k, e in events if k != "metrics"]
        assert recorded and all(e["text"] for e in recorded), recorded
        assert "run SUCCEEDED: every trainer rank finished" in [e["text"] for e in recorded]
        compared = c.get("/v1/compare", params={"run": rid}).json()["runs"][0]["steps"]
        assert compared["step"] == [1, 2, 3, 4] and compared["tokens_seen"][-1] > 0

        procs = c.get(f"/v1/runs/{rid}/processes").json()["processes"]
        assert {p["name"] for p in procs} == {"queue", "collator", "teacher0", "trainer0"}
        assert all(p["pid"] and p["state"] == "exited" for p in procs), procs
        assert {p["name"]: p["exit_code"] for p in procs}["trainer0"] == 0

        log = c.get(f"/v1/runs/{rid}/logs", params={"process": "trainer0", "lines": 1000})
        assert log.status_code == 200 and "[trainer] step 4 loss" in log.text
        r = c.get(f"/v1/runs/{rid}/logs", params={"process": "../../etc/passwd"})
        assert r.status_code == 422 and "trainer0" in r.json()["error"]

        text = c.get("/metrics").text
        assert f'xtoken_steps_total{{run="{rid}"}} 4' in text
        assert f'xtoken_step_seconds{{run="{rid}",phase="forward"}}' in text
        assert f'xtoken_loss{{run="{rid}",part="kd"}}' in text
        assert 'xtoken_runs{state="SUCCEEDED"}' in text
        for who in ('role="trainer"', 'role="teacher",teacher="0"'):  # from each metrics file
            assert (
                f'xtoken_process_memory_bytes{{run="{rid}",{who},rank="0",memory="host"}}' in text
            ), text

        r = c.post(f"/v1/runs/{rid}/stop")
        assert r.status_code == 409 and "SUCCEEDED" in r.json()["error"]
        r = c.post(f"/v1/runs/{rid}/resume")
        assert r.status_code == 409


def test_sigterm_ends_the_server_promptly_even_with_an_open_event_stream(server):
    with server.client() as c:
        run = c.post("/v1/runs", json=tiny_config(**{"trainer.schedule.max_steps": 1}))
        assert run.status_code == 201, run.text
        rid = run.json()["id"]
        with (
            httpx.Client(timeout=httpx.Timeout(5, read=30)) as s,
            s.stream("GET", f"{server.url}/v1/runs/{rid}/events") as r,
        ):
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            t = time.monotonic()
            server.popen.send_signal(signal.SIGTERM)
            assert server.popen.wait(20) == 0
            assert time.monotonic() - t < 10
    assert "Shutting down" in server.log_path.read_text()
