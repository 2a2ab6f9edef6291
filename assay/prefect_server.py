"""A local Prefect server with its UI (`assay ui`), and the check that one answers.

Every CLI command and served deployment talks to the server named by
PREFECT_API_URL; without it, each command starts a temporary server of its own
(20-30 s on a busy 2-core machine), and its runs vanish with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from assay.errors import AssayError

# `prefect server start` takes 4-8 s on an idle machine and up to about 20 s
# on a busy one (the first start also copies the UI into PREFECT_HOME).
STARTUP_TIMEOUT_S = 120.0


def api_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/api"


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    """True when the Prefect API at URL (ending in /api) answers its health check."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as response:
            return response.status == 200 and json.loads(response.read() or b"null") is True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def require_api() -> str:
    """The running server's API URL, or a clear error saying how to get one."""
    url = configured_api_url()
    if not url:
        raise AssayError("PREFECT_API_URL is not set: start a server with `assay ui` in another terminal, "
                         "then run the `export PREFECT_API_URL=...` line it prints")
    if not is_healthy(url):
        raise AssayError(f"no Prefect server answers at PREFECT_API_URL={url}: start one with `assay ui` "
                         "(or unset PREFECT_API_URL to let each command start a temporary one)")
    return url


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


@dataclass
class LocalServer:
    """A `prefect server start` child process in its own process group."""

    process: subprocess.Popen
    url: str
    log: Path

    @property
    def address(self) -> str:
        return self.url.removesuffix("/api")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the server's process group (uvicorn and its services), then SIGKILL what is left."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        return self.process.returncode


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, SIGTERM it when `assay ui` dies, even by SIGKILL,
    so that no server outlives the command that promised to stop it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(host: str = "127.0.0.1", port: int = 4200, log: Path | None = None,
                 timeout: float = STARTUP_TIMEOUT_S) -> LocalServer:
    """Start `prefect server start` on HOST:PORT and return once /api/health answers."""
    url = api_url(host, port)
    if _port_in_use(host, port):
        if is_healthy(url):
            raise AssayError(f"a Prefect server already runs at {url.removesuffix('/api')}: use it with "
                             f"`export PREFECT_API_URL={url}`, or pick another --port")
        raise AssayError(f"port {port} on {host} is in use by something else: pick another --port")
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    log = log or home / f"assay-ui-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # Without PREFECT_SERVER_API_HOST/PORT the UI keeps calling the API on port
    # 4200, whatever --port says (measured with prefect 3.9).
    env = dict(os.environ, PREFECT_SERVER_API_HOST=host, PREFECT_SERVER_API_PORT=str(port))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.pop("PREFECT_API_URL", None)  # the server itself must not talk to another one
    prefect = Path(sys.executable).parent / "prefect"
    command = [str(prefect) if prefect.exists() else "prefect", "server", "start", "--host", host, "--port", str(port)]
    with log.open("w") as sink:
        # A new session keeps the terminal's Ctrl-C away from the server, so
        # that `assay ui` decides the order of the shutdown.
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
    server = LocalServer(process, url, log)
    deadline = time.monotonic() + timeout
    try:
        while not is_healthy(url):
            if process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                raise AssayError(f"`prefect server start` exited with code {process.returncode} before answering; "
                                 f"last lines of {log}:\n" + "\n".join(tail))
            if time.monotonic() > deadline:
                raise AssayError(f"the Prefect server did not answer {url}/health within {timeout:.0f} s; see {log}")
            time.sleep(0.25)
    except BaseException:  # Ctrl-C while waiting included: never leave a server behind
        server.stop()
        raise
    return server


def interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP end the foreground wait like Ctrl-C does, so the
    server (in its own session, out of the terminal's reach) is stopped too."""

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    # Started in the background (`assay ui &`), a shell leaves SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
