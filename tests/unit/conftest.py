"""Fixtures of the control-plane unit tests: the real app and store over a FakeRuntime."""

from __future__ import annotations

import pytest
from fakes import ControlPlane


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def plane(tmp_path):
    plane = ControlPlane(tmp_path)
    yield plane
    await plane.close()


@pytest.fixture
async def alice(plane):
    """An HTTP client with a key of the account alice."""
    async with plane.http(plane.key_for("alice")) as client:
        yield client
