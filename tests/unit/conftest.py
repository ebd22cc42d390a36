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
