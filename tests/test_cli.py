"""The command line: ``duplexq up`` end to end, and session inspection."""

import subprocess
import sys

from coordinator.launcher.cli import build_parser, main
from schemas.events import TextPayload
from tests.pipeline_helpers import fast_settings
from tests.processes import ROOT, settings_env
from tests.redis_server import free_port


def test_up_runs_the_stack_and_its_demonstration(tmp_path):
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.launcher.cli",
            "up",
            "--demo-only",
            "--port",
            str(port),
            "--pipeline",
            str(ROOT / "configs" / "echo.toml"),
            "--workdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demonstration passed" in proc.stdout
    # The run's key is in a file only its owner reads, never in a URL or a printed line.
    key = (tmp_path / "api_key").read_text().strip()
    assert (tmp_path / "api_key").stat().st_mode & 0o077 == 0
    assert f"demo page: http://127.0.0.1:{port}/ (API key for this run: in " in proc.stdout
    assert key not in proc.stdout + proc.stderr and "api_key=" not in proc.stdout
    assert "0 stale outputs delivered" in proc.stdout
    assert "answered with" in proc.stdout and "text 'hello, who are you?" in proc.stdout
    assert "at incarnation 1" in proc.stdout
    # The failover's killed worker was replaced: the stack keeps its two per stage.
    import re

    assert re.search(r"^failover: started thinker-2 in thinker-[01]'s place$", proc.stdout, re.M)
    assert (tmp_path / "logs" / "thinker-2.log").exists()
    assert (tmp_path / "logs" / "thinker-0.log").exists()


async def test_sessions_inspect(redis_server, key_prefix, capsys, monkeypatch, tmp_path):
    from coordinator.service import Coordinator
    from schemas.config import echo_pipeline
    from tests.processes import write_pipeline

    # The pipeline comes from the settings (DUPLEXQ_PIPELINE), as for every command.
    pipeline = echo_pipeline("echo")
    settings = fast_settings(redis_server.url, key_prefix)
    settings = settings.model_copy(update={"pipeline": str(write_pipeline(tmp_path, pipeline))})
    coordinator = Coordinator(settings, pipeline)
    try:
        await coordinator.open("sx")
        await coordinator.append("sx", "append_text", TextPayload("a"))
    finally:
        await coordinator.aclose()
    for key, value in settings_env(settings).items():
        monkeypatch.setenv(key, value)
    # main() runs its own event loop: call it from a thread.
    import asyncio

    assert await asyncio.to_thread(main, ["sessions"]) == 0
    assert "sx" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["sessions", "sx"]) == 0
    out = capsys.readouterr().out
    assert "fence sx/i0/e0/t0/r0, 1 inputs" in out
    assert "echo" in out and "1" in out
    assert await asyncio.to_thread(main, ["sessions", "nope"]) == 1


def test_parser_knows_its_commands():
    parser = build_parser()
    assert parser.parse_args(["worker", "--stage", "a"]).stage == "a"
    assert parser.parse_args(["up", "--demo-only"]).demo_only


def test_a_worker_started_by_the_cli_serves_its_metrics(redis_server, key_prefix, tmp_path):
    import os
    import time
    import urllib.request

    from schemas.config import echo_pipeline
    from tests.processes import write_pipeline

    settings = fast_settings(redis_server.url, key_prefix)
    port = free_port()
    pipeline = write_pipeline(tmp_path, echo_pipeline("echo"))
    args = [sys.executable, "-m", "coordinator.launcher.cli", "worker", "--stage", "echo",
            "--pipeline", str(pipeline), "--metrics-port", str(port)]  # fmt: skip
    env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(ROOT)}
    log = tmp_path / "worker.log"
    with log.open("wb") as sink:
        worker = subprocess.Popen(args, cwd=ROOT, env=env, stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read().decode()
                break
            except OSError:
                assert worker.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "no /metrics within 30 s"
                time.sleep(0.2)
        assert "duplexq_" in body
    finally:
        worker.terminate()
        worker.wait(20)


def test_the_coordinator_logs_its_start_and_each_request_without_query_strings(
    redis_server, key_prefix, tmp_path
):
    import json
    import os
    import time
    import urllib.request

    from schemas.config import echo_pipeline
    from tests.processes import write_pipeline

    settings = fast_settings(redis_server.url, key_prefix)
    port = free_port()
    pipeline = write_pipeline(tmp_path, echo_pipeline("echo"))
    args = [sys.executable, "-m", "coordinator.launcher.cli", "coordinator",
            "--pipeline", str(pipeline), "--port", str(port)]  # fmt: skip
    env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(ROOT)}
    log = tmp_path / "coordinator.log"
    with log.open("wb") as sink:
        coordinator = subprocess.Popen(args, cwd=ROOT, env=env, stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                url = f"http://127.0.0.1:{port}/healthz?api_key=s3cret&x=1"
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                assert coordinator.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "no /healthz within 30 s"
                time.sleep(0.2)
    finally:
        coordinator.terminate()
        coordinator.wait(20)
    text = log.read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # every line is a JSON log line
    messages = [line["msg"] for line in lines]
    assert any(
        m.startswith(f"coordinator serving pipeline echo (echo) on http://127.0.0.1:{port}")
        for m in messages
    ), messages
    assert any('"GET /healthz HTTP/1.1" 200' in m for m in messages), messages
    assert "s3cret" not in text and "?" not in text


def duplexq(*args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "coordinator.launcher.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_commands_beside_up_find_its_stack_and_down_stops_it(tmp_path):
    """Run from the directory where ``up`` runs (its workdir is ``var`` there), a command
    with no Redis configured uses the stack's; a second ``up`` refuses in one line; ``down``
    stops the stack and returns once it is gone."""
    import os
    import re

    from tests.test_up import alive, descendants, wait_serving

    echo = str(ROOT / "configs" / "echo.toml")
    up = subprocess.Popen(
        [sys.executable, "-m", "coordinator.launcher.cli", "up", "--pipeline", echo,
         "--port", str(free_port()), "--no-demo"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = wait_serving(up)
        url = re.search(r"redis://127\.0\.0\.1:\d+/0", lines[0]).group(0)
        stack = descendants(up.pid)
        sessions = duplexq("sessions", cwd=tmp_path)
        assert sessions.returncode == 0, sessions.stderr
        assert sessions.stderr.splitlines() == [
            f"duplexq sessions: using the stack running in {tmp_path / 'var'} "
            f"(pid {up.pid}, {lines[4].split()[2].rstrip('/')}, Redis at {url})",
            f"no open sessions in Redis at {url}",
        ]
        # The same from elsewhere, naming the workdir.
        inspect = duplexq("sessions", "--workdir", str(tmp_path / "var"), "nope", cwd=ROOT)
        assert inspect.returncode == 1 and f"Redis at {url})" in inspect.stderr
        # A Redis that is configured wins over the stack's.
        mine = f"redis://127.0.0.1:{free_port()}/0"
        other = duplexq("sessions", cwd=tmp_path, env={"DUPLEXQ_REDIS_URL": mine})
        assert other.returncode == 1 and "using the stack" not in other.stderr
        assert f"cannot reach Redis at {mine}" in other.stderr
        again = duplexq("up", "--pipeline", echo, "--port", str(free_port()), cwd=tmp_path)
        assert again.returncode == 1 and again.stdout == ""
        assert again.stderr.strip() == (
            f"duplexq up: error: a stack is already running in {tmp_path / 'var'} "
            f"(pid {up.pid}, {lines[4].split()[2].rstrip('/')}, Redis at {url}); "
            "stop it with: duplexq down --workdir var"
        )
        down = duplexq("down", cwd=tmp_path)
        assert down.returncode == 0, down.stderr
        assert down.stdout.splitlines()[-1] == f"stopped the stack in {tmp_path / 'var'}"
        # down returned once up let go of its workdir: up and all of its stack are gone.
        assert up.wait(5) == 0
        assert not [pid for pid in stack if alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()
        up.communicate(timeout=30)
    assert not (tmp_path / "var" / "up.json").exists()
    gone = duplexq("down", cwd=tmp_path)
    assert gone.returncode == 1
    assert gone.stderr.strip() == f"duplexq down: no stack is running in {tmp_path / 'var'}"
