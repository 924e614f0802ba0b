"""What a deploy engineer needs of docker-compose.yml, read from the file as Compose
resolves it (``docker-compose config``, through tests/test_compose.py's helper):

- every service has a healthcheck (the one-shot cluster joiner excepted);
- Redis, and every node of the cluster profile, has a memory limit and the
  ``noeviction`` policy: when full it refuses writes, it never drops stream data;
  and they pass the check every duplexq process makes of its Redis at start;
- the container user can write where duplexq writes (the models folder);
- the thinker's model is chosen by a variable or lies under the mounted ``/models``;
- the image installs the same extras, with their pins, as the tests run with;
- every worker serves its metrics on a container port that is not published, and
  configs/prometheus.yml scrapes every worker service by name;
- each profile starts only services that stay up: no worker of a stage its
  pipeline lacks, no dependency the profile does not start, no host port taken
  twice, no one-shot service that Compose would restart for ever.

The Redis healthcheck's shell script is also run, as Compose resolved it, against
real Redis servers: a data plane on a Redis Cluster that is not joined yet must not
let the duplexq services start.
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos.cluster import cluster_port
from dataplane.redis_config import config_findings
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer, free_port
from tests.test_compose import (
    CLUSTER_ENV,
    ROOT,
    Config,
    compose_config,
    is_active,
    published_targets,
    volume_mounts,
)

PROFILES = ("echo", "gpu", "cluster", "metrics")
PROFILE_ENV: dict[str | None, dict[str, str]] = {"cluster": CLUSTER_ENV}
ONE_SHOT = {"redis-cluster"}
"""Services that do their job and exit 0: the cluster profile's joiner."""
METRICS_PORT = 9100
REDIS_NODES = [f"redis-node-{i}" for i in range(6)]
DUPLEXQ_COMMANDS = ("coordinator", "control", "worker")
SCRAPE_JOBS = ("duplexq-coordinator", "duplexq-workers")
"""The job names `duplexq up` writes to <workdir>/prometheus.yml
(coordinator/launcher/local_stack.py)."""


@pytest.fixture(scope="module")
def every_profile(env_file: Path) -> Config:
    """Every service of every profile (with the cluster profile's variables)."""
    return compose_config(env_file, *PROFILES, env=CLUSTER_ENV)


def started(config: Config, profile: str | None) -> dict[str, Config]:
    """The services ``docker compose [--profile P] up`` starts (docker-compose 1.29
    lists the services of inactive profiles too, so the profile rule is applied here)."""
    return {
        name: service
        for name, service in config["services"].items()
        if is_active(service) or profile in service.get("profiles", [])
    }


def role(service: Config) -> str | None:
    """``coordinator``, ``control`` or ``worker`` for a duplexq service, else None."""
    command = service.get("command") or [None]
    return str(command[0]) if command[0] in DUPLEXQ_COMMANDS else None


def option(service: Config, name: str) -> str | None:
    command = [str(part) for part in service["command"]]
    return command[command.index(name) + 1] if name in command else None


def pipeline_file(service: Config) -> Path:
    """The host file of the service's ``--pipeline /app/...`` (./configs is /app/configs)."""
    inside = option(service, "--pipeline")
    assert inside is not None and inside.startswith("/app/"), inside
    return ROOT / inside.removeprefix("/app/")


def pipeline_stages(path: Path) -> list[str]:
    return [stage["name"] for stage in tomllib.loads(path.read_text())["stages"]]


def redis_settings(service: Config) -> dict[str, str]:
    command = [str(part) for part in service["command"]]
    assert command[0] == "redis-server"
    return dict(zip(command[1::2], command[2::2], strict=False))


def healthcheck_test(service: Config) -> list[str]:
    test = service.get("healthcheck", {}).get("test")
    return [test] if isinstance(test, str) else list(test or [])


def test_every_service_has_a_healthcheck(every_profile: Config) -> None:
    for name, service in every_profile["services"].items():
        if name in ONE_SHOT:
            continue
        test = healthcheck_test(service)
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
        assert not service["healthcheck"].get("disable"), name


def test_redis_has_a_memory_limit_and_never_evicts(env_file: Path, every_profile: Config) -> None:
    services = every_profile["services"]
    for name in ["redis", *REDIS_NODES]:
        settings = redis_settings(services[name])
        assert settings["--maxmemory-policy"] == "noeviction", name
        assert settings["--maxmemory"] == "2gb", f"{name}: a limit by default, not 0 (none)"
    chosen = compose_config(env_file, "cluster", env={"DUPLEXQ_REDIS_MAXMEMORY": "8gb"})
    for name in ["redis", *REDIS_NODES]:
        assert redis_settings(chosen["services"][name])["--maxmemory"] == "8gb", name


REDIS_7_DEFAULTS = {
    "appendonly": "no",
    "appendfsync": "everysec",
    "no-appendfsync-on-rewrite": "no",
    "maxmemory-policy": "noeviction",
    "repl-diskless-sync": "yes",
    "repl-diskless-sync-delay": "5",
}
"""What Redis 7 runs with where its command line says nothing."""


def test_redis_passes_the_check_every_process_makes_at_start(every_profile: Config) -> None:
    # dataplane.redis_config: the shipped Redis and cluster nodes give no finding, not
    # even a warning.
    services = every_profile["services"]
    for name in ["redis", *REDIS_NODES]:
        given = {k.removeprefix("--"): v for k, v in redis_settings(services[name]).items()}
        found = config_findings({**REDIS_7_DEFAULTS, **given}, cluster=name != "redis")
        assert found == [], (name, [f.line for f in found])


def test_the_container_user_can_write_the_models_folder(
    env_file: Path, every_profile: Config
) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users[-1] == "duplexq"
    # The models folder exists in the image, owned by that user, and is where
    # duplexq prepares and finds models (settings.models_dir).
    assert re.search(r"install -d -o duplexq -g duplexq /models\b", dockerfile)
    assert re.search(r"^\s+DUPLEXQ_MODELS_DIR=/models\s*$", dockerfile, re.M)
    services = every_profile["services"]
    model_thinkers = {"thinker", "thinker-gpu"}
    for name, service in services.items():
        mounts = {
            (v["target"], bool(v.get("read_only"))) if isinstance(v, dict)
            else (v.split(":")[1], v.endswith(":ro"))
            for v in service.get("volumes", [])
        }  # fmt: skip
        if name not in model_thinkers:
            assert "/models" not in volume_mounts(service), f"{name} mounts /models for nothing"
            continue
        # A named volume (a fresh one takes the owner of the image's folder), writable.
        assert volume_mounts(service)["/models"] == "models", name
        assert "models" in every_profile["volumes"]
        assert ("/models", False) in mounts, f"{name}: /models must be writable"
    host = compose_config(env_file, "gpu", env={"DUPLEXQ_MODELS": "/srv/models"})
    for name in ("thinker", "thinker-gpu"):
        assert volume_mounts(host["services"][name])["/models"] == "/srv/models"


def test_the_thinker_model_is_chosen_by_a_variable_or_lies_under_models(
    env_file: Path, every_profile: Config
) -> None:
    services = every_profile["services"]
    for name in ("thinker", "thinker-gpu"):
        service = services[name]
        assert service["environment"]["HF_HUB_OFFLINE"] == "1"
        stages = tomllib.loads(pipeline_file(service).read_text())["stages"]
        (thinker,) = [stage for stage in stages if stage["name"] == "thinker"]
        model = str(thinker["options"]["model"])
        # Offline, a Hub id cannot load: a packaged model (prepared once into the
        # models folder) or a folder under the mounted /models.
        assert model.startswith(("package:", "/models/")), model
    mine = "configs/my-model.toml"
    chosen = compose_config(env_file, "gpu", env={"DUPLEXQ_PIPELINE": mine})
    for name in ("thinker", "thinker-gpu"):
        assert option(chosen["services"][name], "--pipeline") == f"/app/{mine}"


def test_the_image_installs_the_extras_the_tests_run_with(every_profile: Config) -> None:
    setup = (ROOT / "scripts/setup").read_text()
    match = re.search(r"^EXTRAS=\$\{DUPLEXQ_EXTRAS:-([\w,]+)\}$", setup, re.M)
    assert match, "scripts/setup's default extras"
    tested = set(match.group(1).split(",")) - {"dev"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    default = re.search(r"^ARG EXTRAS=(\S+)$", dockerfile, re.M)
    assert default and set(default.group(1).split(",")) == tested
    # The project is installed with those extras, as scripts/setup installs it; no
    # package is installed by name beside them (unpinned, or pinned differently).
    installs = re.findall(r"pip install ([^;\\\n]*)", dockerfile)
    assert installs and all(i.split()[-1] == '".[${EXTRAS}]"' for i in installs), installs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name, service in every_profile["services"].items():
        if "build" not in service:
            continue
        chosen = set(service["build"]["args"]["EXTRAS"].split(","))
        assert chosen <= set(extras), name
        # The GPU flavour swaps `cpu` for `gpu` (official vLLM); the rest is the same.
        assert chosen - {"gpu"} == tested - {"cpu"} or chosen == tested, name
    for requirement in extras["cpu"]:
        assert "==" in requirement, f"the tested vLLM build is pinned: {requirement}"


def test_every_worker_serves_metrics_on_an_unpublished_port(every_profile: Config) -> None:
    services = every_profile["services"]
    workers = {name: s for name, s in services.items() if role(s) == "worker"}
    coordinators = {name for name, s in services.items() if role(s) == "coordinator"}
    stages = {"vad", "asr", "thinker", "tts", "thinker-gpu", "echo-thinker", "echo-talker"}
    assert stages <= set(workers)
    for name, worker in workers.items():
        assert option(worker, "--metrics-port") == str(METRICS_PORT), name
        # Listening on the project network, not only on the container's loopback.
        assert worker["environment"]["DUPLEXQ_HOST"] == "0.0.0.0", name
        assert str(METRICS_PORT) in [str(port) for port in worker.get("expose", [])], name
        # A published port would stop `--scale` (and the metrics are not public).
        assert not worker.get("ports"), name
    scrape = yaml.safe_load((ROOT / "configs/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(SCRAPE_JOBS) <= set(jobs)
    local_stack = (ROOT / "coordinator/launcher/local_stack.py").read_text()
    assert all(f'"{job}"' in local_stack for job in SCRAPE_JOBS), "the job names of `up`"

    def discovered(job: str) -> dict[str, int]:
        found = {}
        for sd in jobs[job]["dns_sd_configs"]:
            assert sd["type"] == "A"  # every container of a scaled service
            found.update(dict.fromkeys(sd["names"], int(sd["port"])))
        return found

    assert discovered("duplexq-workers") == dict.fromkeys(workers, METRICS_PORT)
    assert discovered("duplexq-coordinator") == dict.fromkeys(coordinators, 8080)
    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["metrics"]
    config = volume_mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    assert Path(config) == ROOT / "configs/prometheus.yml"


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_each_profile_starts_only_services_that_stay_up(
    env_file: Path, profile: str | None
) -> None:
    profiles = () if profile is None else (profile,)
    config = compose_config(env_file, *profiles, env=PROFILE_ENV.get(profile, {}))
    services = started(config, profile)
    # Stacks on one Redis are told apart by their key prefix: one pipeline each.
    stacks: dict[str, dict[str, Any]] = {}
    host_ports: list[str] = []
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} needs {dependency}, not started"
        if name in ONE_SHOT:
            # Exits 0 once done; Compose restarts it only after a failure.
            assert service["restart"] == "on-failure", name
            continue
        assert service["restart"] == "unless-stopped", name
        for port in service.get("ports", []):
            published = port["published"] if isinstance(port, dict) else str(port).split(":")[-2]
            host_ports.append(str(published))
        if role(service) is None:
            continue
        path = pipeline_file(service)
        assert path.is_file(), f"{name}: no pipeline {path}"
        prefix = service["environment"].get("DUPLEXQ_KEY_PREFIX", "dq")
        stack = stacks.setdefault(prefix, {"pipelines": set(), "stages": set(), "kinds": set()})
        stack["pipelines"].add(path)
        stack["kinds"].add(role(service))
        if role(service) == "worker":
            stage = option(service, "--stage")
            # A worker of a stage its pipeline lacks exits at once, and again.
            assert stage in pipeline_stages(path), f"{name}: stage {stage} not in {path.name}"
            stack["stages"].add(stage)
    assert len(host_ports) == len(set(host_ports)), f"a host port published twice: {host_ports}"
    for prefix, stack in stacks.items():
        assert len(stack["pipelines"]) == 1, f"key prefix {prefix}: {stack['pipelines']}"
        assert stack["kinds"] == set(DUPLEXQ_COMMANDS), f"key prefix {prefix}: {stack['kinds']}"
        (path,) = stack["pipelines"]
        assert stack["stages"] == set(pipeline_stages(path)), f"key prefix {prefix}"


def test_the_echo_profile_is_a_stack_of_its_own(env_file: Path) -> None:
    config = compose_config(env_file, "echo", env={"DUPLEXQ_PIPELINE": "configs/my.toml"})
    echo = {n: s for n, s in started(config, "echo").items() if "echo" in s.get("profiles", [])}
    assert set(echo) == {"echo-coordinator", "echo-control", "echo-thinker", "echo-talker"}
    for name, service in echo.items():
        assert option(service, "--pipeline") == "/app/configs/echo.toml", name
        assert service["environment"]["DUPLEXQ_KEY_PREFIX"] == "dq-echo", name
    assert published_targets(echo["echo-coordinator"]) == [8080]


# -- the Redis healthcheck, run ----------------------------------------------------


def redis_healthcheck(config: Config) -> str:
    test = healthcheck_test(config["services"]["redis"])
    assert test[0] == "CMD-SHELL"
    # Compose hands the container `$` where the file (and `config`) says `$$`.
    return test[1].replace("$$", "$")


def run_healthcheck(script: str, tmp_path: Path, local_port: int, url: str) -> int:
    """The script as the Redis container runs it, its plain `redis-cli` (no -h)
    reaching ``local_port`` instead of the container's own 6379."""
    cli = shutil.which("redis-cli")
    assert cli, "redis-cli is not installed; run scripts/setup"
    shim = tmp_path / "bin" / "redis-cli"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -h "*) exec {cli} "$@" ;; *) exec {cli} -p {local_port} "$@" ;; esac\n'
    )
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{shim.parent}:/usr/bin:/bin", "DUPLEXQ_REDIS_URL": url}
    return subprocess.run(["sh", "-c", script], env=env, timeout=30, check=False).returncode


def test_redis_is_healthy_only_once_the_data_plane_answers(
    env_file: Path, tmp_path: Path, redis_server: RedisServer, redis_cluster: RedisCluster
) -> None:
    script = redis_healthcheck(compose_config(env_file))
    config = compose_config(env_file, "cluster", env=CLUSTER_ENV)
    assert (
        config["services"]["redis"]["environment"]["DUPLEXQ_REDIS_URL"]
        == (CLUSTER_ENV["DUPLEXQ_REDIS_URL"])
    )
    assert redis_healthcheck(config) == script
    plain = redis_server.port
    assert run_healthcheck(script, tmp_path, plain, "redis://redis:6379/0") == 0
    assert run_healthcheck(script, tmp_path, free_port(), "redis://redis:6379/0") != 0
    # A joined cluster, named by several seeds or by one (with a user, a database).
    assert run_healthcheck(script, tmp_path, plain, redis_cluster.url) == 0
    one = redis_cluster.nodes[0].port
    assert run_healthcheck(script, tmp_path, plain, f"redis+cluster://u:p@127.0.0.1:{one}/0") == 0
    # A cluster node with no slots yet (the joiner has not run): not healthy.
    lone = RedisServer(tmp_path / "lone", extra=["--cluster-enabled", "yes"])
    lone.port = cluster_port()  # its cluster bus port (port + 10000) must exist and be free
    lone.start()
    try:
        url = f"redis+cluster://127.0.0.1:{lone.port}"
        assert run_healthcheck(script, tmp_path, plain, url) != 0
    finally:
        lone.stop()
