"""Abuse of the control plane with a valid token: alias bombs and deep nesting are refused while
/healthz answers; run directories the database or another run record owns, process counts past
the caps (fifty submissions at once included) and values no process could use are refused with
4xx naming the setting, key or owner; reads answer only an allowed Host (or the token)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.common.config import ConfigError
from services.control.states import Conflict
from services.control.store import Store
from services.supervise.config import run_config_from_dict
from services.supervise.resume import FINGERPRINT_FILE
from tests.services.control.conftest import ControlServer, serve_app, tiny_config

TOKEN = "abuse-token"

# "billion laughs": 9 levels of 9 aliases, 9**9 strings once expanded
ALIAS_BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(
            f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        ),
    ]
)
# 6 levels of 8 aliases (48, under the alias limit): 8**6 = 262144 strings once expanded
WIDE_BOMB = "\n".join(
    [
        'a: &a ["x","x","x","x","x","x","x","x"]',
        *(f"{c}: &{c} [{','.join([f'*{p}'] * 8)}]" for p, c in zip("abcde", "bcdef", strict=True)),
    ]
)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """One server with a token for the module's tests."""
    s = ControlServer(tmp_path_factory.mktemp("control"), token=TOKEN)
    yield s
    s.stop()


@pytest.mark.parametrize(
    ("body", "ctype", "setting"),
    [
        (ALIAS_BOMB, "application/yaml", "XTOKEN_CONTROL_MAX_CONFIG_ALIASES"),
        (WIDE_BOMB, "application/yaml", "XTOKEN_CONTROL_MAX_CONFIG_NODES"),
        ("a: &a [*a]", "application/yaml", "XTOKEN_CONTROL_MAX_CONFIG_NODES"),
        ("[" * 1000 + "]" * 1000, "application/json", "XTOKEN_CONTROL_MAX_CONFIG_DEPTH"),
        ("[" * 1000 + "]" * 1000, "application/yaml", "XTOKEN_CONTROL_MAX_CONFIG_DEPTH"),
        ("a: " + "{x: " * 1000 + "1" + "}" * 1000, "", "XTOKEN_CONTROL_MAX_CONFIG_DEPTH"),
        (
            "".join("  " * i + f"k{i}:\n" for i in range(1000)),
            "application/yaml",
            "XTOKEN_CONTROL_MAX_CONFIG_DEPTH",
        ),
    ],
    ids=["billion-laughs", "wide-bomb", "self-alias", "deep-json", "deep-flow", "deep-guess",
         "deep-block"],
)
def test_a_bomb_is_refused_naming_its_limit_while_healthz_answers(api, body, ctype, setting):
    with api.client() as c, ThreadPoolExecutor(4) as pool:
        posts = [
            pool.submit(c.post, "/v1/runs", content=body, headers={"content-type": ctype})
            for _ in range(3)
        ]
        health = pool.submit(c.get, "/healthz")
        assert health.result().status_code == 200
        for post in posts:
            r = post.result()
            assert r.status_code == 422, r.text
            assert setting in r.json()["error"]
        assert c.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("body", "key", "pattern"),
    [
        ('{"queue": {"capacity_bytes": "lots"}}', "queue.capacity_bytes", "not understood"),
        ('{"queue": {"capacity_bytes": "1e999"}}', "queue.capacity_bytes", "not finite"),
        ('{"trainer": {"optim": {"lr": 1e999}}}', "trainer.optim", "finite"),
        ('{"ctx_student": 1e40}', "ctx_student", "expected int"),
        ('{"ctx_student": 10000000000000000000000000000000000000000}', "ctx_student", "at most"),
        ('{"restart_backoff_s": 1e999}', "restart_backoff_s", "finite"),
        ('{"trainers": 1000, "teachers": 1}', None, "XTOKEN_CONTROL_MAX_RUN_PROCESSES"),
    ],
    ids=["capacity-word", "capacity-inf", "lr-inf", "ctx-float", "ctx-huge", "backoff-inf",
         "trainers"],
)
def test_a_value_no_process_could_use_gets_422(api, body, key, pattern):
    with api.client() as c:
        r = c.post("/v1/runs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert pattern in r.json()["error"]
    if key is not None:
        assert r.json().get("key") == key


def test_the_database_is_no_run_directory(api):
    with api.client() as c:
        for run_dir in ("control.db", "control.db-wal"):
            r = c.post("/v1/runs", json=tiny_config(run_dir=run_dir))
            assert r.status_code == 409, r.text
            assert "database" in r.json()["error"]


def test_a_post_into_the_directory_of_a_stopped_run_gets_409_naming_it(api):
    run_dir = (api.runs_root / "kept").resolve()
    store = Store(api.runs_root / "control.db")  # the server's store, as a second writer
    try:
        config = {**tiny_config(), "run_dir": str(run_dir)}
        store.create_run("stopped-run", "stopped-run", config, str(run_dir))
        store.update_run("stopped-run", state="STOPPED")
    finally:
        store.close()
    with api.client() as c:
        before = len(c.get("/v1/runs").json()["runs"])
        r = c.post("/v1/runs", json=tiny_config(run_dir="kept"))
        assert r.status_code == 409, r.text
        assert "run stopped-run (STOPPED)" in r.json()["error"]
        assert "POST /v1/runs/stopped-run/resume" in r.json()["error"]
        assert len(c.get("/v1/runs").json()["runs"]) == before


def test_reads_answer_only_an_allowed_host_or_the_token(api):
    rebound = {"Host": "rebound.example:8000"}
    with api.client(token=None) as anon, api.client() as owner:
        for path in ("/v1/runs", "/v1/runs/abc", "/metrics"):
            r = anon.get(path, headers=rebound)
            assert r.status_code == 403, r.text
            assert "XTOKEN_CONTROL_ALLOWED_HOSTS" in r.json()["error"]
        assert anon.get("/v1/runs", headers={"Host": "localhost:8000"}).status_code == 200
        assert owner.get("/v1/runs", headers=rebound).status_code == 200
        assert anon.get("/healthz", headers=rebound).status_code == 200


def test_an_allowed_host_setting_opens_reads_to_that_name(monkeypatch):
    from services.control.settings import Settings

    monkeypatch.setenv("XTOKEN_CONTROL_ALLOWED_HOSTS", "ctl.example,10.0.0.5")
    monkeypatch.setenv("XTOKEN_CONTROL_DATA_ROOT", "d1,d2")
    s = Settings(host="0.0.0.0", token="t")
    assert s.allowed_hosts == ["ctl.example", "10.0.0.5"] and len(s.data_root) == 2

    s = Settings(host="0.0.0.0", token="t", allowed_hosts="ctl.example, 10.0.0.5")
    assert s.host_allowed("ctl.example:8000") and s.host_allowed("10.0.0.5")
    assert s.host_allowed("127.0.0.1:8000") and s.host_allowed("[::1]:8000")
    assert not s.host_allowed("rebound.example") and not s.host_allowed("")
    assert Settings(host="10.1.2.3", token="t").host_allowed("10.1.2.3:8000")


# ---------------------------------------------------------------- the Supervisor, without HTTP


@pytest.fixture
def sup(make, tmp_path):
    """A Supervisor whose store lives in its runs root (as `xtoken control serve` keeps it)."""
    (tmp_path / "data").mkdir()
    return make({}, store=Store(tmp_path / "runs" / "control.db"), max_processes=12)


def _active(sup, run_id: str, run_dir: Path, **overrides) -> None:
    config = {**tiny_config(**overrides), "run_dir": str(run_dir)}
    sup.store.create_run(run_id, run_id, config, str(run_dir))


def _ended(sup, run_id: str, run_dir: Path, state: str, **overrides) -> None:
    _active(sup, run_id, run_dir, **overrides)
    sup.store.update_run(run_id, state=state)


def test_a_directory_of_an_active_run_is_refused_inside_and_around(sup, tmp_path):
    _active(sup, "other", tmp_path / "runs" / "a" / "b")
    for run_dir in ("a/b", "a/b/inner", "a"):
        with pytest.raises(Conflict, match="run other"):
            sup.submit(tiny_config(run_dir=run_dir))
    with pytest.raises(Conflict, match="database"):
        sup.submit(tiny_config(run_dir="control.db"))


def test_a_directory_with_another_runs_checkpoint_is_refused_naming_the_difference(sup, tmp_path):
    run_dir = tmp_path / "runs" / "old"
    (run_dir / "checkpoints" / "step_4").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_4")
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps({"ctx_student": 32}))
    with pytest.raises(Conflict, match=r"ctx_student: 32 -> 64.*pick another run_dir"):
        sup.submit(tiny_config(run_dir="old"))
    assert not sup.store.list_runs()


def test_the_control_planes_process_cap_counts_every_active_run(sup, tmp_path):
    _active(sup, "big", tmp_path / "runs" / "big", trainers=8, teachers=1)  # 11 processes
    with pytest.raises(ConfigError, match="XTOKEN_CONTROL_MAX_PROCESSES"):
        sup.submit(tiny_config())
    assert run_config_from_dict(tiny_config(trainers=8)).process_count == 11


@pytest.mark.parametrize("state", ["STOPPED", "FAILED", "INTERRUPTED"])
def test_a_directory_a_resumable_run_owns_is_refused_naming_it_and_its_resume(sup, tmp_path, state):
    _ended(sup, "old", tmp_path / "runs" / "old", state)
    for run_dir in ("old", "old/inner"):
        with pytest.raises(Conflict, match=rf"run old \({state}\).*POST /v1/runs/old/resume"):
            sup.submit(tiny_config(run_dir=run_dir))
    assert [r["id"] for r in sup.store.list_runs()] == ["old"]
    assert sup.get("old")["state"] == state


def test_a_directory_a_finished_run_owns_is_refused_without_offering_a_resume(sup, tmp_path):
    _ended(sup, "done", tmp_path / "runs" / "done", "SUCCEEDED")
    with pytest.raises(Conflict, match=r"run done \(SUCCEEDED\).*pick another run_dir") as err:
        sup.submit(tiny_config(run_dir="done"))
    assert "resume" not in str(err.value)


def test_a_resume_past_the_process_cap_is_refused_and_the_run_stays_as_it_was(sup, tmp_path):
    _ended(sup, "old", tmp_path / "runs" / "old", "STOPPED")  # 4 processes
    _active(sup, "big", tmp_path / "runs" / "big", trainers=8, teachers=1)  # 11 of the 12
    with pytest.raises(ConfigError, match="XTOKEN_CONTROL_MAX_PROCESSES"):
        sup.resume("old")
    assert sup.get("old")["state"] == "STOPPED"
    assert not [e for e in sup.events("old") if e["kind"] in ("resumed", "state")]


def test_fifty_submissions_at_once_never_hold_more_processes_than_the_cap(make, tmp_path):
    from services.control.app import create_app
    from services.control.settings import Settings

    (tmp_path / "data").mkdir()
    sup = make({}, max_processes=8)  # two runs of 4 processes
    settings = Settings(runs_root=tmp_path / "runs", data_root=[tmp_path / "data"])
    n = 50
    barrier = threading.Barrier(n)

    def post(url: str) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=60) as c:
            barrier.wait()
            return c.post("/v1/runs", json=tiny_config())

    with serve_app(create_app(settings, supervisor=sup)) as url, ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(post, [url] * n))
    codes = sorted(r.status_code for r in replies)
    assert codes == [201] * 2 + [422] * (n - 2), [r.text for r in replies if r.status_code != 422]
    for r in replies:
        if r.status_code == 422:
            assert "XTOKEN_CONTROL_MAX_PROCESSES" in r.json()["error"]
    assert len(sup.store.list_runs()) == 2
