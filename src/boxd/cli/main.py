"""The ``boxd`` command.

Every error comes out as one line, ``error: <message>``, with exit status 1, and 2 for
a usage error; ``boxd machine exec`` exits with the command's own status.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import click

from boxd.cli.admin import accounts, keys
from boxd.cli.machine import machine
from boxd.cli.snapshots import snapshots
from boxd.daemon import DEFAULT_PORT
from boxd.daemon.idle import IdlePolicy
from boxd.errors import BoxdError

# Commands whose module is imported only when used (and may be absent from a build).
_LAZY_COMMANDS = {"image": "boxd.cli.image_cmd"}


def _fail(message: str, status: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(status)


class BoxdCommand(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        present = [name for name, module in _LAZY_COMMANDS.items() if importlib.util.find_spec(module)]
        return sorted([*super().list_commands(ctx), *present])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = _LAZY_COMMANDS.get(name)
        if module is not None and importlib.util.find_spec(module):
            return getattr(importlib.import_module(module), name)
        return super().get_command(ctx, name)

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        try:
            result = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as error:
            where = f" (see: {error.ctx.command_path} --help)" if error.ctx else ""
            _fail(error.format_message() + where, 2)
        except click.ClickException as error:
            _fail(error.format_message(), error.exit_code)
        except BoxdError as error:
            _fail(error.message, 1)
        except (click.Abort, KeyboardInterrupt):
            _fail("interrupted", 130)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=BoxdCommand)
@click.version_option(package_name="boxd")
def cli() -> None:
    """boxd: microVMs you can fork while they run.

    Without BOXD_URL, commands talk to the local daemon of BOXD_HOME and start it if
    it is not running.
    """


@cli.command()
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, envvar="BOXD_PORT")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="BOXD_HOST")
@click.option(
    "--max-upload", type=int, default=2 * 1024**3, show_default=True, envvar="BOXD_MAX_UPLOAD",
    help="largest file upload accepted, in bytes",
)
@click.option(
    "--suspend-after", type=float, default=IdlePolicy.suspend_after_s, show_default=True,
    envvar="BOXD_SUSPEND_AFTER", help="idle seconds before a machine suspends (0: never), unless it asks otherwise",
)
@click.option(
    "--hibernate-after", type=float, default=IdlePolicy.hibernate_after_s, show_default=True,
    envvar="BOXD_HIBERNATE_AFTER", help="further idle seconds before a suspended machine hibernates (0: never)",
)
@click.option(
    "--ray", "ray_address", metavar="ADDRESS", envvar="BOXD_RAY",
    help="run machines on the hosts of this Ray cluster (e.g. auto, or HOST:6379); needs boxd[ray]",
)
@click.option(
    "--host-root", type=click.Path(path_type=Path), envvar="BOXD_HOST_ROOT",
    help="with --ray: where each node's host agent keeps its state, on that node [BOXD_HOME/hosts]",
)
@click.option(
    "--host-ports", metavar="FIRST-LAST", envvar="BOXD_HOST_PORTS",
    help="with --ray: the ports each host's machine URLs and incoming forks take, on that host [any free]",
)
def serve(port: int, host: str, max_upload: int, suspend_after: float, hibernate_after: float,
          ray_address: str | None, host_root: Path | None, host_ports: str | None) -> None:
    """Run the daemon: HTTP on HOST:PORT and the unix socket BOXD_HOME/boxd.sock.

    Machine URLs (http://NAME.localhost:PORT/) are served on the same port. With --ray,
    every Ray node that offers the boxd_host resource gets a host agent, and machines
    are placed on those hosts.
    """
    from boxd.config import boxd_home
    from boxd.daemon.machines import Limits
    from boxd.daemon.server import run

    if suspend_after < 0 or hibernate_after < 0:
        raise click.BadParameter("idle times are seconds, 0 or more", param_hint="--suspend-after/--hibernate-after")
    idle = IdlePolicy(suspend_after_s=suspend_after, hibernate_after_s=hibernate_after)
    run(boxd_home(), host=host, port=port, limits=Limits(max_upload_bytes=max_upload), idle=idle,
        ray_address=ray_address, host_root=host_root, host_ports=_port_range(host_ports))


def _port_range(text: str | None) -> range | None:
    if text is None:
        return None
    first, _, last = text.partition("-")
    try:
        ports = range(int(first), int(last) + 1)
    except ValueError:
        raise click.BadParameter(f"expected FIRST-LAST, got {text!r}", param_hint="--host-ports") from None
    if not (ports and 1024 <= ports.start and ports.stop <= 65536):
        raise click.BadParameter(f"a range of ports from 1024 to 65535, got {text!r}", param_hint="--host-ports")
    return ports


cli.add_command(machine)
cli.add_command(snapshots)
cli.add_command(keys)
cli.add_command(accounts)


def main() -> None:
    cli.main(prog_name="boxd")
