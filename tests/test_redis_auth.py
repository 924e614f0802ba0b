"""Redis URLs with an ACL user and password, over TLS (``rediss://``)."""

import shutil
import subprocess
import time

import redis

from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from schemas.keys import Keys
from tests.redis_server import free_port


def _tls_server(tmp_path):
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
         str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"), "-days", "1",
         "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", "0",
         "--tls-port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
         "--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file",
         str(tmp_path / "key.pem"), "--tls-ca-cert-file", str(tmp_path / "cert.pem"),
         "--tls-auth-clients", "no", "--save", "",
         "--user", "default", "off",
         "--user", "duplexq", "on", ">s3cret", "~*", "&*", "+@all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = (
        f"rediss://duplexq:s3cret@127.0.0.1:{port}/0"
        f"?ssl_ca_certs={tmp_path / 'cert.pem'}&ssl_check_hostname=false"
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url, port
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


async def test_acl_user_over_tls(tmp_path):
    proc, url, port = _tls_server(tmp_path)
    bus = RedisBus(url, Keys("tls"))
    try:
        authority = SessionAuthority(bus, echo_pipeline())
        await authority.open("s1")
        receipt = await authority.append("s1", "append_text", TextPayload("secure"))
        assert receipt.seq == 1
        # The wrong password and a plain-text connection are both refused.
        bad = RedisBus(url.replace("s3cret", "wrong"), Keys("tls"), command_timeout=1)
        assert not await bad.ping()
        await bad.aclose()
        plain = RedisBus(f"redis://duplexq:s3cret@127.0.0.1:{port}/0", command_timeout=1)
        assert not await plain.ping()
        await plain.aclose()
    finally:
        await bus.aclose()
        proc.terminate()
        proc.wait(10)
