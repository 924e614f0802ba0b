"""Configuration mistakes are one actionable line and exit code 2, never a traceback;
an unreachable Redis is one line within 2 s. Each case runs the real command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.processes import ROOT
from tests.redis_server import free_port

SHIPPED = ROOT / "configs" / "default.toml"


def run(*args: str, env: dict[str, str] | None = None, module: str = "coordinator.launcher.cli"):
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done, time.monotonic() - began


def one_line(done) -> str:
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    return lines[0]


def shipped_with(tmp_path, old: str, new: str):
    text = SHIPPED.read_text()
    assert old in text
    path = tmp_path / "pipeline.toml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize(
    ("write", "says"),
    [
        (None, "config {path}: No such file or directory"),
        ('name = "x\n', "config {path}: malformed TOML: Illegal character"),
        (
            lambda tmp: shipped_with(tmp, 'backend = "asr"', 'backend = "whisper"'),
            "pipeline {path}: stages.1.backend: must be one of 'echo', 'vllm'",
        ),
        (
            lambda tmp: shipped_with(tmp, "max_tokens = 96", "max_tokns = 96"),
            "pipeline {path}: vllm stage 'thinker': bad options: max_tokns: Extra inputs",
        ),
        (
            lambda tmp: shipped_with(tmp, "max_tokens = 96", "max_tokens = 4096"),
            "vllm stage 'thinker': bad options: options: Value error, "
            "max_tokens (4096) must be below",
        ),
    ],
    ids=["missing", "malformed", "unknown-backend", "unknown-vllm-option", "bad-vllm-budget"],
)
def test_up_refuses_a_bad_pipeline_in_one_line_before_starting_anything(tmp_path, write, says):
    if write is None:
        path = tmp_path / "missing.toml"
    elif isinstance(write, str):
        path = tmp_path / "pipeline.toml"
        path.write_text(write)
    else:
        path = write(tmp_path)
    workdir = tmp_path / "work"
    done, _ = run("up", "--pipeline", str(path), "--workdir", str(workdir), "--port", "0")
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("duplexq up: error: ")
    assert says.format(path=path) in line, line
    assert "Tuple should have" not in line
    assert not workdir.exists()  # nothing started, nothing written


def test_an_unknown_setting_and_a_bad_variable_are_one_line(tmp_path):
    settings = tmp_path / "settings.toml"
    settings.write_text('redis_urll = "redis://x"\n')
    done, _ = run("sessions", "--settings", str(settings))
    assert done.returncode == 2
    assert (
        one_line(done)
        == f"duplexq sessions: error: settings {settings}: redis_urll: unknown setting"
    )
    done, _ = run("sessions", env={"DUPLEXQ_LEASE_TTL_MS": "soon"})
    assert done.returncode == 2
    assert "DUPLEXQ_* environment): lease_ttl_ms: Input should be a valid integer" in one_line(done)


def test_a_worker_of_a_stage_the_pipeline_lacks_is_one_line():
    done, _ = run(
        "--stage", "vad", "--pipeline", str(ROOT / "configs" / "echo.toml"), module="workers"
    )
    assert done.returncode == 2
    assert one_line(done) == (
        f"error: stage 'vad' is not in pipeline {ROOT / 'configs' / 'echo.toml'} "
        "(its stages: thinker, talker)"
    )


def test_the_shipped_pipelines_pass_the_check():
    for name in ("default", "echo", "mage_vl", "minicpmo45"):
        done, _ = run(
            "--check", "--pipeline", str(ROOT / "configs" / f"{name}.toml"), module="workers"
        )
        assert done.returncode == 0, (name, done.stderr)


@pytest.mark.parametrize("command", [["sessions"], ["sessions", "s1"], ["replay", "a", "b"],
                                     ["control", "--burst"]])  # fmt: skip
def test_a_command_says_within_2_s_that_redis_is_unreachable(command):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    done, elapsed = run(*command, "--redis-url", url)
    assert done.returncode == 1
    assert one_line(done) == (
        f"duplexq {command[0]}: error: cannot reach Redis at {url}: no answer within 1.5 s"
    )
    # The process as a whole, interpreter start included: a generous bound, not a timing.
    assert elapsed < 2 + 3, elapsed


@pytest.mark.parametrize(
    ("command", "module"),
    [
        (["sessions"], "coordinator.launcher.cli"),
        (["replay", "a", "b"], "coordinator.launcher.cli"),
        (["control", "--burst"], "coordinator.launcher.cli"),
        (["coordinator"], "coordinator.launcher.cli"),
        (["down"], "coordinator.launcher.cli"),
        (["--stage", "thinker"], "workers"),
        (["up", "--pipeline", str(ROOT / "configs" / "echo.toml")], "coordinator.launcher.cli"),
    ],
    ids=["sessions", "replay", "control", "coordinator", "down", "worker", "up"],
)
def test_an_unknown_duplexq_variable_is_one_line_and_exit_2(tmp_path, command, module):
    workdir = tmp_path / "work"
    extra = ["--workdir", str(workdir)] if module == "coordinator.launcher.cli" else []
    env = {"DUPLEXQ_LEASE_TTL": "abc", "DUPLEXQ_NO_SUCH": "1"}
    done, _ = run(*command, *extra, env=env, module=module)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done)
    assert line.endswith(
        "unknown environment variables DUPLEXQ_LEASE_TTL (did you mean "
        "DUPLEXQ_LEASE_TTL_MS?), DUPLEXQ_NO_SUCH; settings are DUPLEXQ_<FIELD>, for the "
        "fields in schemas/config.py"
    ), line
    assert not workdir.exists()  # nothing started


def test_every_duplexq_variable_the_repository_uses_is_known():
    """The scripts, the compose file, the benchmarks and the tests set or read
    ``DUPLEXQ_*`` variables of their own: a process they start must not refuse them."""
    import re

    from schemas.config import unknown_variables

    constants = {"DUPLEXQ_SERVICES", "DUPLEXQ_COMMANDS"}  # names of tests' own tuples
    constants |= {"DUPLEXQ_LEASE_TTL", "DUPLEXQ_NO_SUCH"}  # unknown on purpose, above
    used: set[str] = set()
    for folder in ("scripts", "bench", "tests", "workers", "coordinator", "dataplane", "chaos"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh"):
                used |= set(re.findall(r"DUPLEXQ_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    for path in (ROOT / "docker-compose.yml", ROOT / "Dockerfile"):
        used |= set(re.findall(r"DUPLEXQ_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert "DUPLEXQ_FAILPOINT" in used and "DUPLEXQ_EXTRAS" in used
    assert unknown_variables(dict.fromkeys(used - constants, "1")) == []
