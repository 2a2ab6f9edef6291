"""A local Prefect server with its UI (`assay ui`), and the check that one answers.

Every CLI command and served deployment talks to the server named by
PREFECT_API_URL; without it, each command starts a temporary server of its own
(20-30 s on a busy 2-core machine), and its runs vanish with it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from assay.errors import AssayError
from assay.parent_death import die_with_parent

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
                                   stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent())
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


def tie_temporary_server() -> None:
    """Make the temporary server that Prefect starts for this process, when PREFECT_API_URL names
    none, one that runs in a session of its own and gets SIGTERM when this process dies.

    Prefect starts it (lazily, at a flow's first call) in the command's process group and with no
    tie to the command. Measured with that: Ctrl-C, or `timeout`'s SIGTERM to the group, stopped
    the server first, and the command then spent minutes retrying it before it exited; a SIGTERM
    to the command alone left the server running (230 MB, a port held) with no parent. Prefect
    asks `SubprocessASGIServer()` (port None) for its server wherever it needs one; registered here
    first, the instance it gets is ours, still started when and as Prefect decides.
    """
    from prefect.server.api.server import SubprocessASGIServer

    if None not in SubprocessASGIServer._instances:
        temporary_server_class()(None)


@functools.cache
def temporary_server_class() -> type:
    """Prefect's `SubprocessASGIServer`, launched in its own session with a parent-death signal."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class TiedTemporaryServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            # Prefect's own command and environment (prefect 3.x), started apart from our group.
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
            command = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
                       "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                       "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
            # The parent-death signal follows the thread that forks: only the main thread lives as
            # long as the command (Prefect starts the server from it for a flow run).
            tied = die_with_parent() if threading.current_thread() is threading.main_thread() else None
            return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=tied)

    return TiedTemporaryServer


def stop_temporary_server() -> None:
    """Stop the temporary server now, if Prefect started one for this process: a command stopped
    by a signal ends with os._exit, and its last line must come after the server's own."""
    module = sys.modules.get("prefect.server.api.server")
    server = module.SubprocessASGIServer._instances.get(None) if module else None
    if server is not None and server.running:
        server.stop()
