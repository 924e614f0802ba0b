"""docker-compose.yml, as Compose itself resolves it.

Each check runs ``docker-compose config`` (docker-compose 1.29, which
scripts/setup installs; ``docker compose`` v2 where only that is present) and
reads the fully resolved file it prints, so what is checked is what Compose
would run: defaults interpolated, YAML anchors merged, profiles applied. No
Docker engine is needed. Neither Compose version's output layout is assumed
where they differ (short or long port and volume syntax; whether services of
an inactive profile are listed).

A missing Compose is a failure, not a skip: CI must validate the file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.config import REDIS_PERSISTENCE

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DEFAULT_PIPELINE = "configs/default.toml"
DEFAULT_STAGES = ("vad", "asr", "thinker", "tts")
"""The default pipeline's stages, used while configs/default.toml does not exist."""
GPU_SERVICE = "thinker-gpu"
DUPLEXQ_SERVICES = ("coordinator", "control")
"""duplexq services that are not stage workers."""

Config = dict[str, Any]


def compose_command() -> list[str]:
    if path := shutil.which("docker-compose"):
        return [path]
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    pytest.fail(
        "neither docker-compose nor `docker compose` is installed; scripts/setup installs "
        "the Debian package docker-compose, which validates docker-compose.yml"
    )


CLUSTER_ENV = {
    "DUPLEXQ_REDIS_URL": "redis+cluster://redis-node-0:6379,redis-node-1:6379,redis-node-2:6379",
    "DUPLEXQ_CONTROL_REDIS_URL": "redis://redis:6379/0",
}
"""The variables docs/deploy.md sets for the cluster profile."""


def compose_config(env_file: Path, *profiles: str, env: Mapping[str, str] | None = None) -> Config:
    """The resolved compose file, with only ``env`` set of duplexq's and Compose's variables.

    ``env_file`` stands in for a ``.env`` beside the compose file, which a developer
    may have, so that it cannot change what is checked.
    """
    environ = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("DUPLEXQ_", "COMPOSE_"))
    }
    environ.update(env or {})
    argv = [*compose_command(), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE)]
    argv += ["--env-file", str(env_file)]
    for profile in profiles:
        argv += ["--profile", profile]
    result = subprocess.run(
        [*argv, "config"], cwd=ROOT, env=environ, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"compose config failed:\n{result.stderr}"
    config: Config = yaml.safe_load(result.stdout)
    return config


def pipeline_stages(relative: str) -> tuple[str, ...]:
    path = ROOT / relative
    if not path.exists():
        return DEFAULT_STAGES
    stages = tomllib.loads(path.read_text())["stages"]
    return tuple(stage["name"] for stage in stages)


def is_active(service: Config) -> bool:
    """Whether a plain ``up`` starts the service (it belongs to no profile)."""
    return not service.get("profiles")


def published_targets(service: Config) -> list[int]:
    """Container ports the service publishes on the host, in either port syntax."""
    targets = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            targets.append(int(port["target"]))
        else:
            container = str(port).split("/")[0].rsplit(":", 1)[-1]
            targets.append(int(container))
    return targets


def volume_mounts(service: Config) -> dict[str, str]:
    """Container path -> source (named volume or host path), in either volume syntax."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume["source"]
        else:
            source, target = str(volume).split(":")[:2]
            mounts[target] = source
    return mounts


def pipeline_argument(service: Config) -> str:
    command = service["command"]
    return str(command[command.index("--pipeline") + 1])


@pytest.fixture(scope="module")
def default(env_file: Path) -> Config:
    return compose_config(env_file)


@pytest.fixture(scope="module")
def gpu(env_file: Path) -> Config:
    return compose_config(env_file, "gpu")


def test_compose_file_is_valid_with_and_without_the_gpu_profile(
    default: Config, gpu: Config
) -> None:
    for config in (default, gpu):
        assert {"redis", *DUPLEXQ_SERVICES} <= set(config["services"])


def test_redis_persists_with_aof_and_never_evicts(default: Config) -> None:
    redis = default["services"]["redis"]
    assert str(redis["image"]).split(":")[0] == "redis"
    assert str(redis["image"]).split(":")[1].startswith("7")
    command = [str(part) for part in redis["command"]]
    settings = dict(zip(command[1::2], command[2::2], strict=False))
    assert command[0] == "redis-server"
    # The persistence the tests and `up` run with, nothing kinder or weaker.
    shipped = dict(zip(REDIS_PERSISTENCE[::2], REDIS_PERSISTENCE[1::2], strict=True))
    assert {key: settings.get(key) for key in shipped} == shipped
    assert settings["--maxmemory-policy"] == "noeviction"
    data = volume_mounts(redis)["/data"]
    assert data in default["volumes"], "Redis data must live in a named volume"
    # Healthy once it answers (and a cluster data plane is joined: test_compose_file.py).
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "redis-cli ping" in redis["healthcheck"]["test"][1]
    assert not redis.get("ports"), "Redis is not published on the host"


def test_every_stage_of_the_default_pipeline_has_a_scalable_service(default: Config) -> None:
    services = default["services"]
    for stage in pipeline_stages(DEFAULT_PIPELINE):
        service = services.get(stage)
        assert service is not None, f"no service for stage {stage!r}"
        assert is_active(service), f"stage {stage!r} must run without a profile"
        assert service["command"] == [
            "worker",
            "--stage",
            stage,
            "--pipeline",
            f"/app/{DEFAULT_PIPELINE}",
            "--metrics-port",
            "9100",
        ]
        # A fixed name or host port would stop `--scale stage=N` from working.
        assert "container_name" not in service, stage
        assert not service.get("ports"), stage
        assert volume_mounts(service)["/app/configs"].endswith("configs")


def test_duplexq_services_wait_for_a_healthy_redis_and_share_its_url(default: Config) -> None:
    services = default["services"]
    names = [*DUPLEXQ_SERVICES, *pipeline_stages(DEFAULT_PIPELINE)]
    for name in names:
        service = services[name]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert service["environment"]["DUPLEXQ_REDIS_URL"] == "redis://redis:6379/0", name
        assert service["build"]["args"]["EXTRAS"] == "cpu,speech", name


def test_coordinator_publishes_8080_with_a_health_check(default: Config) -> None:
    coordinator = default["services"]["coordinator"]
    assert coordinator["command"][:3] == ["coordinator", "--pipeline", f"/app/{DEFAULT_PIPELINE}"]
    assert published_targets(coordinator) == [8080]
    env = coordinator["environment"]
    assert env["DUPLEXQ_HOST"] == "0.0.0.0"
    assert str(env["DUPLEXQ_PORT"]) == "8080"
    assert "/healthz" in " ".join(coordinator["healthcheck"]["test"])
    # Clients need a key unless anonymous access is asked for explicitly.
    assert env["DUPLEXQ_API_KEYS"]
    assert str(env["DUPLEXQ_ALLOW_ANONYMOUS"]).lower() == "false"


def test_api_keys_come_from_the_host_environment(env_file: Path) -> None:
    config = compose_config(
        env_file, env={"DUPLEXQ_API_KEYS": "k1,k2", "DUPLEXQ_ALLOW_ANONYMOUS": "true"}
    )
    env = config["services"]["coordinator"]["environment"]
    assert env["DUPLEXQ_API_KEYS"] == "k1,k2"
    assert str(env["DUPLEXQ_ALLOW_ANONYMOUS"]).lower() == "true"


def test_control_plane_runs_on_the_same_pipeline(default: Config) -> None:
    control = default["services"]["control"]
    assert control["command"][0] == "control"
    assert pipeline_argument(control) == f"/app/{DEFAULT_PIPELINE}"
    assert is_active(control)


def test_gpu_thinker_reserves_an_nvidia_gpu_only_in_the_gpu_profile(
    default: Config, gpu: Config
) -> None:
    # docker-compose 1.29 lists a service of an inactive profile; v2 leaves it out.
    idle = default["services"].get(GPU_SERVICE)
    assert idle is None or idle["profiles"] == ["gpu"]

    service = gpu["services"][GPU_SERVICE]
    assert service["profiles"] == ["gpu"]
    assert service["command"] == gpu["services"]["thinker"]["command"]
    assert service["build"]["args"]["EXTRAS"] == "gpu,speech"
    assert service["image"] != gpu["services"]["thinker"]["image"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    device = devices[0]
    assert device["driver"] == "nvidia"
    assert int(device["count"]) == 1
    assert device["capabilities"] == ["gpu"]
    assert "container_name" not in service
    assert not service.get("ports")
    # Everything else, the CPU thinker included, needs no profile.
    for name, other in gpu["services"].items():
        if name != GPU_SERVICE and "gpu" in other.get("profiles", []):
            pytest.fail(f"{name} is in the gpu profile")
    assert is_active(gpu["services"]["thinker"])


def test_the_pipeline_file_is_chosen_by_an_environment_variable(env_file: Path) -> None:
    chosen = "configs/mine.toml"
    config = compose_config(env_file, "gpu", "echo", env={"DUPLEXQ_PIPELINE": chosen})
    services = config["services"]
    for name in [*DUPLEXQ_SERVICES, *DEFAULT_STAGES, GPU_SERVICE]:
        assert pipeline_argument(services[name]) == f"/app/{chosen}", name
    # The echo profile's stack runs its own pipeline whatever the variable says.
    for name, service in services.items():
        if name.startswith("echo-"):
            assert pipeline_argument(service) == "/app/configs/echo.toml", name


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def copied_sources() -> list[str]:
    """Build-context paths the Dockerfile's COPY instructions read (not ``--from``)."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(word.startswith("--from") for word in words):
            sources += [word for word in words[1:-1] if not word.startswith("--")]
    return sources


def test_dockerfile_copies_only_what_the_build_context_has() -> None:
    ignored = dockerignore_patterns()
    sources = copied_sources()
    assert {"pyproject.toml", "README.md", "configs"} <= set(sources)
    # Every package the project installs is in the image (the workers import dataplane).
    packaging = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = packaging["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.rstrip("*") for name in packages} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
        top = Path(source).parts[0]
        assert top not in ignored, f".dockerignore leaves {source} out of the build context"


def test_dockerfile_flavours_and_entrypoint() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim|^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    # The same pinned extras the tests run with (pyproject.toml's `cpu` and `speech`).
    assert re.search(r"^ARG EXTRAS=cpu,speech$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["duplexq"\]$', text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert "espeak-ng" in text
    assert "https://download.pytorch.org/whl/cpu" in text


def test_the_cluster_profile_runs_six_persisting_nodes_and_joins_them_once(
    env_file: Path,
) -> None:
    config = compose_config(env_file, "cluster", env=CLUSTER_ENV)
    services = config["services"]
    nodes = [f"redis-node-{i}" for i in range(6)]
    persistence = " ".join(REDIS_PERSISTENCE)
    for name in nodes:
        node = services[name]
        assert node["profiles"] == ["cluster"]
        command = " ".join(node["command"])
        assert "--cluster-enabled yes" in command
        assert persistence in command and "noeviction" in command, name
        assert f"--cluster-announce-hostname {name}" in command
        assert volume_mounts(node)["/data"] == name
    joiner = services["redis-cluster"]
    assert set(joiner["depends_on"]) == set(nodes)
    script = joiner["command"][0]
    assert "--cluster-replicas 1" in script and "cluster_state:ok" in script
    # The data plane goes to the cluster, arq's queue to the plain Redis.
    for name in [*DUPLEXQ_SERVICES, *pipeline_stages(DEFAULT_PIPELINE)]:
        env = services[name]["environment"]
        assert env["DUPLEXQ_REDIS_URL"] == CLUSTER_ENV["DUPLEXQ_REDIS_URL"], name
        assert env["DUPLEXQ_CONTROL_REDIS_URL"] == CLUSTER_ENV["DUPLEXQ_CONTROL_REDIS_URL"]
    # Without the profile, nothing of the cluster runs.
    default = compose_config(env_file)
    for name in [*nodes, "redis-cluster"]:
        idle = default["services"].get(name)
        assert idle is None or idle["profiles"] == ["cluster"]


def test_base_images_are_official_by_default_and_can_be_replaced(env_file: Path) -> None:
    default = compose_config(env_file)["services"]
    assert default["redis"]["image"] == "redis:7"
    assert default["coordinator"]["build"]["args"]["PYTHON_IMAGE"] == "python:3.11-slim"
    local = {"DUPLEXQ_PYTHON_IMAGE": "mirror/python:3.11", "DUPLEXQ_REDIS_IMAGE": "mirror/redis:7"}
    services = compose_config(env_file, env=local)["services"]
    assert services["redis"]["image"] == "mirror/redis:7"
    for name in [*DUPLEXQ_SERVICES, *pipeline_stages(DEFAULT_PIPELINE)]:
        assert services[name]["build"]["args"]["PYTHON_IMAGE"] == "mirror/python:3.11", name
