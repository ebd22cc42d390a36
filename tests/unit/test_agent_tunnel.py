"""Tunnels: connections made to a port in the guest, carried by the agent to the host.

The agent runs on the host here (see ``test_agent_protocol``), so its listener is a
port on the host's loopback; the tunnel's target is a small service in the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time

import pytest
from test_agent_protocol import agent_socket, collect, run  # noqa: F401  (agent_socket: a fixture)

from boxd.errors import Conflict, InvalidInput
from boxd.guest.agent import READ_CHUNK
from boxd.guest.agent import TUNNEL_WINDOW as GUEST_WINDOW
from boxd.runtime.agent_client import TUNNEL_CHUNK, TUNNEL_WINDOW, AgentClient
from boxd.runtime.qemu import free_port

WAIT = 10  # seconds anything here may take before the test counts it as hung


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


class Target:
    """The host-side service tunnels lead to; notes when each connection to it ends."""

    def __init__(self, serve=echo) -> None:
        self.serve = serve
        self.ended = 0
        self.ended_event = asyncio.Event()

    async def start(self) -> Target:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.serve(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.ended += 1
            self.ended_event.set()

    def connect(self):
        return asyncio.open_connection("127.0.0.1", self.port)

    def close(self) -> None:
        self.server.close()


@contextlib.asynccontextmanager
async def tunneled(agent_socket, serve=echo, connect=None):
    """A connected client serving tunnels from a fresh guest port to a ``Target`` (or to ``connect``)."""
    target = await Target(serve).start()
    client = AgentClient(agent_socket.path, name="t")
    await client.connect(30)
    port = free_port()
    await client.serve_tunnels(port, connect or target.connect)
    try:
        yield client, port, target
    finally:
        await client.close()
        target.close()


async def guest_connection(port: int):
    """A client inside the "guest", connecting to the tunnel's port there."""
    return await asyncio.open_connection("127.0.0.1", port)


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    """Send ``data`` and read as many bytes back (through an echo: the same ones)."""
    writer.write(data)
    return await asyncio.wait_for(reader.readexactly(len(data)), WAIT)


async def until(condition, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


def test_bytes_go_through_the_tunnel_and_back(agent_socket):
    async def scenario():
        async with tunneled(agent_socket) as (_, port, _):
            reader, writer = await guest_connection(port)
            answer = await exchange(reader, writer, b"hello through the agent")
            writer.close()
        return answer

    assert run(scenario()) == b"hello through the agent"


def test_concurrent_connections_keep_their_own_bytes(agent_socket):
    payloads = [os.urandom(200_000) + bytes([n]) for n in range(8)]

    async def one(port: int, payload: bytes) -> bytes:
        reader, writer = await guest_connection(port)

        async def send() -> None:
            for start in range(0, len(payload), 10_000):
                writer.write(payload[start : start + 10_000])
                await writer.drain()

        sending = asyncio.create_task(send())
        back = await asyncio.wait_for(reader.readexactly(len(payload)), WAIT)
        await sending
        writer.close()
        return back

    async def scenario():
        async with tunneled(agent_socket) as (_, port, _):
            return await asyncio.gather(*(one(port, payload) for payload in payloads))

    assert run(scenario()) == payloads


def test_a_mebibyte_of_binary_round_trips_while_commands_run(agent_socket):
    payload = os.urandom(1 << 20)

    async def round_trip(port: int) -> bytes:
        reader, writer = await guest_connection(port)
        back = await exchange(reader, writer, payload)
        writer.close()
        return back

    async def scenario():
        async with tunneled(agent_socket) as (client, port, _):
            back, *outputs = await asyncio.gather(
                round_trip(port), *(collect(client, shell=f"echo run-{n}") for n in range(3))
            )
        return back, [stdout for _, stdout, _ in outputs]

    back, stdouts = run(scenario())
    assert back == payload
    assert stdouts == [b"run-0\n", b"run-1\n", b"run-2\n"]


def test_a_reader_that_stops_holds_up_its_connection_and_nothing_else(agent_socket):
    """Both ends write without reading: each direction stops once its window is full."""

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            writer.write(b"\0" * 65536)
            await writer.drain()

    def unacked(client: AgentClient) -> tuple[list[int], list[int]]:
        return [t.unacked for t in client._tunnels.values()], [t.unacked for t in agent_socket.agent.tunnels.values()]

    def windows_full(client: AgentClient) -> bool:
        host, guest = unacked(client)
        return bool(host and guest) and host[0] >= TUNNEL_WINDOW and guest[0] >= GUEST_WINDOW

    async def scenario():
        async with tunneled(agent_socket, flood) as (client, port, _):
            guest_reader, guest_writer = await guest_connection(port)
            guest_flood = asyncio.create_task(flood(guest_reader, guest_writer))
            await until(lambda: windows_full(client))  # the windows, not only buffers, hold them up
            await asyncio.sleep(0.5)  # time to overrun the windows, if nothing held the floods up
            held = unacked(client)
            _, stdout, _ = await asyncio.wait_for(collect(client, shell="echo still-served"), WAIT)
            guest_flood.cancel()
            guest_writer.transport.abort()
        return held, stdout

    (host_unacked, guest_unacked), stdout = run(scenario())
    assert len(host_unacked) == 1 and host_unacked[0] < TUNNEL_WINDOW + TUNNEL_CHUNK
    assert len(guest_unacked) == 1 and guest_unacked[0] < GUEST_WINDOW + READ_CHUNK
    assert stdout == b"still-served\n"


def test_a_close_in_the_guest_closes_the_host_connection(agent_socket):
    async def scenario():
        async with tunneled(agent_socket) as (_, port, target):
            reader, writer = await guest_connection(port)
            await exchange(reader, writer, b"x")  # the host connection is up
            writer.close()
            await asyncio.wait_for(target.ended_event.wait(), WAIT)

    run(scenario())


def test_a_close_on_the_host_closes_the_guest_connection_after_its_data(agent_socket):
    answer = os.urandom(512 * 1024)  # within the window: the host sends it all, then its close

    async def answer_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)
        writer.write(answer)
        await writer.drain()

    async def scenario():
        async with tunneled(agent_socket, answer_and_close) as (client, port, target):
            # Small buffers on the guest connection and a client that waits: most of the
            # answer is still queued in the agent when the host's close arrives.
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            await until(lambda: len(agent_socket.agent.tunnels) == 1)
            for tunnel in agent_socket.agent.tunnels.values():
                tunnel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            writer.write(b"hello")
            await until(lambda: target.ended and not client._tunnels)  # the host's side is closed
            everything = await asyncio.wait_for(reader.read(), WAIT)  # until EOF
            writer.close()
        return everything

    assert run(scenario()) == answer


def test_a_target_that_cannot_be_reached_closes_the_guest_connection_promptly(agent_socket):
    nothing_listens = free_port()

    async def scenario():
        unreachable = lambda: asyncio.open_connection("127.0.0.1", nothing_listens)  # noqa: E731
        async with tunneled(agent_socket, connect=unreachable) as (client, port, _):
            reader, writer = await guest_connection(port)
            started = time.monotonic()
            data = await asyncio.wait_for(reader.read(), WAIT)
            took = time.monotonic() - started
            writer.close()
            _, stdout, _ = await collect(client, shell="echo fine")
        return data, took, stdout

    data, took, stdout = run(scenario())
    assert data == b"" and took < 2
    assert stdout == b"fine\n"
    assert agent_socket.agent.tunnels == {}


def test_a_new_host_connection_closes_the_tunnels_of_the_last_one(agent_socket):
    """As after a reconnect or in a fork: nothing carries the old connections any more."""

    async def scenario():
        async with tunneled(agent_socket) as (_, port, target):
            reader, writer = await guest_connection(port)
            await exchange(reader, writer, b"x")
        # The client closed: its host connections close at once, the guest's with the next host.
        await asyncio.wait_for(target.ended_event.wait(), WAIT)
        fresh = AgentClient(agent_socket.path, name="t")
        await fresh.connect(30)
        closed_by_reset = await asyncio.wait_for(reader.read(), WAIT)
        # A client that serves no tunnels (a fork's, before serve_tunnels) closes new connections.
        late_reader, late_writer = await guest_connection(port)
        late = await asyncio.wait_for(late_reader.read(), WAIT)
        await fresh.close()
        for each in (writer, late_writer):
            each.close()
        return closed_by_reset, late

    assert run(scenario()) == (b"", b"")


def test_listening_is_idempotent_and_a_taken_port_is_a_conflict(agent_socket):
    async def scenario():
        async with tunneled(agent_socket) as (client, port, target):
            await client.serve_tunnels(port, target.connect)  # again: fine
            reader, writer = await guest_connection(port)
            echoed = await exchange(reader, writer, b"once")
            writer.close()
            with socket.create_server(("127.0.0.1", 0)) as taken:
                with pytest.raises(Conflict) as conflict:
                    await client.serve_tunnels(taken.getsockname()[1], target.connect)
            with pytest.raises(InvalidInput):
                await client.serve_tunnels(70000, target.connect)
        return echoed, conflict.value.field

    assert run(scenario()) == (b"once", "port")


def test_tunnel_messages_for_unknown_connections_are_ignored_and_not_remembered(agent_socket):
    async def scenario():
        reader, writer = await asyncio.open_unix_connection(str(agent_socket.path))
        for message in (
            {"op": "tunnel_data", "conn": 424242, "data_b64": "aGk="},
            {"op": "tunnel_ack", "conn": 424242, "bytes": 10},
            {"op": "tunnel_close", "conn": 424242},
            {"op": "tunnel_data", "conn": ["not", "an", "id"], "data_b64": "aGk="},
            {"id": "p", "op": "ping"},
        ):
            writer.write(json.dumps(message).encode() + b"\n")
        await writer.drain()
        first = json.loads(await asyncio.wait_for(reader.readline(), WAIT))
        writer.close()
        return first

    first = run(scenario())
    # Nothing answered the tunnel messages, and only the ping's id was remembered.
    assert first["id"] == "p" and first["type"] == "result"
    assert list(agent_socket.agent.seen) == ["p"]
