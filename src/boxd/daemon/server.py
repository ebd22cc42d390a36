"""``boxd serve``: one uvicorn server listening on TCP and on the unix socket at once.

The unix socket ``BOXD_HOME/boxd.sock`` (mode 600) is what the local SDK and CLI use, and
the only place admin calls are served. One daemon per ``BOXD_HOME``: a lock file keeps a
second one (two SDKs starting a daemon at the same moment) from taking over.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from boxd.daemon import DEFAULT_PORT, local_key_path, logs, socket_path
from boxd.daemon.app import create_app
from boxd.daemon.auth import Keys
from boxd.daemon.idle import IdlePolicy
from boxd.daemon.machines import ClosableRuntime, ImageCache, Limits, MachineService
from boxd.daemon.store import Store
from boxd.errors import HostError

log = logging.getLogger(__name__)


@contextmanager
def _only_daemon(home: Path) -> Iterator[None]:
    with open(home / "daemon.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise HostError(f"another boxd daemon already serves {home} (pid {lock.read().strip() or '?'})") from None
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        yield


def _listen_tcp(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port))
    except OSError as error:
        raise HostError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def _listen_unix(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)  # left by a daemon that died: we hold the lock now
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(128)
    return listener


class Daemon:
    def __init__(
        self,
        home: Path,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        runtime: ClosableRuntime | None = None,
        images: ImageCache | None = None,
        limits: Limits | None = None,
        idle: IdlePolicy | None = None,
        ray_address: str | None = None,
        host_root: Path | None = None,
        host_ports: range | None = None,
    ) -> None:
        """With ``ray_address`` machines run on the hosts of that Ray cluster, each host
        keeping its state under ``host_root`` (default ``BOXD_HOME/hosts``) on its node."""
        self.home = home
        self.ray_address = ray_address
        self.host_root = host_root or home / "hosts"
        self.host_ports = host_ports
        self.host, self.port = host, port
        self._runtime = runtime
        self._images = images or ImageCache.default(home)
        self._limits = limits or Limits()
        self._idle = idle or IdlePolicy()
        self._server: uvicorn.Server | None = None

    async def serve(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _only_daemon(self.home):
            store = Store(self.home / "boxd.db")
            try:
                await self._serve(store)
            finally:
                store.close()

    async def _serve(self, store: Store) -> None:
        keys = Keys(store)
        # Written before the socket listens: whoever sees the socket answer can read the key.
        keys.ensure_local_key(local_key_path(self.home))
        unix_path = socket_path(self.home)
        listeners = [_listen_tcp(self.host, self.port), _listen_unix(unix_path)]
        self.port = listeners[0].getsockname()[1]
        store.url_format = f"http://{{name}}.localhost:{self.port}/"
        if self._runtime is None:
            # Machines reach the API through their agent, at the TCP address (which
            # serves no admin calls), never through the unix socket.
            api_host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
            self._runtime = await self._make_runtime((api_host, self.port))
        machines = MachineService(
            store, self._runtime, images=self._images, limits=self._limits, idle=self._idle, keys=keys
        )
        app = create_app(store=store, keys=keys, machines=machines, local_socket=str(unix_path))
        config = uvicorn.Config(app, log_config=None, access_log=False, proxy_headers=False, lifespan="on")
        self._server = uvicorn.Server(config)
        logs.event(log, "daemon.listening", tcp=f"{self.host}:{self.port}", socket=unix_path, pid=os.getpid())
        try:
            await self._server.serve(sockets=listeners)
        finally:
            unix_path.unlink(missing_ok=True)
            logs.event(log, "daemon.stopped", pid=os.getpid())

    async def _make_runtime(self, api_address: tuple[str, int]) -> ClosableRuntime:
        if self.ray_address is None:
            from boxd.runtime.local import LocalRuntime

            return LocalRuntime(self.home, api_address=api_address)
        try:
            from boxd.cluster.ray_runtime import RayRuntime
        except ImportError:
            raise HostError("--ray needs Ray: pip install 'boxd[ray]'") from None
        runtime = RayRuntime(self.ray_address, host_root=self.host_root, api_address=api_address,
                             daemon_home=self.home, ports=self.host_ports)
        await runtime.start()
        return runtime

    @property
    def started(self) -> bool:
        return self._server is not None and self._server.started

    def stop(self) -> None:
        """Ask the server to finish (safe from any thread); machines keep running."""
        if self._server is not None:
            self._server.should_exit = True


def run(home: Path, *, host: str, port: int, limits: Limits, idle: IdlePolicy, ray_address: str | None = None,
        host_root: Path | None = None, host_ports: range | None = None) -> None:
    logs.configure()
    daemon = Daemon(home, host=host, port=port, limits=limits, idle=idle, ray_address=ray_address,
                    host_root=host_root, host_ports=host_ports)
    asyncio.run(daemon.serve())
