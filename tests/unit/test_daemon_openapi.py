"""Property test: requests generated from /openapi.json never make the daemon answer 5xx."""

from __future__ import annotations

import pytest
from fakes import FakeRuntime, daemon_thread, short_home
from hypothesis import HealthCheck, settings

from boxd.daemon import local_key_path
from boxd.daemon.machines import Limits
from boxd.runtime.agent_client import ExecEvent

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402


class InertRuntime(FakeRuntime):
    """Generated commands must not run on the host: every one just exits 0."""

    async def exec(self, vm_id, request):
        self._vm(vm_id)
        yield ExecEvent("started", pid=1)
        yield ExecEvent("exit", exit_code=0)


@pytest.fixture(scope="module")
def served():
    homes = short_home()
    home = next(homes)
    with daemon_thread(home, InertRuntime(), limits=Limits(ready_timeout_s=2)) as daemon:
        yield f"http://127.0.0.1:{daemon.port}", local_key_path(home).read_text().strip()
    homes.close()


@pytest.fixture(scope="module")
def api_schema(served):
    base_url, _ = served
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_makes_a_server_error(case, served):
    base_url, key = served
    response = case.call(base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=10)
    case.validate_response(response, checks=[not_a_server_error])
