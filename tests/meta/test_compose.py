"""docker-compose.yml and its CPU profile: commands the CLI accepts, loopback only, GPUs, namespaces."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from services import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CPU_PROFILE = ROOT / "deploy" / "compose.cpu.yml"
_VAR = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


class _ComposeLoader(yaml.SafeLoader):
    """YAML loader that knows compose's `!reset` and `!override` tags."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)
_ComposeLoader.add_multi_constructor(
    "!override", lambda loader, suffix, node: loader.construct_mapping(node)
)


def _interpolate(value: str) -> str:
    """Apply compose's `${NAME:-default}` rule with an empty environment."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


def _load(path: pathlib.Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def _services() -> dict:
    return _load(COMPOSE)["services"]


def compose_command() -> list[str] | None:
    """The compose v2 CLI: `.venv/bin/docker-compose` (the `deploy` extra) or `docker compose`."""
    beside = pathlib.Path(sys.executable).parent / "docker-compose"
    for candidate in (str(beside), shutil.which("docker-compose")):
        if candidate and os.access(candidate, os.X_OK):
            return [candidate]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def _config(*files: pathlib.Path, **env: str) -> dict:
    """`docker compose config` of these files, as compose itself resolves them."""
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose v2 CLI (pip install 'xtoken[deploy]' or the compose plugin)")
    # --env-file: a user's own .env beside the compose file must not change what is checked
    args = [*command, "--project-directory", str(ROOT), "--env-file", os.devnull]
    for f in files:
        args += ["-f", str(f)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("XTOKEN_", "COMPOSE_"))}
    environ.update(env)
    done = subprocess.run(
        [*args, "config", "--format", "yaml"], capture_output=True, text=True, env=environ,
        cwd=ROOT, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


XTOKEN_SERVICES = ("queue", "control")  # the others run no xtoken command


def test_compose_runs_the_queue_and_the_control_plane_from_one_image():
    services = _services()
    assert set(services) == {"ns", *XTOKEN_SERVICES}
    build = services["control"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    assert {s["image"] for s in services.values()} == {services["control"]["image"]}


@pytest.mark.parametrize("name", XTOKEN_SERVICES)
def test_each_service_command_parses_with_the_cli(name):
    command = [_interpolate(str(part)) for part in _services()[name]["command"]]
    args = cli.build_parser().parse_args(command)
    assert args.command == command[0]
    assert not getattr(args, "_missing", False), f"`xtoken {command[0]}` is not in this build"


@pytest.mark.parametrize("name", XTOKEN_SERVICES)
def test_each_service_has_a_healthcheck_a_restart_policy_and_loopback_binds_only(name):
    service = _services()[name]
    assert service["restart"] == "unless-stopped"
    assert service["healthcheck"]["test"][0] == "CMD"
    assert service["network_mode"] == "host"
    assert "ports" not in service  # host networking: binds decide, and they are loopback
    command = [_interpolate(str(part)) for part in service["command"]]
    for flag in ("--bind", "--host"):
        if flag in command:
            address = command[command.index(flag) + 1]
            assert re.fullmatch(r"(tcp://)?127\.0\.0\.1(:\d+)?", address), address
    assert any("127.0.0.1" in str(part) for part in service["healthcheck"]["test"])


def test_control_plane_reserves_every_gpu():
    devices = _services()["control"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_queue_and_control_share_the_ipc_and_pid_namespaces_of_a_holder_that_runs_nothing():
    services = _services()
    ns = services["ns"]
    # CUDA IPC and the /dev/shm pool need one IPC namespace, and shm segment owners are judged
    # by pid, so one PID namespace too; held by a service that cannot crash, so that either
    # user restarts alone (Docker cannot restart a container into a restarting one's namespaces)
    assert ns["ipc"] == "shareable" and "shm_size" in ns and ns["init"] is True
    assert ns["entrypoint"] == ["sleep", "infinity"] and ns["network_mode"] == "none"
    assert ns["restart"] == "unless-stopped" and ns["healthcheck"]["test"][0] == "CMD"
    for name in XTOKEN_SERVICES:
        service = services[name]
        assert service["ipc"] == "service:ns" and service["pid"] == "service:ns", name
        assert service["depends_on"]["ns"]["condition"] == "service_started", name


def test_control_plane_mounts_data_models_and_runs_and_confines_paths_to_them():
    control = _services()["control"]
    targets = {_interpolate(v).split(":")[1] for v in control["volumes"]}
    assert {"/data", "/models", "/runs"} <= targets
    command = control["command"]
    assert command[command.index("--data-root") + 1].split(",") == ["/data", "/models"]
    assert command[command.index("--runs-root") + 1] == "/runs"
    env = control["environment"]
    assert ":?" in env["XTOKEN_CONTROL_TOKEN"]  # no default token: compose refuses to start


def test_runs_of_the_control_plane_use_the_queue_service():
    services = _services()
    control, queue = services["control"], services["queue"]
    bind = _interpolate(queue["command"][queue["command"].index("--bind") + 1])
    assert _interpolate(control["environment"]["XTOKEN_CONTROL_QUEUE"]) == bind
    assert control["depends_on"]["queue"]["condition"] == "service_healthy"


def test_example_env_sets_only_variables_the_compose_files_use_and_documents_each():
    text = COMPOSE.read_text() + CPU_PROFILE.read_text()
    used = {name for name, _ in _VAR.findall(text)}
    documented = set()
    for line in (ROOT / "deploy" / "example.env").read_text().splitlines():
        if line and not line.startswith("#"):
            name = line.split("=", 1)[0]
            assert name in used, line
            documented.add(name)
    assert used <= documented, sorted(used - documented)


def test_dockerfile_pins_torch_for_both_profiles():
    # the GPU image's torch brings Triton 3.8 (tl.histogram in shared memory: the gold loss);
    # the CPU image keeps the CPU build of the development set-up
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ARG TORCH_SPEC="torch==2.14.1"' in dockerfile
    cpu = _load(CPU_PROFILE)["x-image-cpu"]["build"]["args"]
    assert cpu["TORCH_SPEC"] == "torch==2.13.0+cpu"
    gpu = _load(COMPOSE)["x-image"]["build"]["args"]
    assert gpu["TORCH_SPEC"] == "torch==2.14.1"
    build = (ROOT / "deploy" / "build_image.sh").read_text()
    assert "gpu) TORCH_VERSION=2.14.1" in build


def test_docker_compose_config_accepts_the_gpu_file():
    config = _config(COMPOSE, XTOKEN_CONTROL_TOKEN="t")
    control = config["services"]["control"]
    assert control["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert {s["image"] for s in config["services"].values()} == {"xtoken:gpu"}
    assert config["services"]["ns"]["ipc"] == "shareable"
    assert control["pid"] == config["services"]["queue"]["pid"] == "service:ns"


def test_docker_compose_config_of_the_cpu_profile_drops_the_gpu_reservation():
    config = _config(COMPOSE, CPU_PROFILE, XTOKEN_CONTROL_TOKEN="t")
    for name in ("ns", "queue", "control"):
        service = config["services"][name]
        assert service["image"] == "xtoken:cpu"
        assert service["build"]["args"]["TORCH_SPEC"] == "torch==2.13.0+cpu"
        assert "deploy" not in service and "ulimits" not in service
    assert config["services"]["queue"]["ipc"] == "service:ns"


def test_docker_compose_config_refuses_to_run_without_a_control_token():
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose v2 CLI (pip install 'xtoken[deploy]' or the compose plugin)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("XTOKEN_", "COMPOSE_"))}
    done = subprocess.run(
        [*command, "--project-directory", str(ROOT), "--env-file", os.devnull, "-f", str(COMPOSE),
         "config"],
        capture_output=True, text=True, env=environ, cwd=ROOT, timeout=60,
    )
    assert done.returncode != 0
    assert "XTOKEN_CONTROL_TOKEN" in done.stderr
