"""`docker compose` CPU profile on a real Docker engine: build, up, runs over REST, crashes, down."""

# Run with ./scripts/docker_test.sh (a private dockerd, the debootstrap base image); by hand:
# DOCKER_HOST=... XTOKEN_BASE_IMAGE=... python -m pytest -m docker tests/deploy

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("XTOKEN_TEST_IMAGE", "xtoken:cpu")
TEXTS = 160  # training texts: micro-batches of 4, 2 accumulated: 20 optimizer steps
STEPS = TEXTS // 8
STATES_DONE = {"SUCCEEDED", "FAILED", "STOPPED", "INTERRUPTED"}

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]


def _compose_binary() -> list[str] | None:
    beside = pathlib.Path(sys.executable).parent / "docker-compose"
    for candidate in (str(beside), shutil.which("docker-compose")):
        if candidate and os.access(candidate, os.X_OK):
            return [candidate]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def _corpus(path: pathlib.Path, n: int) -> None:
    """``n`` JSONL texts cut from this interpreter's stdlib sources (no download)."""
    import sysconfig

    texts: list[str] = []
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.glob("*.py")):
        body = source.read_text(errors="replace")
        for start in range(0, len(body) - 600, 1500):
            texts.append(body[start : start + 600])
            if len(texts) == n:
                path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
                return
    raise AssertionError("the stdlib has too few sources for the corpus")


class Compose:
    """docker compose, CPU profile, one project of this test, its own env and folders."""

    def __init__(self, tmp: pathlib.Path) -> None:
        command = _compose_binary()
        assert command is not None
        self.project = f"xtoken-test-{secrets.token_hex(4)}"
        self.token = secrets.token_hex(16)
        self.control_port, self.queue_port = _free_port(), _free_port()
        self.runs, self.data, self.models = tmp / "runs", tmp / "data", tmp / "models"
        for d in (self.runs, self.data, self.models):
            d.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("XTOKEN_", "COMPOSE"))}
        self.env.update(
            XTOKEN_IMAGE=IMAGE,
            XTOKEN_CONTROL_TOKEN=self.token,
            XTOKEN_CONTROL_PORT=str(self.control_port),
            XTOKEN_QUEUE_PORT=str(self.queue_port),
            XTOKEN_QUEUE_CAPACITY="512MiB",
            XTOKEN_SHM_SIZE="2gb",
            XTOKEN_DATA_DIR=str(self.data),
            XTOKEN_MODELS_DIR=str(self.models),
            XTOKEN_RUNS_DIR=str(self.runs),
        )
        self.base = [
            *command, "--project-name", self.project, "--project-directory", str(ROOT),
            "--env-file", os.devnull,
            "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "deploy" / "compose.cpu.yml"),
        ]
        self.url = f"http://127.0.0.1:{self.control_port}"

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.base, *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
            timeout=timeout,
        )

    def containers(self) -> list[str]:
        """Names of every container of this project, running or not."""
        done = subprocess.run(
            ["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
             "--format", "{{.Names}}"], capture_output=True, text=True, check=True,
        )
        return done.stdout.split()

    def health(self, service: str) -> str:
        """``healthy``, ``starting`` or ``unhealthy`` of a service's container."""
        cid = self("ps", "-q", service).stdout.strip()
        done = subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", cid],
                              capture_output=True, text=True)
        return done.stdout.strip()

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "60").stdout[-6000:]


@pytest.fixture(scope="module")
def engine():
    """The Docker engine of DOCKER_HOST and a compose v2 CLI, or skip."""
    if shutil.which("docker") is None or _compose_binary() is None:
        pytest.skip("needs the docker CLI and docker compose v2 (./scripts/docker_test.sh)")
    if subprocess.run(["docker", "version"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no Docker engine answers at DOCKER_HOST (./scripts/docker_test.sh starts one)")


@pytest.fixture(scope="module")
def image(engine):
    """The CPU image, built from this tree by deploy/build_image.sh."""
    t0 = time.monotonic()
    done = subprocess.run(["bash", "deploy/build_image.sh", "cpu", IMAGE], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"[deploy-test] image {IMAGE} built in {time.monotonic() - t0:.0f} s")
    return IMAGE


@pytest.fixture
def compose(image, tmp_path):
    c = Compose(tmp_path)
    yield c
    c("down", "--volumes", "--remove-orphans", "--timeout", "30")


def _wait_healthy(compose: Compose, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {s: compose.health(s) for s in ("ns", "queue", "control")}
        if set(states.values()) == {"healthy"}:
            return
        assert "unhealthy" not in states.values(), (states, compose.logs())
        time.sleep(2)
    raise AssertionError(f"not healthy within {timeout_s} s: {states}\n{compose.logs()}")


def _wait_state(client, run_id: str, timeout_s: float, compose: Compose) -> dict:
    deadline = time.monotonic() + timeout_s
    run: dict = {}
    while time.monotonic() < deadline:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["state"] in STATES_DONE:
            return run
        time.sleep(2)
    raise AssertionError(f"run {run_id} still {run.get('state')} after {timeout_s} s\n"
                         f"{compose.logs()}")


def _run_config(data: pathlib.Path) -> dict:
    _corpus(data / "train.jsonl", TEXTS)
    _corpus(data / "heldout.jsonl", 4)
    return {
        "student_tokenizer": "mistral",
        "teacher_tokenizer": "smollm2",
        "ctx_student": 64,
        "ctx_teacher": 64,
        "queue": {"capacity_bytes": "256MiB"},
        "trainers": 1,
        "teachers": 1,
        "data": {"train": "/data/train.jsonl", "heldout": "/data/heldout.jsonl"},
        "collator": {"workers": 1, "batch": 16},
        "teacher": {"model": "tiny", "transport": "shm", "max_batch": 4, "max_length": 64,
                    "checksum": True},
        "trainer": {
            "student": {"model": "tiny"},
            "feed": {"micro_batch": 4, "grad_accum": 2},
            "schedule": {"max_steps": 0, "epochs": 1, "checkpoint_every": 2, "eval_every": 0},
            "eval": {"texts": 4, "ctx": 64},
            "teacher": {"verify_logits": True},
            "optim": {"lr": 0.003, "warmup_steps": 1},
            "loss": {"mode": "pkl"},
        },
    }


def _container_main_pid(compose: Compose, service: str) -> int:
    """Host pid of the service's main process (the container's first process)."""
    cid = compose("ps", "-q", service).stdout.strip()
    pid = subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", cid],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert "xtoken" in pathlib.Path(f"/proc/{pid}/cmdline").read_text(), pid
    return int(pid)


def _restart_count(compose: Compose, service: str) -> int:
    cid = compose("ps", "-q", service).stdout.strip()
    out = subprocess.run(["docker", "inspect", "--format", "{{.RestartCount}}", cid],
                         capture_output=True, text=True, check=True).stdout.strip()
    return int(out or 0)


def _trained(run_dir: pathlib.Path) -> list[dict]:
    """The ``trained`` records of every rank's keys log."""
    return [r for p in sorted((run_dir / "keys").glob("trainer.rank*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()
            for r in [json.loads(line)] if r.get("event") == "trained"]


def _checkpoint_keys(run_dir: pathlib.Path) -> set[str]:
    """The keys the latest checkpoint says were trained in its epoch."""
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return {k for meta in latest.glob("rank*.json") for k in json.loads(meta.read_text())["trained"]}


def _run_dir(compose: Compose, run: dict) -> pathlib.Path:
    """The host folder of a run directory that the control plane names inside the container."""
    return compose.runs / pathlib.PurePosixPath(run["run_dir"]).relative_to("/runs")


def test_cpu_profile_runs_stops_and_resumes_a_run_over_rest_and_down_leaves_no_container(compose):
    import httpx

    # the GPU file as compose resolves it (it cannot start here: no NVIDIA runtime)
    gpu = subprocess.run(
        [*_compose_binary(), "--project-directory", str(ROOT), "--env-file", os.devnull,
         "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        env=compose.env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert gpu.returncode == 0, gpu.stderr

    t0 = time.monotonic()
    up = compose("up", "--detach", "--no-build")
    assert up.returncode == 0, up.stderr
    _wait_healthy(compose, 240)
    t_healthy = time.monotonic() - t0

    # host networking, loopback binds: both servers listen on 127.0.0.1 and nowhere else
    for port in (compose.control_port, compose.queue_port):
        assert _listeners(port) == {"0100007F"}, (port, _listeners(port))
    # the queue service answers a client on this host
    stats = subprocess.run(
        [sys.executable, "-m", "services.cli", "queue", "stats", "--queue",
         f"tcp://127.0.0.1:{compose.queue_port}"], capture_output=True, text=True, timeout=60,
        cwd=ROOT,
    )
    assert stats.returncode == 0, stats.stderr

    config = _run_config(compose.data)
    auth = {"Authorization": f"Bearer {compose.token}"}
    with httpx.Client(base_url=compose.url, timeout=60) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/docs").status_code == 200
        if list((ROOT / "services" / "control").rglob("*.html")):
            # the dashboard's static files made it into the installed package of the image
            page = client.get("/")
            assert page.status_code == 200 and "html" in page.headers["content-type"], page.text
        assert "xtoken_" in client.get("/metrics").text
        refused = client.post("/v1/runs", json=config)  # no token: a mutating call is refused
        assert refused.status_code == 401, refused.text
        created = client.post("/v1/runs", json=config, headers=auth, params={"name": "docker"})
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        t_posted = time.monotonic()

        # stop it mid-epoch: a checkpoint at one step boundary, every process gone
        deadline = time.monotonic() + 600
        while (client.get(f"/v1/runs/{run_id}").json().get("step") or 0) < 2:
            assert time.monotonic() < deadline, compose.logs()
            time.sleep(0.5)
        stop = client.post(f"/v1/runs/{run_id}/stop", headers=auth, json={"grace_s": 120})
        assert stop.status_code == 202, stop.text
        stopped = _wait_state(client, run_id, 300, compose)
        assert stopped["state"] == "STOPPED", stopped
        assert stopped["checkpoint"] and stopped["checkpoint"]["step"] < STEPS, stopped
        processes = client.get(f"/v1/runs/{run_id}/processes").json()["processes"]
        # the run uses the queue service (XTOKEN_CONTROL_QUEUE), in partitions of its own
        assert {p["role"] for p in processes} == {"collator", "teacher", "trainer"}, processes
        assert stopped["queue"] == f"tcp://127.0.0.1:{compose.queue_port}", stopped
        listed = subprocess.run(
            [sys.executable, "-m", "services.cli", "queue", "stats", "--json", "--queue",
             stopped["queue"]], capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert listed.returncode == 0 and f'"{run_id}.train"' in listed.stdout, listed
        assert all(p["state"] != "running" for p in processes), processes

        resumed = client.post(f"/v1/runs/{run_id}/resume", headers=auth)
        assert resumed.status_code == 202, resumed.text
        run = _wait_state(client, run_id, 900, compose)
        t_trained = time.monotonic() - t_posted
        assert run["state"] == "SUCCEEDED", (run, compose.logs())

    # the run's outputs are on the runs volume (a host folder), written inside the container
    run_dir = _run_dir(compose, run)
    keys = [k for r in _trained(run_dir) for k in r["keys"]]
    assert len(keys) == len(set(keys)) == TEXTS, "every text trained once across stop and resume"
    assert sorted(int(k.rsplit(":", 1)[1]) for k in keys) == list(range(1, TEXTS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == stopped["checkpoint"]["step"], summary
    assert summary["step"] == STEPS and not summary["stopped"], summary
    before = [json.loads(line) for line in (run_dir / "metrics" / "trainer.rank0.jsonl")
              .read_text().splitlines() if '"before"' in line]
    assert before and summary["student_after"]["bits_per_byte"] < before[0]["bits_per_byte"]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest).is_dir()
    assert (run_dir / "final" / "config.json").is_file()
    assert (compose.runs / "control.db").is_file()

    # the control plane SIGKILLed mid-run: restart: unless-stopped brings it back into the
    # namespaces of ns, the queue service is not touched, the run is INTERRUPTED, and its resume
    # trains what the checkpoint lacks: no text lost, none trained twice in the final lineage
    with httpx.Client(base_url=compose.url, timeout=60) as client:
        created = client.post("/v1/runs", json=config, headers=auth, params={"name": "crash"})
        assert created.status_code == 201, created.text
        crash_id = created.json()["id"]
        deadline = time.monotonic() + 600
        while (client.get(f"/v1/runs/{crash_id}").json().get("step") or 0) < 2:
            assert time.monotonic() < deadline, compose.logs()
            time.sleep(0.5)
        restarts = _restart_count(compose, "control")
        queue_pid = _container_main_pid(compose, "queue")
        os.kill(_container_main_pid(compose, "control"), signal.SIGKILL)
    t_killed = time.monotonic()
    deadline = time.monotonic() + 120
    while _restart_count(compose, "control") == restarts:
        assert time.monotonic() < deadline, "control was not restarted\n" + compose.logs()
        time.sleep(1)
    _wait_healthy(compose, 240)
    t_back = time.monotonic() - t_killed
    assert _container_main_pid(compose, "queue") == queue_pid, "the queue was restarted too"
    with httpx.Client(base_url=compose.url, timeout=60) as client:
        crashed = client.get(f"/v1/runs/{crash_id}").json()
        assert crashed["state"] == "INTERRUPTED", crashed
        crash_dir = _run_dir(compose, crashed)
        saved = _checkpoint_keys(crash_dir) if crashed["checkpoint"] else set()
        before_resume = len(_trained(crash_dir))
        resumed = client.post(f"/v1/runs/{crash_id}/resume", headers=auth)
        assert resumed.status_code == 202, resumed.text
        done = _wait_state(client, crash_id, 900, compose)
        assert done["state"] == "SUCCEEDED", (done, compose.logs())
    after = [k for r in _trained(crash_dir)[before_resume:] for k in r["keys"]]
    assert len(after) == len(set(after)) and not set(after) & saved, "a text trained twice"
    assert saved | set(after) == set(keys), "a text lost"  # both runs read /data/train.jsonl
    assert _checkpoint_keys(crash_dir) == saved | set(after)

    # and the queue service SIGKILLed: restarted alone, the control plane is not touched
    control_pid, restarts = _container_main_pid(compose, "control"), _restart_count(compose, "queue")
    os.kill(_container_main_pid(compose, "queue"), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _restart_count(compose, "queue") == restarts:
        assert time.monotonic() < deadline, "queue was not restarted\n" + compose.logs()
        time.sleep(1)
    _wait_healthy(compose, 240)
    assert _container_main_pid(compose, "control") == control_pid, "control was restarted too"

    # down and up again: the control plane's state lives on the runs volume
    down = compose("down", "--timeout", "30")
    assert down.returncode == 0, down.stderr
    assert compose.containers() == []
    up = compose("up", "--detach", "--no-build")
    assert up.returncode == 0, up.stderr
    _wait_healthy(compose, 240)
    with httpx.Client(base_url=compose.url, timeout=60) as client:
        again = client.get(f"/v1/runs/{run_id}").json()
        assert again["state"] == "SUCCEEDED", again

    down = compose("down", "--volumes", "--remove-orphans", "--timeout", "30")
    assert down.returncode == 0, down.stderr
    assert compose.containers() == [], "containers left behind"
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter",
         f"label=com.docker.compose.project={compose.project}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert volumes == [], volumes
    print(f"[deploy-test] healthy after {t_healthy:.0f} s; run posted, stopped, resumed and "
          f"SUCCEEDED in {t_trained:.0f} s; control plane back {t_back:.0f} s after its SIGKILL; "
          f"total {time.monotonic() - t0:.0f} s")
