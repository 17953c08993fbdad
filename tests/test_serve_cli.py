"""`./check.sh serve` and `./check.sh bench --serve` (e06) on the CPU with the offline dummy model."""

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from course.grader import registry, select

MISSING = registry.get("e06").missing_packages
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"e06 needs {', '.join(MISSING)}")


def test_bench_serve_smoke(tmp_path):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "course", "bench", "--serve", "--requests", "8", "--clients", "4",
                          "--min-out", "4", "--max-out", "8", "--max-pending", "2"],
                         cwd=select.ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for fragment in ("离线 LLM.generate", "HTTP（4 个流式客户端）", "TTFT p50", "错误 0 个"):
        assert fragment in out.stdout, (fragment, out.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_allowed_hosts():
    from course.runtime.serve import allowed_hosts
    assert allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("::1", ["My.Box"]) == ("localhost", "127.0.0.1", "[::1]", "my.box")
    assert allowed_hosts("10.0.0.5") == ("localhost", "127.0.0.1", "[::1]", "10.0.0.5")
    assert allowed_hosts("fd00::5")[-1] == "[fd00::5]"
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None    # every interface: any name


FILES = 256                    # the server's open-file limit: 1,000 idle sockets would exhaust it


def _low_file_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))


def _stream(port: int, max_tokens: int):
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"model": "qwen3-tiny-dummy", "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer sesame\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _read_all(sock) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_serve_api_key_warning_and_bounded_shutdown(tmp_path):
    """--host 0.0.0.0 warns, --api-key is enforced; with 256 open files 1,000 idle sockets leave /health up; Ctrl-C
    ends each running stream with an error event and [DONE], and returns even while a client has half-sent a body."""
    import httpx
    from course.runtime.serve import GRACEFUL_SHUTDOWN_S
    port = _free_port()
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "course", "serve", "--host", "0.0.0.0", "--port", str(port),
                             "--api-key", "sesame"], cwd=select.ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_low_file_limit)
    url, half, idle, streams = f"http://127.0.0.1:{port}", None, [], []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        for _ in range(1000):                      # idle sockets: connected, never a byte sent
            idle.append(socket.create_connection(("127.0.0.1", port)))
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200, health.text
        streams = [_stream(port, 100000 // 100) for _ in range(2)]
        for sock in streams:                       # both streams are running before the Ctrl-C
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer sesame\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        for sock in streams:
            frames = re.findall(rb"data: (.*?)\n\n", _read_all(sock))
            assert frames[-1] == b"[DONE]" and b"server_shutting_down" in frames[-2], frames[-3:]
        out, _ = proc.communicate(timeout=GRACEFUL_SHUTDOWN_S + 30)
        assert time.monotonic() - start < GRACEFUL_SHUTDOWN_S + 15, out[-2000:]
        assert "警告" in out and "0.0.0.0" in out, out[-2000:]
    finally:
        for sock in [*idle, *streams]:
            sock.close()
        if half is not None:
            half.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
