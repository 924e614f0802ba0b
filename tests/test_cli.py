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
    assert f"demo page: http://127.0.0.1:{port}/?api_key=" in proc.stdout
    assert "0 stale outputs delivered" in proc.stdout
    assert "answered with" in proc.stdout and "text 'hello, who are you?" in proc.stdout
    assert "at incarnation 1" in proc.stdout
    assert (tmp_path / "logs" / "thinker-0.log").exists()


async def test_sessions_inspect(redis_server, key_prefix, capsys, monkeypatch):
    from coordinator.service import Coordinator
    from schemas.config import echo_pipeline

    settings = fast_settings(redis_server.url, key_prefix)
    coordinator = Coordinator(settings, echo_pipeline("echo"))
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
