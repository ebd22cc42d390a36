"""The boxd agent that runs inside every guest, as root, started by /sbin/boxd-init.

It speaks JSON lines over one virtio-serial port (``org.boxd.agent``) and keeps that
port open for its whole life: closing and reopening a virtio port loses input.

Requests (host -> guest) are ``{"id": ..., "op": ..., ...}``. Replies and events
(guest -> host) carry the request's id and a ``type``: ``result`` or ``error`` end a
request; ``started``, ``stdout``, ``stderr`` (or ``pty``) and ``exit`` belong to an ``exec``
and to an ``attach``, which follows a process that is already running under a new id
(the E2B API reconnects to commands; a fork's host never saw its source's). Processes
are picked by ``pid`` or by the id of the ``exec`` that started them (``target``). Bytes
travel base64-encoded so that any output, UTF-8 or not, comes back intact.

Request ids make retries safe: a request whose id was seen before is never run again;
a finished one gets its final answer sent once more. That matters after a fork, when
a new host connection may resend what the old one already sent.

``watch`` (``path``, ``recursive``) follows a directory: ``started``, then one
``fs_event`` (``name`` relative to the directory, ``event``: create, write, remove,
rename or chmod) per change, until ``unwatch`` (``target``: the watch's id) or a new host
connection ends it with ``exit``. An upload (``write_file``) is written to a hidden part
file and renamed into place; a watch never shows the part file, and shows the landing as
E2B's envd, which writes in place, shows a new file: create, chmod, write.

Tunnels carry TCP connections made inside the guest to the host (the SDK in a machine
reaches the daemon this way; the guest's network cannot reach the host's loopback).
``tunnel_listen`` (``port``, optional ``host``, default 127.0.0.1) is an ordinary
request: idempotent, answered with ``result`` once the agent listens. Each connection
accepted there is then a stream of messages without an id, in both directions:

    guest -> host  {"type": "tunnel_open", "conn": N, "port": P}
                   {"type": "tunnel_data", "conn": N, "data_b64": ...}
                   {"type": "tunnel_ack", "conn": N, "bytes": K}
                   {"type": "tunnel_close", "conn": N}
    host -> guest  {"op": "tunnel_data", "conn": N, "data_b64": ...}
                   {"op": "tunnel_ack", "conn": N, "bytes": K}
                   {"op": "tunnel_close", "conn": N}
                   {"op": "tunnel_reset"}

They skip the de-duplication memory and get no answer: a connection never outlives
the host connection that carried it, so nothing is resent that ids would guard, and an
answer per chunk would double the traffic. ``tunnel_close`` ends the whole connection
(there is no half-close) once what came before it is delivered; a message for a
connection the receiver does not hold is ignored. Each side keeps at most
``TUNNEL_WINDOW`` bytes sent and not yet acknowledged, and acknowledges what it has
delivered every ``TUNNEL_ACK_EVERY`` bytes or whenever it has nothing more queued, so
that a reader that stops reading holds up its own connection and nothing else. A host
sends ``tunnel_reset`` when it connects: the connections and watches of an earlier host
(or, in a fork, of the source's host) are closed; listeners stay.

Only the standard library is used: the guest has python3 and nothing else of ours.
"""

from __future__ import annotations

import base64
import collections
import ctypes
import errno
import fcntl
import glob
import grp
import itertools
import json
import os
import pwd
import queue
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import threading
import time

PORT_NAME = "org.boxd.agent"
AGENT_VERSION = 1
SEEN_LIMIT = 4096  # request ids remembered for de-duplication
DRAIN_GRACE_S = 0.2  # output still read after a command exits (a background child may hold the pipe)
READ_CHUNK = 64 * 1024
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TUNNEL_WINDOW = 1 << 20  # bytes of one tunnel connection in flight, unacknowledged
TUNNEL_ACK_EVERY = 256 * 1024
TUNNEL_OPS = frozenset({"tunnel_data", "tunnel_ack", "tunnel_close", "tunnel_reset"})  # no id, no answer


class AgentFault(Exception):
    """An error answer: its code picks the host's error class, ``field`` names the input at fault."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


def _fault_from_oserror(error: OSError, path: str) -> AgentFault:
    codes = {
        errno.ENOENT: "not_found",
        errno.EACCES: "permission_denied",
        errno.EPERM: "permission_denied",
        errno.EEXIST: "conflict",
        errno.EISDIR: "invalid_input",
        errno.ENOTDIR: "invalid_input",
        errno.ENOTEMPTY: "conflict",
        errno.ENOSPC: "no_space",
    }
    return AgentFault(codes.get(error.errno, "internal"), f"{path}: {error.strerror}", "path" if path else None)


def find_port() -> str:
    """The device node of our virtio port; there is no udev to make /dev/virtio-ports links."""
    link = f"/dev/virtio-ports/{PORT_NAME}"
    if os.path.exists(link):
        return link
    for name_file in glob.glob("/sys/class/virtio-ports/*/name"):
        with open(name_file) as handle:
            if handle.read().strip() == PORT_NAME:
                return "/dev/" + os.path.basename(os.path.dirname(name_file))
    raise FileNotFoundError(f"no virtio port named {PORT_NAME}")


class Channel:
    """The port, with whole-line writes from many threads."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.write_lock = threading.Lock()

    def send(self, message: dict) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self.write_lock:
            view = memoryview(data)
            while view:
                written = os.write(self.fd, view)
                view = view[written:]

    def lines(self):
        # A virtio port hands over at most a few KiB per read and a file chunk is a
        # line of ~700 KB: collect pieces and search only the new one for the newline,
        # or assembling a line costs time quadratic in its length.
        pieces: list[bytes] = []
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except InterruptedError:
                continue
            if not chunk:
                # No host is connected (before the first connection, or between a fork's
                # capture and its new host): reads return EOF at once, so wait a little.
                time.sleep(0.02)
                continue
            while (end := chunk.find(b"\n")) >= 0:
                pieces.append(chunk[:end])
                line, pieces = b"".join(pieces), []
                if line.strip():
                    yield line
                chunk = chunk[end + 1 :]
            if chunk:
                pieces.append(chunk)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _account(user: str | None) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(user or "root")
    except KeyError:
        raise AgentFault("invalid_input", f"user: no such user {user!r}", "user") from None


def _read_etc_environment() -> dict[str, str]:
    env = {}
    try:
        with open("/etc/environment") as handle:
            for line in handle:
                line = line.strip()
                if line and not line.startswith("#") and "=" in line:
                    key, value = line.split("=", 1)
                    env[key.strip()] = value.strip().strip('"')
    except FileNotFoundError:
        pass
    return env


def _window_size(pty: dict) -> bytes:
    try:
        rows, cols = int(pty.get("rows", 24)), int(pty.get("cols", 80))
    except (TypeError, ValueError):
        raise AgentFault("invalid_input", "pty: rows and cols must be numbers", "pty") from None
    if not (0 < rows < 65536 and 0 < cols < 65536):
        raise AgentFault("invalid_input", f"pty: rows and cols must be 1-65535, got {rows}x{cols}", "pty")
    return struct.pack("HHHH", rows, cols, 0, 0)


def _take_terminal() -> None:
    # Runs in the child after setsid(): its stdin, a pty, becomes its controlling terminal.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Process:
    """One command started by ``exec``, with its pipes (or a pty) and its own process group."""

    def __init__(self, agent: "Agent", request_id: str, request: dict) -> None:
        self.agent = agent
        self.id = request_id
        self.tag = request.get("tag")
        self.timed_out = False
        self.account = _account(request.get("user"))
        argv = self._argv(request)
        self.argv = argv
        self.extra_env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        env = self._environment(self.extra_env)
        cwd = request.get("cwd") or self.account.pw_dir
        if not os.path.isdir(cwd):
            raise AgentFault("invalid_input", f"cwd: no such directory {cwd!r}", "cwd")
        self.cwd = cwd
        # Ids that follow this process besides the exec's own (attach); each gets every event.
        self.followers: list[str] = []
        stdin_data = request.get("stdin_data")
        self.keep_stdin = bool(request.get("stdin"))
        self.terminal: int | None = None  # the pty's controlling side, when it runs in one
        as_other_user = self.account.pw_uid != os.getuid()
        identity = {
            "user": self.account.pw_uid if as_other_user else None,
            "group": self.account.pw_gid if as_other_user else None,
            "extra_groups": self._groups() if as_other_user else None,
        }
        try:
            if request.get("pty") is not None:
                self.popen = self._start_in_pty(argv, request["pty"], cwd, env, identity)
            else:
                want_stdin = self.keep_stdin or stdin_data is not None
                self.popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,  # its own process group, so a timeout kills all of it
                    **identity,
                )
        except FileNotFoundError:
            raise AgentFault("command_not_found", f"command not found: {argv[0]}") from None
        except PermissionError:
            raise AgentFault("permission_denied", f"permission denied: {argv[0]}") from None
        if stdin_data is not None:
            self.write_stdin(_unb64(stdin_data))
            if not self.keep_stdin:
                self.close_stdin()
        self.pid = self.popen.pid
        timeout = request.get("timeout")
        self.deadline = time.monotonic() + float(timeout) if timeout else None

    def _start_in_pty(self, argv: list[str], pty: dict, cwd: str, env: dict, identity: dict) -> subprocess.Popen:
        size = _window_size(pty if isinstance(pty, dict) else {})
        controller, terminal = os.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, size)
        env.setdefault("TERM", "xterm-256color")
        try:
            popen = subprocess.Popen(
                argv, stdin=terminal, stdout=terminal, stderr=terminal, cwd=cwd, env=env,
                start_new_session=True, preexec_fn=_take_terminal, **identity,
            )
        except BaseException:
            os.close(controller)
            raise
        finally:
            os.close(terminal)
        self.terminal = controller
        self.keep_stdin = True  # a terminal always takes input
        return popen

    def _argv(self, request: dict) -> list[str]:
        if request.get("argv"):
            argv = request["argv"]
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise AgentFault("invalid_input", "argv: must be a list of strings", "argv")
            return argv
        if isinstance(request.get("shell"), str):
            return ["/bin/bash", "-c", request["shell"]]
        raise AgentFault("invalid_input", "argv or shell: one of them is required", "argv")

    def _groups(self) -> list[int]:
        return [g.gr_gid for g in grp.getgrall() if self.account.pw_name in g.gr_mem]

    def _environment(self, extra: dict) -> dict[str, str]:
        home = self.account.pw_dir
        env = {"PATH": f"{home}/.local/bin:{DEFAULT_PATH}", "LANG": "C.UTF-8"}
        env.update(_read_etc_environment())
        env.update(HOME=home, USER=self.account.pw_name, LOGNAME=self.account.pw_name,
                   SHELL=self.account.pw_shell or "/bin/sh")
        env.update(extra)
        return env

    def describe(self) -> dict:
        return {"id": self.id, "pid": self.pid, "argv": self.argv, "tag": self.tag, "user": self.account.pw_name,
                "cwd": self.cwd, "env": self.extra_env, "pty": self.terminal is not None}

    def _tell(self, message: dict) -> None:
        """Send an event of this process to the exec and to everyone following it."""
        with self.agent.lock:
            ids = [self.id, *self.followers]
        for request_id in ids:
            self.agent.channel.send({**message, "id": request_id})

    def follow(self, request_id: str) -> None:
        with self.agent.lock:
            self.followers.append(request_id)
        self.agent.channel.send({"id": request_id, "type": "started", "pid": self.pid})

    def run(self) -> None:
        """Stream the output, enforce the timeout, then report the exit."""
        self._tell({"type": "started", "pid": self.pid})
        if self.terminal is not None:
            pumps = [(self.terminal, "pty")]
        else:
            pumps = [(self.popen.stdout.fileno(), "stdout"), (self.popen.stderr.fileno(), "stderr")]
        readers = [threading.Thread(target=self._pump, args=pump, daemon=True) for pump in pumps]
        for reader in readers:
            reader.start()
        while True:
            remaining = None if self.deadline is None else self.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self.timed_out = True
                self.signal(signal.SIGKILL)
                self.popen.wait()
                break
            try:
                self.popen.wait(timeout=remaining)
                break
            except subprocess.TimeoutExpired:
                continue
        for reader in readers:
            reader.join(DRAIN_GRACE_S)
        code = self.popen.returncode
        signalled = -code if code < 0 else None
        ending = {"type": "exit", "exit_code": 128 + signalled if signalled else code,
                  "signal": signalled, "timed_out": self.timed_out}
        with self.agent.lock:
            followers = list(self.followers)
        for request_id in followers:
            self.agent.finish(request_id, {**ending, "id": request_id})
        self.agent.finish(self.id, {**ending, "id": self.id})
        if self.terminal is not None:
            os.close(self.terminal)

    def _pump(self, fd: int, stream: str) -> None:
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except OSError:  # EIO: a pty whose last user is gone
                return
            if not data:
                return
            self._tell({"type": stream, "data": _b64(data)})

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def write_stdin(self, data: bytes) -> None:
        if self.terminal is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(self.terminal, view):]
            return
        if self.popen.stdin is None or self.popen.stdin.closed:
            raise AgentFault("conflict", "stdin: the process's stdin is closed", "stdin")
        try:
            self.popen.stdin.write(data)
            self.popen.stdin.flush()
        except BrokenPipeError:
            raise AgentFault("conflict", "stdin: the process no longer reads its stdin", "stdin") from None

    def close_stdin(self) -> None:
        if self.terminal is not None:
            self.write_stdin(b"\x04")  # end of input, as a terminal says it
        elif self.popen.stdin is not None and not self.popen.stdin.closed:
            try:
                self.popen.stdin.close()
            except BrokenPipeError:
                pass

    def resize(self, pty: dict) -> None:
        if self.terminal is None:
            raise AgentFault("invalid_input", "pty: the process does not run in a terminal", "pty")
        fcntl.ioctl(self.terminal, termios.TIOCSWINSZ, _window_size(pty))


# inotify(7): the events a watch asks for, and what each one is called to the host.
IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_IGNORED, IN_ISDIR = 0x8000, 0x40000000
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
WATCH_EVENTS = (  # as fsnotify (E2B's envd) names them, first match wins
    (IN_CREATE | IN_MOVED_TO, "create"),
    (IN_DELETE | IN_DELETE_SELF, "remove"),
    (IN_MOVED_FROM | IN_MOVE_SELF, "rename"),
    (IN_MODIFY, "write"),
    (IN_ATTRIB, "chmod"),
)
INOTIFY_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
UPLOAD_LANDED_EVENTS = ("create", "chmod", "write")  # envd's open(O_CREAT), chown, write
PARTIAL_NAME = re.compile(r"\..+\.boxd-[0-9A-Za-z]+\.part\Z")  # what _partial_path names


class Watch:
    """A directory followed with inotify, its events sent to the host as they come."""

    def __init__(self, agent: "Agent", request_id: str, request: dict) -> None:
        self.agent = agent
        self.id = request_id
        self.root = _absolute(request.get("path"))
        if not os.path.isdir(self.root):
            raise AgentFault("not_found" if not os.path.exists(self.root) else "invalid_input",
                             f"path: {self.root} is not a directory", "path")
        self.recursive = bool(request.get("recursive"))
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.folders: dict[int, str] = {}  # watch descriptor -> folder, relative to the root
        # Cookies of part files renamed away, whose other half (IN_MOVED_TO) is an upload landing.
        self.landing: collections.deque[int] = collections.deque(maxlen=64)
        self.stop_reader, self.stop_writer = os.pipe()
        try:
            self._add(self.root, "")
        except BaseException:
            for fd in (self.fd, self.stop_reader, self.stop_writer):
                os.close(fd)
            raise

    def _add(self, folder: str, relative: str) -> None:
        descriptor = self.libc.inotify_add_watch(self.fd, folder.encode(), WATCH_MASK)
        if descriptor >= 0:
            self.folders[descriptor] = relative
        if self.recursive:
            for entry in os.scandir(folder):
                if entry.is_dir(follow_symlinks=False):
                    self._add(entry.path, os.path.join(relative, entry.name))

    def stop(self) -> None:
        os.write(self.stop_writer, b"x")

    def run(self) -> None:
        self.agent.channel.send({"id": self.id, "type": "started"})
        try:
            while True:
                ready, _, _ = select.select([self.fd, self.stop_reader], [], [])
                if self.stop_reader in ready:
                    break
                try:
                    data = os.read(self.fd, 64 * 1024)
                except BlockingIOError:
                    continue
                self._report(data)
        finally:
            for fd in (self.fd, self.stop_reader, self.stop_writer):
                os.close(fd)
            self.agent.finish(self.id, {"id": self.id, "type": "exit", "exit_code": 0, "signal": None,
                                        "timed_out": False})

    def _report(self, data: bytes) -> None:
        offset = 0
        while offset + INOTIFY_HEADER.size <= len(data):
            descriptor, mask, cookie, length = INOTIFY_HEADER.unpack_from(data, offset)
            raw = data[offset + INOTIFY_HEADER.size : offset + INOTIFY_HEADER.size + length]
            offset += INOTIFY_HEADER.size + length
            if mask & IN_IGNORED or descriptor not in self.folders:
                continue
            name = os.path.join(self.folders[descriptor], raw.rstrip(b"\0").decode(errors="surrogateescape"))
            if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                self._add(os.path.join(self.root, name), name)
            for event in self._events_of(name, mask, cookie):
                self.agent.channel.send({"id": self.id, "type": "fs_event", "name": name, "event": event})

    def _events_of(self, name: str, mask: int, cookie: int) -> tuple[str, ...]:
        """What the host is told of one inotify event: its fsnotify name, except that an
        upload's part file goes unseen and its landing reads as an in-place write."""
        if PARTIAL_NAME.match(os.path.basename(name)):
            if mask & IN_MOVED_FROM:
                self.landing.append(cookie)
            return ()
        if mask & IN_MOVED_TO and cookie in self.landing:
            self.landing.remove(cookie)
            return UPLOAD_LANDED_EVENTS
        event = next((word for bits, word in WATCH_EVENTS if mask & bits), None)
        return (event,) if event is not None and name else ()


class Tunnel:
    """One connection accepted by a tunnel listener, carried to the host and back.

    A reader thread sends what the guest's client writes, a writer thread writes what
    the host sends; the serve loop only queues, so a slow client never stalls it.
    """

    def __init__(self, agent: "Agent", conn: int, sock: socket.socket, port: int) -> None:
        self.agent = agent
        self.conn = conn
        self.sock = sock
        self.port = port
        self.inbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None: nothing more to write
        self.credit = threading.Condition()
        self.unacked = 0  # bytes sent to the host and not acknowledged yet
        self.ended = False
        self.writer = threading.Thread(target=self._write, daemon=True)

    def start(self) -> None:
        self._tell_host({"type": "tunnel_open", "conn": self.conn, "port": self.port})
        self.writer.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                with self.credit:
                    self.credit.wait_for(lambda: self.unacked < TUNNEL_WINDOW or self.ended)
                    if self.ended:
                        break
                data = self.sock.recv(READ_CHUNK)
                if not data:
                    break
                with self.credit:
                    self.unacked += len(data)
                self._tell_host({"type": "tunnel_data", "conn": self.conn, "data_b64": _b64(data)})
        except OSError:
            pass
        self.end(tell_host=True)
        # The last user of the socket closes it: a closed number may be reused at once.
        self.writer.join()
        self.sock.close()

    def _write(self) -> None:
        delivered = 0
        while (data := self.inbox.get()) is not None:
            if self.ended:
                continue  # drain until the end marker; the socket is shut already
            try:
                self.sock.sendall(data)
            except OSError:
                self.end(tell_host=True)
                continue
            delivered += len(data)
            if delivered >= TUNNEL_ACK_EVERY or self.inbox.empty():
                self._tell_host({"type": "tunnel_ack", "conn": self.conn, "bytes": delivered})
                delivered = 0
        # The host's tunnel_close, after all the data before it: the connection is over.
        self.end(tell_host=False)

    def _tell_host(self, message: dict) -> None:
        try:
            self.agent.channel.send(message)
        except OSError:
            # No host to tell (only in tests, where the channel is a socket that closed;
            # a virtio port waits for the next host): nothing carries this connection.
            self.end(tell_host=False)

    def acknowledged(self, count: int) -> None:
        with self.credit:
            self.unacked -= count
            self.credit.notify_all()

    def end(self, *, tell_host: bool) -> None:
        """Shut the connection (both threads then finish); only the first call acts."""
        with self.credit:
            if self.ended:
                return
            self.ended = True
            self.credit.notify_all()
        self.agent.forget_tunnel(self.conn)
        if tell_host:
            self._tell_host({"type": "tunnel_close", "conn": self.conn})
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a recv or sendall in progress
        except OSError:
            pass
        self.inbox.put(None)


class Agent:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        # id -> final message once finished, None while running
        self.seen: collections.OrderedDict[str, dict | None] = collections.OrderedDict()
        self.processes: dict[str, Process] = {}
        self.started = time.time()
        self.listeners: dict[tuple[str, int], socket.socket] = {}
        self.tunnels: dict[int, Tunnel] = {}
        self.tunnel_ids = itertools.count(1)
        self.watches: dict[str, Watch] = {}

    def serve(self) -> None:
        for line in self.channel.lines():
            try:
                request = json.loads(line)
                op = str(request["op"])
                request_id = None if op in TUNNEL_OPS else str(request["id"])
            except (ValueError, KeyError, TypeError):
                # The tail of a line cut off by an earlier host connection: drop it.
                continue
            if request_id is None:
                self._tunnel_message(op, request)
                continue
            if not self._first_time(request_id):
                continue
            # Commands get a thread; short file and control operations answer inline, in order.
            if op == "exec":
                threading.Thread(target=self._exec, args=(request_id, request), daemon=True).start()
                continue
            if op == "attach":
                self._attach(request_id, request)
                continue
            if op == "watch":
                self._watch(request_id, request)
                continue
            handler = getattr(self, "op_" + op, None)
            if handler is None:
                self.finish(request_id, _error(request_id, "unsupported", f"op: unknown operation {op!r}", "op"))
            else:
                self._answer(request_id, handler, request)

    def _first_time(self, request_id: str) -> bool:
        with self.lock:
            if request_id not in self.seen:
                self.seen[request_id] = None
                while len(self.seen) > SEEN_LIMIT:
                    self.seen.popitem(last=False)
                return True
            final = self.seen[request_id]
        if final is not None:
            self.channel.send(final)
        return False

    def finish(self, request_id: str, message: dict) -> None:
        with self.lock:
            if request_id in self.seen:
                self.seen[request_id] = message
            self.processes.pop(request_id, None)
        self.channel.send(message)

    def _answer(self, request_id: str, handler, request: dict) -> None:
        try:
            result = handler(request) or {}
            message = {"id": request_id, "type": "result", **result}
        except Exception as error:  # a bug here must not take the agent down
            message = _failure(request_id, error, request)
        self.finish(request_id, message)

    def _begin(self, request_id: str, request: dict, kind):
        """A process or a watch for a request, or None once its failure is answered."""
        try:
            return kind(self, request_id, request)
        except Exception as error:
            self.finish(request_id, _failure(request_id, error, request))
            return None

    def _exec(self, request_id: str, request: dict) -> None:
        process = self._begin(request_id, request, Process)
        if process is None:
            return
        with self.lock:
            self.processes[request_id] = process
        process.run()

    def _watch(self, request_id: str, request: dict) -> None:
        watch = self._begin(request_id, request, Watch)
        if watch is None:
            return
        with self.lock:
            self.watches[request_id] = watch
        threading.Thread(target=watch.run, daemon=True).start()

    def op_unwatch(self, request: dict) -> dict:
        with self.lock:
            watch = self.watches.pop(str(request.get("target")), None)
        if watch is not None:
            watch.stop()
        return {}

    def _attach(self, request_id: str, request: dict) -> None:
        """Follow a running process: ``started`` now, then its output and its exit."""
        try:
            self._process(request).follow(request_id)
        except AgentFault as fault:
            self.finish(request_id, _error(request_id, fault.code, str(fault), fault.field))

    def _process(self, request: dict) -> Process:
        """The running process a request names, by ``pid`` or by its exec's id (``target``)."""
        pid = request.get("pid")
        with self.lock:
            if pid is not None:
                found = [p for p in self.processes.values() if p.pid == pid]
                process = found[0] if found else None
                wanted, field = f"pid {pid!r}", "pid"
            else:
                process = self.processes.get(str(request.get("target")))
                wanted, field = repr(request.get("target")), "target"
        if process is None:
            raise AgentFault("not_found", f"{field}: no running process {wanted}", field)
        return process

    # -- tunnels ----------------------------------------------------------------------

    def _tunnel_message(self, op: str, request: dict) -> None:
        if op == "tunnel_reset":
            # A new host: what followed things for the one before has nobody to tell.
            with self.lock:
                stale = list(self.tunnels.values())
                watches = list(self.watches.values())
                self.watches.clear()
            for tunnel in stale:
                tunnel.end(tell_host=False)
            for watch in watches:
                watch.stop()
            return
        conn = request.get("conn")
        with self.lock:
            tunnel = self.tunnels.get(conn) if isinstance(conn, int) else None
        if tunnel is None:
            return  # ended here already, or a connection of the source's host in a fork
        try:
            if op == "tunnel_data":
                tunnel.inbox.put(_unb64(request.get("data_b64", "")))
            elif op == "tunnel_ack":
                tunnel.acknowledged(int(request.get("bytes", 0)))
            else:
                tunnel.inbox.put(None)
        except (ValueError, TypeError):
            tunnel.end(tell_host=True)  # a garbled message: better a closed connection than a corrupt one

    def forget_tunnel(self, conn: int) -> None:
        with self.lock:
            self.tunnels.pop(conn, None)

    def _accept_tunnels(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                if listener.fileno() < 0:
                    return  # closed (only tests close one)
                time.sleep(0.1)  # out of file descriptors, say: the next try may work
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a small answer must not wait
            with self.lock:
                conn = next(self.tunnel_ids)
                tunnel = self.tunnels[conn] = Tunnel(self, conn, sock, port)
            tunnel.start()

    # -- operations -------------------------------------------------------------------

    def op_ping(self, request: dict) -> dict:
        return {"version": AGENT_VERSION, "uptime": time.time() - self.started, "pid": os.getpid()}

    def op_tunnel_listen(self, request: dict) -> dict:
        """Listen on ``host:port`` in the guest and offer each connection to the host."""
        port, host = request.get("port"), request.get("host") or "127.0.0.1"
        if type(port) is not int or not 0 < port < 65536:
            raise AgentFault("invalid_input", f"port: expected a TCP port number, got {port!r}", "port")
        if not isinstance(host, str):
            raise AgentFault("invalid_input", f"host: expected an address, got {host!r}", "host")
        with self.lock:
            if (host, port) in self.listeners:
                return {"host": host, "port": port}
        try:
            listener = socket.create_server((host, port))
        except socket.gaierror as error:
            raise AgentFault("invalid_input", f"host: {host}: {error.strerror}", "host") from None
        except OSError as error:
            code = "conflict" if error.errno == errno.EADDRINUSE else "internal"
            raise AgentFault(code, f"port: cannot listen on {host}:{port}: {error.strerror}", "port") from None
        with self.lock:
            self.listeners[(host, port)] = listener
        threading.Thread(target=self._accept_tunnels, args=(listener, port), daemon=True).start()
        return {"host": host, "port": port}

    def op_set_time(self, request: dict) -> dict:
        time.clock_settime_ns(time.CLOCK_REALTIME, int(request["epoch_ns"]))
        return {}

    def op_stdin(self, request: dict) -> dict:
        self._process(request).write_stdin(_unb64(request.get("data", "")))
        return {}

    def op_close_stdin(self, request: dict) -> dict:
        self._process(request).close_stdin()
        return {}

    def op_signal(self, request: dict) -> dict:
        signum = int(request.get("signal", signal.SIGTERM))
        if signum not in {s.value for s in signal.Signals}:
            raise AgentFault("invalid_input", f"signal: unknown signal {signum}", "signal")
        self._process(request).signal(signum)
        return {}

    def op_resize(self, request: dict) -> dict:
        self._process(request).resize(request.get("pty") or {})
        return {}

    def op_processes(self, request: dict) -> dict:
        with self.lock:
            running = list(self.processes.values())
        return {"processes": [process.describe() for process in running]}

    def op_write_file(self, request: dict) -> dict:
        """One chunk of a file; the file appears, whole, only when the last chunk lands."""
        path = _absolute(request.get("path"))
        offset = int(request.get("offset", 0))
        partial = _partial_path(path, str(request.get("upload", "")))
        account = _account(request.get("user"))
        if os.path.isdir(path):
            raise AgentFault("invalid_input", f"path: {path} is a directory", "path")
        if offset == 0:
            _make_parents(os.path.dirname(path), account)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        else:
            flags = os.O_WRONLY
        fd = os.open(partial, flags, 0o600)
        try:
            os.pwrite(fd, _unb64(request.get("data", "")), offset)
            if request.get("last"):
                os.fsync(fd)
        finally:
            os.close(fd)
        if request.get("last"):
            mode = request.get("mode")
            os.chmod(partial, int(mode) if mode is not None else 0o644)
            os.chown(partial, account.pw_uid, account.pw_gid)
            os.replace(partial, path)
        return {}

    def op_read_file(self, request: dict) -> dict:
        path = _absolute(request.get("path"))
        offset = int(request.get("offset", 0))
        length = int(request.get("length", 1 << 20))
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if stat.S_ISDIR(info.st_mode):
                raise AgentFault("invalid_input", f"path: {path} is a directory", "path")
            handle.seek(offset)
            data = handle.read(length)
        return {"data": _b64(data), "size": info.st_size, "eof": offset + len(data) >= info.st_size}

    # An entry travels under a key of its own: its "type" would clash with the message's.
    def op_stat(self, request: dict) -> dict:
        """An entry; with ``set_metadata`` its user metadata is replaced by that map first,
        and with ``filesystem`` the answer also tells the size of the filesystem it is on."""
        path = _absolute(request.get("path"))
        if request.get("set_metadata") is not None:
            _replace_metadata(path, request["set_metadata"])
        answer = {"entry": _entry(path)}
        if request.get("filesystem"):
            usage = os.statvfs(path)
            answer["filesystem"] = {"total": usage.f_blocks * usage.f_frsize,
                                    "available": usage.f_bavail * usage.f_frsize}
        return answer

    def op_list_dir(self, request: dict) -> dict:
        path = _absolute(request.get("path"))
        depth = max(1, int(request.get("depth", 1)))
        entries = []

        def walk(folder: str, level: int) -> None:
            for name in sorted(os.listdir(folder)):
                child = os.path.join(folder, name)
                entry = _entry(child)
                entries.append(entry)
                if entry["type"] == "dir" and level < depth:
                    walk(child, level + 1)

        walk(path, 1)
        return {"entries": entries}

    def op_make_dir(self, request: dict) -> dict:
        path = _absolute(request.get("path"))
        existed = os.path.isdir(path)
        if os.path.exists(path) and not existed:
            raise AgentFault("conflict", f"path: {path} exists and is not a directory", "path")
        _make_parents(path, _account(request.get("user")))
        return {"created": not existed}

    def op_remove(self, request: dict) -> dict:
        """rm -rf, as E2B's envd (os.RemoveAll): a path that is not there is removed already."""
        path = _absolute(request.get("path"))
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:  # missing, or removed meanwhile
            pass
        return {}

    def op_move(self, request: dict) -> dict:
        source = _absolute(request.get("path"))
        destination = _absolute(request.get("destination"))
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.rename(source, destination)
        return {"entry": _entry(destination)}


def _failure(request_id: str, error: Exception, request: dict) -> dict:
    """The error answer for what a request raised: a fault as it says, an OS error by its errno."""
    if isinstance(error, OSError):
        error = _fault_from_oserror(error, request.get("path", ""))
    if isinstance(error, AgentFault):
        return _error(request_id, error.code, str(error), error.field)
    return _error(request_id, "internal", f"{type(error).__name__}: {error}")


def _error(request_id: str, code: str, message: str, field: str | None = None) -> dict:
    error = {"id": request_id, "type": "error", "code": code, "message": message}
    if field is not None:
        error["field"] = field
    return error


def _absolute(path) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise AgentFault("invalid_input", f"path: must be an absolute path, got {path!r}", "path")
    if "\x00" in path:
        raise AgentFault("invalid_input", "path: must not contain NUL", "path")
    return os.path.normpath(path)


def _partial_path(path: str, upload: str) -> str:
    token = "".join(c for c in upload if c.isalnum())[:32] or "upload"
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.boxd-{token}.part")


def _make_parents(folder: str, account: pwd.struct_passwd) -> None:
    """mkdir -p, handing the folders it creates to the account that asked."""
    missing = []
    while folder and not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for path in reversed(missing):
        os.mkdir(path, 0o755)
        os.chown(path, account.pw_uid, account.pw_gid)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "file" if stat.S_ISREG(mode) else "other"


def _entry(path: str) -> dict:
    """What the host is told of a path (not followed if a link): its stat, its owner by name,
    its user metadata, and for a link where it leads (fully resolved, or the link itself if
    it leads nowhere) and what is there."""
    info = os.lstat(path)
    kind = _kind(info.st_mode)
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    try:
        group = grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        group = str(info.st_gid)
    entry = {
        "name": os.path.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": info.st_size,
        "mode": stat.S_IMODE(info.st_mode),
        "st_mode": info.st_mode,
        "mtime": info.st_mtime,
        "mtime_ns": info.st_mtime_ns,
        "owner": owner,
        "group": group,
        "metadata": _metadata(path),
    }
    if kind == "symlink":
        entry["target"] = os.readlink(path)
        try:
            entry["resolved"] = os.path.realpath(path, strict=True)
            pointed = os.stat(path)
            entry["pointed"] = {"type": _kind(pointed.st_mode), "mode": stat.S_IMODE(pointed.st_mode)}
        except OSError:  # dangling, or a loop
            entry["resolved"] = path
    return entry


# User metadata lives in extended attributes under this prefix (as E2B's envd keeps it).
METADATA_XATTR_PREFIX = "user.e2b."


def _metadata(path: str) -> dict:
    """The user metadata of a path (followed if a link); none where the filesystem keeps no
    extended attributes or the path leads nowhere. Values that are not UTF-8 are left out."""
    found = {}
    try:
        names = os.listxattr(path)
    except OSError:
        return found
    for name in names:
        if not name.startswith(METADATA_XATTR_PREFIX):
            continue
        try:
            found[name[len(METADATA_XATTR_PREFIX):]] = os.getxattr(path, name).decode()
        except (OSError, UnicodeDecodeError):  # removed meanwhile, or not text
            continue
    return found


def _replace_metadata(path: str, metadata) -> None:
    """Make ``metadata`` (str -> str) the path's whole user metadata. A filesystem without
    extended attributes keeps none, and that is no error (the entry then shows none)."""
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise AgentFault("invalid_input", "set_metadata: must map non-empty names to text", "set_metadata")
    try:
        for name in os.listxattr(path):
            if name.startswith(METADATA_XATTR_PREFIX) and name[len(METADATA_XATTR_PREFIX):] not in metadata:
                os.removexattr(path, name)
        for key, value in metadata.items():
            os.setxattr(path, METADATA_XATTR_PREFIX + key, value.encode())
    except OSError as error:
        if error.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def main() -> None:
    while True:
        try:
            port = find_port()
            break
        except FileNotFoundError:
            time.sleep(0.1)
    fd = os.open(port, os.O_RDWR)
    print(f"boxd-agent: serving on {port}", file=sys.stderr, flush=True)
    Agent(Channel(fd)).serve()


if __name__ == "__main__":
    main()
