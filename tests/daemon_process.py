"""``boxd serve`` as a user runs it, for the tests that drive a whole daemon with real VMs.

Each daemon gets its own BOXD_HOME (a short temp path, for its unix socket) and TCP
port; the guest image is shared through ``image_home``. Every VM the daemon made is
deleted when it stops, pass or fail, straight through the runtime, so that a dead
daemon cannot leak one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from conftest import failed, image_home

from boxd import Boxd
from boxd.config import images_dir, shm_dir, vms_dir
from boxd.daemon import local_key_path, log_path
from boxd.errors import NotFound


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class DaemonProcess:
    """``boxd serve`` as a user runs it, in a process of its own session."""

    def __init__(self, home: Path, serve_args: tuple[str, ...] = ()) -> None:
        self.home = home
        self.serve_args = serve_args
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self.env = {**os.environ, "BOXD_HOME": str(home)}
        for name in ("BOXD_URL", "BOXD_API_KEY"):
            self.env.pop(name, None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(log_path(self.home), "ab") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "boxd", "serve", "--port", str(self.port), *self.serve_args],
                env=self.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the daemon exited:\n{self.log()}"
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the daemon did not answer:\n{self.log()}")

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def log(self) -> str:
        return log_path(self.home).read_text(errors="replace")[-6000:]

    def cli(
        self, *args: str, key: str | None = None, check: bool = True, answer: str = ""
    ) -> subprocess.CompletedProcess:
        """``boxd ARGS...``: the embedded default (local socket and key) unless ``key``;
        ``answer`` is what it reads on its standard input."""
        env = dict(self.env)
        if key is not None:
            env.update(BOXD_URL=self.url, BOXD_API_KEY=key)
        done = subprocess.run(
            [sys.executable, "-m", "boxd", *args], env=env, capture_output=True, text=True, timeout=600, input=answer
        )
        if check:
            assert done.returncode == 0, f"boxd {' '.join(args)} exited {done.returncode}: {done.stderr}"
        return done

    def local_key(self) -> str:
        return local_key_path(self.home).read_text().strip()

    def sdk(self, key: str | None = None) -> Boxd:
        """A client over TCP, as from another process on the network would connect."""
        return Boxd(api_key=key or self.local_key(), base_url=self.url)


def _delete_every_vm(home: Path) -> None:
    from boxd.runtime.local import LocalRuntime

    async def sweep() -> None:
        runtime = LocalRuntime(home)
        for vm_dir in vms_dir(home).glob("*"):
            try:
                await runtime.delete(vm_dir.name)
            except NotFound:
                pass
        await runtime.close()

    asyncio.run(sweep())


def print_log_if_failed(request, daemon: DaemonProcess) -> None:
    if failed(request):
        print(f"\n--- daemon log of {request.node.nodeid} ---\n{daemon.log()}")


@contextlib.contextmanager
def running_daemon(prefix: str, *serve_args: str, homes: Callable[[Path], list[Path]] | None = None
                   ) -> Iterator[DaemonProcess]:
    """A daemon in a fresh home; ``homes(home)`` names the state folders its machines may
    be in besides that home (those of the host agents of a cluster), to be swept too."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    # The image is built once per host (guest_image); this home only points at it.
    images_dir(home).symlink_to(images_dir(image_home()), target_is_directory=True)
    process = DaemonProcess(home, serve_args)
    try:
        process.start()
        yield process
    finally:
        process.stop()
        for state in [home, *(homes(home) if homes else [])]:
            _delete_every_vm(state)
            shutil.rmtree(shm_dir(state), ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
