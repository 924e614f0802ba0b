"""The command line: ``duplexq up`` end to end, and session inspection."""

import subprocess
import sys

from coordinator.cli import build_parser, main
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
            "coordinator.cli",
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
    args = [sys.executable, "-m", "coordinator.cli", "worker", "--stage", "echo",
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
    args = [sys.executable, "-m", "coordinator.cli", "coordinator", "--pipeline", str(pipeline),
            "--port", str(port)]  # fmt: skip
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
