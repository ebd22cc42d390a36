"""A machine's network: its own NAT, outbound internet, and never the host's loopback.

QEMU's built-in user-mode network (slirp) forwards the guest's connections to its
gateway address to the host's 127.0.0.1, which would let any guest reach the boxd API
and other machines' forwarded ports. So a default machine's network is a ``passt``
process of its own, started with ``--no-map-gw``: the guest keeps the same addresses as
under slirp (so forks keep their configuration) and reaches the internet, and its
gateway is not the host. An isolated machine uses slirp with ``restrict=on``, which
lets nothing out at all.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

from boxd.errors import HostError, VMError

GUEST_ADDRESS = "10.0.2.15"
GATEWAY = "10.0.2.2"
DNS = "10.0.2.3"
# The MAC slirp gives its gateway; passt answers with the same one, so a guest's ARP
# cache stays right whichever network a fork or a restart gets.
GATEWAY_MAC = "52:55:0a:00:02:02"


def passt_binary() -> str:
    path = shutil.which("passt")
    if path is None:
        raise HostError("passt not found: install the Debian package passt (apt-get install passt)")
    return path


def passt_argv(socket_path: Path, pidfile: Path, forward: tuple[int, int] | None = None) -> list[str]:
    """``forward``: (port on the host's 127.0.0.1, port in the guest), the machine's URL."""
    forwarding = ["--tcp-ports", f"127.0.0.1/{forward[0]}:{forward[1]}"] if forward else []
    return [
        passt_binary(),
        "--ipv4-only",
        "--one-off",  # exits when its QEMU goes away, so it never outlives the machine
        "--quiet",
        # It would drop to "nobody" and then fail to write its pidfile in our run dir.
        "--runas", f"{os.getuid()}:{os.getgid()}",
        "--no-map-gw",
        "--address", GUEST_ADDRESS,
        "--netmask", "24",
        "--gateway", GATEWAY,
        "--dns-forward", DNS,
        "--mac-addr", GATEWAY_MAC,
        "--socket", str(socket_path),
        "--pid", str(pidfile),
        *forwarding,
    ]


async def start_passt(run_dir: Path, forward: tuple[int, int] | None = None) -> int:
    """Start the machine's network process (it daemonizes once its socket listens)."""
    socket_path, pidfile = run_dir / "net.sock", run_dir / "passt.pid"
    socket_path.unlink(missing_ok=True)
    process = await asyncio.create_subprocess_exec(
        *passt_argv(socket_path, pidfile, forward),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    output, _ = await process.communicate()
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        raise VMError(
            f"passt did not start (exit code {process.returncode}): {output.decode(errors='replace')[-400:]}"
        ) from None
