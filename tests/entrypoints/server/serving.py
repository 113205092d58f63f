"""A real ``guidespec serve`` process for the server's tests: started, waited for, stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str

    def log(self) -> str:
        """Its output so far (stdout and stderr), once it has exited."""
        return self.process.stdout.read() if self.process.stdout and self.process.poll() is not None else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(*args: str, timeout_s: float = 240) -> Server:
    """``guidespec serve --api-key KEY <args>`` on a free port, once ``/health`` answers 200."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "guidespec.entrypoints.cli", "serve", "--port", str(port), "--api-key", KEY, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    server = Server(process, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while not healthy(server.url):
        if process.poll() is not None:
            raise RuntimeError(f"guidespec serve exited: {server.log()}")
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"guidespec serve did not become healthy in {timeout_s:.0f} s")
        time.sleep(0.3)
    return server


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_server(server: Server, sig: int = signal.SIGINT) -> None:
    if server.process.poll() is None:
        server.process.send_signal(sig)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def engine_processes(server_pid: int) -> dict[int, str]:
    """The engine's processes under the server, and theirs: pid -> name (``gs-scheduler``,
    ``gs-worker0``, the scheduler's grammar compile process ``gs-compile``). The zygote they are
    forked from (``gs-zygote``) is the server's, serving every engine it starts: not listed."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if rest[0] != "Z":
            pid = int(stat.parent.name)
            names[pid] = name
            children.setdefault(int(rest[1]), []).append(pid)
    found: dict[int, str] = {}
    stack = [pid for pid in children.get(server_pid, []) if names[pid].startswith("gs-")]
    while stack:  # (the server's other children, e.g. multiprocessing's resource tracker, are its own)
        pid = stack.pop()
        if names[pid] != "gs-zygote":
            found[pid] = names[pid]
        stack.extend(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shared_files() -> set[str]:
    """Shared-memory segments and ipc socket files of guidespec engines on this machine."""
    return {str(p) for p in Path("/dev/shm").glob("guidespec-*")} | {
        str(p) for p in Path(tempfile.gettempdir()).glob("guidespec-*")
    }
