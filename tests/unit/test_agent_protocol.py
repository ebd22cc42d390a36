"""The guest agent and the host's client, talking over a unix socket on the host.

The agent is plain Python, so its protocol (request ids, streaming, timeouts, files)
is tested here without a VM; the VM tests then show the same code inside a guest.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from boxd.errors import Conflict, InvalidInput, NotFound
from boxd.guest.agent import Agent, Channel
from boxd.runtime.agent_client import WATCH_STARTED, AgentClient


class AgentOnSocket:
    """Serves each connection to ``path`` with a guest agent, like QEMU's chardev does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.connections: list[socket.socket] = []
        self.agent: Agent | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.connections.append(connection)
            # One agent for the life of the "guest": its memory of request ids persists
            # across host connections, as it does in a VM.
            if self.agent is None:
                self.agent = Agent(Channel(connection.fileno()))
            else:
                self.agent.channel.fd = connection.fileno()
                continue
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            self.agent.serve()
        except OSError:
            pass

    def close(self) -> None:
        if self.agent is not None:
            # A guest's listeners live as long as it does; this "guest" ends here.
            for listener in self.agent.listeners.values():
                listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
                listener.close()
            for tunnel in list(self.agent.tunnels.values()):
                tunnel.end(tell_host=False)
            # An invalid fd ends the agent's read loop before the connection's number is reused.
            self.agent.channel.fd = -1
        self.server.close()
        for connection in self.connections:
            connection.close()


@pytest.fixture
def agent_socket(tmp_path):
    served = AgentOnSocket(tmp_path / "agent.sock")
    yield served
    served.close()


def run(coroutine):
    return asyncio.run(coroutine)


async def collect(client: AgentClient, **kwargs):
    events = [event async for event in client.exec(**kwargs)]
    stdout = b"".join(e.data for e in events if e.kind == "stdout")
    stderr = b"".join(e.data for e in events if e.kind == "stderr")
    return events, stdout, stderr


def test_exec_streams_output_and_exit_code(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        events, stdout, stderr = await collect(client, shell="echo out; echo err >&2; exit 3")
        await client.close()
        return events, stdout, stderr

    events, stdout, stderr = run(scenario())
    assert events[0].kind == "started" and events[0].pid > 0
    assert stdout == b"out\n" and stderr == b"err\n"
    assert events[-1].kind == "exit" and events[-1].exit_code == 3 and not events[-1].timed_out


def test_non_utf8_output_comes_back_intact(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        _, stdout, _ = await collect(client, argv=["printf", r"\377\376\000abc"])
        await client.close()
        return stdout

    assert run(scenario()) == b"\xff\xfe\x00abc"


def test_stdin_is_fed_to_the_command(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        _, stdout, _ = await collect(client, argv=["sha256sum"], stdin=b"x" * 100_000)
        await client.close()
        return stdout

    assert run(scenario()).split()[0].decode() == hashlib.sha256(b"x" * 100_000).hexdigest()


def test_timeout_kills_the_whole_process_group(agent_socket, tmp_path):
    marker = tmp_path / "child-survived"

    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        # The background child would touch the marker if it outlived the timeout.
        events, _, _ = await collect(client, shell=f"(sleep 2; touch {marker}) & sleep 30", timeout=0.5)
        await asyncio.sleep(2.5)
        await client.close()
        return events[-1]

    exit_event = run(scenario())
    assert exit_event.timed_out and exit_event.exit_code == 137
    assert not marker.exists()


def test_command_not_found_is_a_not_found_error(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        try:
            await collect(client, argv=["/no/such/binary"])
        finally:
            await client.close()

    with pytest.raises(NotFound, match="command not found"):
        run(scenario())


def test_files_round_trip_in_chunks_with_mode_and_parents(agent_socket, tmp_path):
    payload = os.urandom(3 * 1024 * 1024 + 17)
    target = tmp_path / "deep" / "er" / "file.bin"

    async def chunks():
        for start in range(0, len(payload), 100_000):
            yield payload[start : start + 100_000]

    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        size = await client.write_file(str(target), chunks(), mode=0o600)
        back = b"".join([chunk async for chunk in client.read_file(str(target))])
        await client.close()
        return size, back

    size, back = run(scenario())
    assert size == len(payload) and back == payload
    assert target.stat().st_mode & 0o777 == 0o600
    assert not list(target.parent.glob(".*.part"))


def test_file_errors_name_the_field(agent_socket, tmp_path):
    async def scenario(op, **fields):
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        try:
            return await client.call(op, **fields)
        finally:
            await client.close()

    with pytest.raises(NotFound):
        run(scenario("read_file", path=str(tmp_path / "missing")))
    with pytest.raises(InvalidInput) as relative:
        run(scenario("read_file", path="relative/path"))
    assert relative.value.field == "path"
    with pytest.raises(InvalidInput):
        run(scenario("read_file", path=str(tmp_path)))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(Conflict):
        run(scenario("make_dir", path=str(tmp_path / "a-file")))


def test_remove_takes_files_and_trees_and_a_missing_path_is_removed_already(agent_socket, tmp_path):
    tree, single = tmp_path / "tree", tmp_path / "single"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "file").write_text("x")
    single.write_text("x")

    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        # As E2B's envd (os.RemoveAll): removing what is not there succeeds.
        for path in (tree, single, tmp_path / "never-was", tree):
            await client.call("remove", path=str(path))
        await client.close()

    run(scenario())
    assert not tree.exists() and not single.exists()


def test_a_watch_sees_an_upload_land_as_an_in_place_write_and_never_its_part_file(agent_socket, tmp_path):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        changes = client.watch(str(tmp_path))
        assert await anext(changes) == WATCH_STARTED

        async def one_chunk(data: bytes):
            yield data

        seen = []
        for content in (b"new", b"overwritten"):
            await client.write_file(str(tmp_path / "f.txt"), one_chunk(content))
            while (change := await asyncio.wait_for(anext(changes), 10)) != ("f.txt", "write"):
                seen.append(change)
            seen.append(change)
        await changes.aclose()
        await client.close()
        return seen

    # As E2B's envd, which writes in place, shows a new file; the file is whole when they come.
    landed = [("f.txt", "create"), ("f.txt", "chmod"), ("f.txt", "write")]
    assert run(scenario()) == landed + landed
    assert (tmp_path / "f.txt").read_bytes() == b"overwritten"


def test_a_repeated_request_id_never_runs_twice(agent_socket, tmp_path):
    counter = tmp_path / "runs"
    request = {"id": "fixed-1", "op": "exec", "shell": f"echo run >> {counter}", "env": {}}

    async def scenario():
        reader, writer = await asyncio.open_unix_connection(str(agent_socket.path))
        async def next_exit():
            while True:
                message = json.loads(await asyncio.wait_for(reader.readline(), 10))
                if message["type"] == "exit":
                    return message

        # Copies that arrive while it runs are dropped; one that arrives after it ended
        # gets the same final answer again.
        for _ in range(3):
            writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        first = await next_exit()
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        assert await next_exit() == first
        writer.close()

    run(scenario())
    assert counter.read_text() == "run\n"


def test_garbage_and_half_lines_are_skipped(agent_socket):
    async def scenario():
        reader, writer = await asyncio.open_unix_connection(str(agent_socket.path))
        writer.write(b'{"id": "cut-off", "op": "pi\nnot json\n{"id": "p", "op": "ping"}\n')
        await writer.drain()
        answer = json.loads(await asyncio.wait_for(reader.readline(), 5))
        writer.close()
        return answer

    answer = run(scenario())
    assert answer["id"] == "p" and answer["type"] == "result"


def test_client_reconnects_after_losing_the_connection(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        await client.close()
        client = AgentClient(agent_socket.path, name="t")
        _, stdout, _ = await collect(client, shell="echo again")
        await client.close()
        return stdout

    assert run(scenario()) == b"again\n"


def test_a_process_is_driven_by_pid_and_followed_by_a_second_listener(agent_socket):
    """What the E2B API needs: stdin, signals and a second stream for a running command."""

    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        first = client.exec(argv=["cat"], keep_stdin=True, tag="reader")
        started = await anext(first)
        pid = started.pid
        listed = (await client.call("processes"))["processes"]
        follower = client.attach(pid)
        assert (await anext(follower)).pid == pid
        await client.call("stdin", pid=pid, data=base64.b64encode(b"hello\n").decode())
        echoed = await anext(follower)
        await client.call("close_stdin", pid=pid)
        rest = [event async for event in follower]
        own = [event async for event in first]
        with pytest.raises(NotFound) as missing:
            await client.call("signal", pid=pid, signal=9)
        await client.close()
        return pid, listed, echoed, rest, own, missing.value

    pid, listed, echoed, rest, own, missing = run(scenario())
    assert [(p["pid"], p["tag"], p["argv"]) for p in listed] == [(pid, "reader", ["cat"])]
    assert echoed.kind == "stdout" and echoed.data == b"hello\n"
    assert rest[-1].kind == "exit" and rest[-1].exit_code == 0
    # The exec's own stream saw the same output and the same end.
    assert b"".join(e.data for e in own if e.kind == "stdout") == b"hello\n" and own[-1].exit_code == 0
    assert "pid" in missing.message


def test_a_signal_by_pid_ends_a_background_command(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        stream = client.exec(shell="sleep 30")
        pid = (await anext(stream)).pid
        await client.call("signal", pid=pid, signal=9)
        events = [event async for event in stream]
        await client.close()
        return events[-1]

    end = run(scenario())
    assert end.kind == "exit" and end.signal == 9 and end.exit_code == 137


def test_a_command_in_a_terminal_sees_a_tty_of_its_size_and_can_be_resized(agent_socket):
    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        script = "stty size; read line; stty size; echo got:$line"
        stream = client.exec(argv=["bash", "-c", script], pty={"rows": 30, "cols": 100})
        pid = (await anext(stream)).pid
        output = b""
        while b"30 100" not in output:
            output += (await anext(stream)).data
        await client.call("resize", pid=pid, pty={"rows": 40, "cols": 120})
        await client.call("stdin", pid=pid, data=base64.b64encode(b"abc\n").decode())
        events = [event async for event in stream]
        plain = client.exec(shell="sleep 5")
        plain_pid = (await anext(plain)).pid
        with pytest.raises(InvalidInput):
            await client.call("resize", pid=plain_pid, pty={"rows": 1, "cols": 1})
        await client.call("signal", pid=plain_pid, signal=9)
        assert [event async for event in plain][-1].signal == 9
        await client.close()
        return output + b"".join(e.data for e in events if e.kind == "pty"), events[-1], {e.kind for e in events}

    output, end, kinds = run(scenario())
    assert b"40 120" in output and b"got:abc" in output
    assert end.exit_code == 0 and "stdout" not in kinds


def test_a_watch_reports_changes_in_a_directory_tree_until_it_is_left(agent_socket, tmp_path):
    root = tmp_path / "watched"
    (root / "sub").mkdir(parents=True)

    async def scenario():
        client = AgentClient(agent_socket.path, name="t")
        await client.connect(5)
        changes = client.watch(str(root), recursive=True)
        seen: list[tuple[str, str]] = []

        async def collect():
            async for change in changes:
                seen.append(change)
                if change == ("sub/new/deeper.txt", "create"):
                    return

        collecting = asyncio.create_task(collect())

        async def folders_watched(count: int) -> None:
            # A watch's folders are watched once it is on record; a new folder once its create is read.
            while not any(len(w.folders) >= count for w in list(agent_socket.agent.watches.values())):
                await asyncio.sleep(0.02)

        await asyncio.wait_for(folders_watched(2), 10)  # the root and sub
        (root / "a.txt").write_text("x")
        (root / "a.txt").rename(root / "b.txt")
        (root / "b.txt").unlink()
        (root / "sub" / "new").mkdir()
        await asyncio.wait_for(folders_watched(3), 10)
        (root / "sub" / "new" / "deeper.txt").write_text("y")
        await asyncio.wait_for(collecting, 10)
        await changes.aclose()
        for _ in range(250):  # the agent ends the watch when the unwatch comes
            if not agent_socket.agent.watches:
                break
            await asyncio.sleep(0.02)
        watches_left = len(agent_socket.agent.watches)
        with pytest.raises(NotFound):
            async for _ in client.watch(str(root / "missing")):
                pass
        await client.close()
        return seen, watches_left

    seen, watches_left = run(scenario())
    assert seen[0] == WATCH_STARTED  # before any change: from here on none is missed
    assert ("a.txt", "create") in seen and ("a.txt", "write") in seen and ("a.txt", "rename") in seen
    assert ("b.txt", "create") in seen and ("b.txt", "remove") in seen and ("sub/new", "create") in seen
    assert watches_left == 0
