"""A fork server for grading many files in a row (`./check.sh mutants`, the selftest's plants and contract seeds).

Every grading normally starts a fresh `python -m pytest`, and importing torch and transformers (with the model
classes the checks take from it) is most of its cost (~5 s on a 2-core machine, more than the checks that kill a
mutant; measured 2026-12-06: a grading that runs no check took 5.3 s forked from a server that had imported the
top-level packages only, 0.4 s once the imported names were looked up too). The server imports them once; for
each grading it forks a child that becomes exactly the process `run_checks` would have started: its own session
(so `_kill_group` ends it and whatever it starts), the grading's working directory, environment and log file,
then `pytest.main` with the same arguments. Nothing of the exercise, the checks or `impl` is imported before the
fork, so each child loads the graded file and the checks afresh.

    server = ForkServer(check_file, ...)   # starts `python -m course.grader.forkserver SOCKET CHECK_FILE ...`
    run_checks(ex, selection, spawn=server.spawn)
    server.close()
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import select as _select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the environment run_checks gives every check process, fixed before torch and transformers are imported
_IMPORT_ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


class ForkServer:
    """The client side: starts the server and hands `run_checks` a `spawn` that forks from it."""

    def __init__(self, *check_files: Path):
        self._dir = tempfile.TemporaryDirectory(prefix="course-forkserver-")
        self.path = str(Path(self._dir.name) / "sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "course.grader.forkserver", self.path, *map(str, check_files)],
                                     env={**os.environ, **_IMPORT_ENV}, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start (exit code {self.proc.poll()})")
            time.sleep(0.05)

    def spawn(self, cmd: list[str], cwd, env: dict[str, str], stdout) -> "_Forked":
        return _Forked(self.path, cmd, str(cwd), env, stdout)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._dir.cleanup()


class _Forked:
    """What run_checks uses of a subprocess.Popen (pid, poll, wait, returncode), for a child of the server."""

    def __init__(self, path: str, cmd: list[str], cwd: str, env: dict[str, str], stdout):
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        request = json.dumps({"argv": cmd[3:], "cwd": cwd, "env": env}).encode() + b"\n"   # cmd: python -m pytest ...
        socket.send_fds(self._sock, [request], [stdout.fileno()])
        self._buf = b""
        self.pid = int(self._line(block=True))

    def _line(self, block: bool) -> str | None:
        while b"\n" not in self._buf:
            if not block and not _select.select([self._sock], [], [], 0)[0]:
                return None
            chunk = self._sock.recv(4096)
            if not chunk:
                raise RuntimeError("the fork server went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(block=False)
            if line is not None:
                self.returncode = int(line)
                self._sock.close()
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = int(self._line(block=True))
            self._sock.close()
        return self.returncode


def _third_party_imports(check_files: list[Path]) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every third-party import, anywhere in a function or at the top, of the
    check files, the course's own modules they reach (checks.*, course.*) and the reference solutions: read from
    their source (ast), none of the course's own modules imported."""
    root = check_files[0].resolve().parent.parent
    files, seen, found = [*(f.resolve() for f in check_files), *sorted((root / "solutions").glob("*.py"))], set(), []
    while files:
        path = files.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                pairs = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(node.module, [a.name for a in node.names if a.name != "*"])]
            else:
                continue
            for module, names in pairs:
                top = module.split(".")[0]
                if top in ("checks", "course"):
                    base = root.joinpath(*module.split("."))
                    files += [base.with_suffix(".py"), base / "__init__.py",
                              *(base / f"{n}.py" for n in names)]
                elif top not in ("impl", "solutions", "mine"):
                    found.append((module, names))
    return found


def _preload(check_files: list[Path]) -> None:
    """Import what every check process imports: torch, pytest and the third-party modules that the check files, the
    course modules they use and the reference solutions import (transformers loads its model classes lazily, on the
    first attribute access: a `from transformers import Qwen3Config` costs ~4 s of a 2-core machine, so the
    imported names are looked up too). An import that fails here fails again, with its message, in the child."""
    import torch
    if not torch.cuda.is_available():          # checks/conftest.py does the same before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    for module, names in _third_party_imports(check_files):
        try:
            mod = importlib.import_module(module)
            for name in names:
                getattr(mod, name, None)
        except Exception:              # a package this machine lacks (the check reports it), or a broken one
            pass


def _child(conn: socket.socket, fd: int, request: dict) -> None:
    """In the forked child: become the check process run_checks would have started, run pytest, exit."""
    import pytest
    try:
        conn.close()
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = ["pytest", *request["argv"]]
        code = pytest.main(request["argv"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


def serve(path: str, check_files: list[Path]) -> None:
    _preload(check_files)
    gc.freeze()        # what is imported now is shared by every child: their collections skip it (pytest's
    #                    unconfigure collects twice, ~0.5 s over a heap that holds torch and transformers)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)            # the client waits for the socket to appear: ready only now
    children: dict[int, socket.socket] = {}
    while True:
        if _select.select([listener], [], [], 0.02)[0]:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
            while not msg.endswith(b"\n"):
                msg += conn.recv(1 << 20)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _child(conn, fds[0], json.loads(msg))
            os.close(fds[0])
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], [Path(a) for a in sys.argv[2:]])
