"""Shared fixtures: one guest image per session, and machines that are always cleaned up.

VM tests drive the async runtime from synchronous tests through one event loop that
runs in a thread for the whole session (the runtime's connections belong to a loop).
Every machine a test makes is deleted at teardown, pass or fail; a failed test's
console logs are kept under ``artifacts/console/<test>/`` and their paths printed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def image_home() -> Path:
    """Where the test image is built: kept between runs so it is built once per machine."""
    return Path(os.environ.get("BOXD_TEST_IMAGE_HOME", Path.home() / ".cache" / "boxd-test")).resolve()


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(request.node, f"report_{phase}", None) is not None
        and getattr(request.node, f"report_{phase}").failed
        for phase in ("setup", "call")
    )


@pytest.fixture(scope="session")
def loop_thread():
    runner = LoopThread()
    yield runner
    runner.stop()


@pytest.fixture(scope="session")
def guest_image():
    from boxd.guest.image import ImageRecipe, ensure_image

    return ensure_image(ImageRecipe(), home=image_home())


@pytest.fixture(scope="session")
def runtime_home(tmp_path_factory):
    return tmp_path_factory.mktemp("boxd-home")


@pytest.fixture(scope="session")
def runtime(loop_thread, runtime_home):
    from boxd.runtime.local import LocalRuntime

    async def make():
        return LocalRuntime(runtime_home)

    local = loop_thread.run(make())
    yield local
    loop_thread.run(local.close())


def keep_consoles(request: pytest.FixtureRequest, consoles: list[Path]) -> None:
    destination = ARTIFACTS / "console" / request.node.name
    destination.mkdir(parents=True, exist_ok=True)
    for console in consoles:
        if console.exists():
            shutil.copy(console, destination / f"{console.parent.name}.log")
    print(f"\nconsole logs of {request.node.nodeid}: {destination}")


@pytest.fixture
def machines(request, runtime, loop_thread, guest_image):
    """A factory: ``machines.new(**spec)`` boots a ready machine and tracks it."""
    from boxd.errors import NotFound
    from boxd.runtime.interface import VMSpec

    test_tag = request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[-24:].strip("-")

    class Factory:
        def __init__(self) -> None:
            self.made: list[str] = []

        def id_for(self) -> str:
            return f"t{len(self.made)}-{os.getpid() % 10000}-{test_tag}".lower()[:60].rstrip("-")

        def new(self, ready: bool = True, **spec: Any) -> str:
            vm_id = self.id_for()
            self.made.append(vm_id)
            loop_thread.run(runtime.create(vm_id, VMSpec(image=str(guest_image.path), **spec)))
            if ready:
                loop_thread.run(runtime.wait_ready(vm_id, timeout=120))
            return vm_id

        def new_many(self, *specs: dict[str, Any]) -> list[str]:
            """Machines that boot side by side (TCG runs each guest on a core of its own)."""
            vm_ids = [self.new(ready=False, **spec) for spec in specs]

            async def all_ready() -> None:
                await asyncio.gather(*(runtime.wait_ready(vm_id, timeout=120) for vm_id in vm_ids))

            loop_thread.run(all_ready())
            return vm_ids

        def track(self, vm_id: str) -> str:
            self.made.append(vm_id)
            return vm_id

        def run(self, coroutine, timeout: float | None = 600):
            return loop_thread.run(coroutine, timeout)

    factory = Factory()
    yield factory
    if failed(request):
        keep_consoles(request, [runtime.console_log(vm_id) for vm_id in factory.made])
    for vm_id in factory.made:
        try:
            loop_thread.run(runtime.delete(vm_id), timeout=60)
        except NotFound:  # the test deleted it already, or it was never created
            pass
