"""``boxd machine ...``: create, fork, inspect, delete, suspend and wake, exec, files, checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from boxd.cli import output
from boxd.cli.clients import daemon
from boxd.errors import InvalidInput


@click.group()
def machine() -> None:
    """Machines: microVMs you can exec into and copy files to."""


@machine.command("new")
@click.argument("name")
@click.option("--vcpus", type=int, default=1, show_default=True, help="virtual CPUs")
@click.option("--memory", "memory_mib", type=int, default=512, show_default=True, help="RAM in MiB")
@click.option("--disk", "disk_gib", type=int, default=4, show_default=True, help="disk in GiB")
@click.option("--isolated", is_flag=True, help="no network beyond the machine itself")
@click.option(
    "--from-snapshot", "from_snapshot", metavar="REF",
    help="start at a snapshot's instant (NAME, NAME@VERSION or digest); its size comes from the snapshot",
)
@click.option(
    "--suspend-after", "suspend_after_s", type=float, metavar="S",
    help="idle seconds before it is suspended (0: never; default: the daemon's)",
)
@click.option(
    "--hibernate-after", "hibernate_after_s", type=float, metavar="S",
    help="further idle seconds before it is hibernated (0: never; default: the daemon's)",
)
@click.option("--no-idle", is_flag=True, help="never suspend or hibernate it for being idle")
@click.option("--http-port", type=int, default=8080, show_default=True, help="the port in the machine its URL leads to")
@click.option("--public", is_flag=True, help="its URL answers without the account's key")
@click.option("--host", help="on a cluster: the host to start it on (default: the roomiest of a few)")
@click.option("--timeout", type=float, default=300, show_default=True, help="seconds to wait until ready")
def new(
    name: str,
    vcpus: int,
    memory_mib: int,
    disk_gib: int,
    isolated: bool,
    from_snapshot: str | None,
    suspend_after_s: float | None,
    hibernate_after_s: float | None,
    no_idle: bool,
    http_port: int,
    public: bool,
    host: str | None,
    timeout: float,
) -> None:
    """Create a machine and wait until it is ready.

    Idle, it is suspended (memory kept, about a millisecond to wake) and later
    hibernated (state on disk, memory freed); any use of it wakes it.
    """
    if no_idle:
        if suspend_after_s is not None or hibernate_after_s is not None:
            raise click.UsageError("--no-idle leaves no room for --suspend-after or --hibernate-after")
        suspend_after_s = hibernate_after_s = 0
    doing = f"starting {name}" if from_snapshot is None else f"starting {name} from snapshot {from_snapshot}"
    with daemon() as boxd, output.err.status(doing):
        created = boxd.machines.new(
            name, vcpus=vcpus, memory_mib=memory_mib, disk_gib=disk_gib, isolated=isolated,
            from_snapshot=from_snapshot, suspend_after_s=suspend_after_s, hibernate_after_s=hibernate_after_s,
            http_port=http_port, public=public, host=host,
        )
        ready = boxd.machines.wait_until_ready(created, timeout=timeout)
    output.machine(ready)


@machine.command("fork")
@click.argument("source")
@click.argument("name")
@click.option("--timeout", type=float, default=120, show_default=True, help="seconds to wait until ready")
@click.option("--host", help="on a cluster: the host to fork onto (default: the source's while it has room)")
def fork(source: str, name: str, timeout: float, host: str | None) -> None:
    """Fork a running machine: NAME continues from this instant of SOURCE."""
    with daemon() as boxd, output.err.status(f"forking {source} into {name}"):
        forked = boxd.machines.fork(source, name, host=host)
        ready = boxd.machines.wait_until_ready(forked, timeout=timeout)
    output.machine(ready)


@machine.command("list")
def list_machines() -> None:
    """The machines of your account."""
    with daemon() as boxd:
        output.machines(boxd.machines.list())


@machine.command("get")
@click.argument("name")
def get(name: str) -> None:
    """One machine, by name or id."""
    with daemon() as boxd:
        output.machine(boxd.machines.get(name))


@machine.command("delete")
@click.argument("name")
def delete(name: str) -> None:
    """Stop a machine and remove it with its disk."""
    with daemon() as boxd:
        gone = boxd.machines.delete(name)
    output.err.print(f"deleted {gone.name} ({gone.id})")


@machine.command("suspend")
@click.argument("name")
def suspend(name: str) -> None:
    """Stop a machine's vCPUs, keeping its memory; any use of it wakes it."""
    with daemon() as boxd:
        output.machine(boxd.machines.suspend(name))


@machine.command("hibernate")
@click.argument("name")
def hibernate(name: str) -> None:
    """Save a machine's state to disk and free its memory; any use of it wakes it."""
    with daemon() as boxd, output.err.status(f"hibernating {name}"):
        hibernated = boxd.machines.hibernate(name)
    output.machine(hibernated)


@machine.command("resume")
@click.argument("name")
@click.option("--timeout", type=float, default=120, show_default=True, help="seconds to wait until ready")
def resume(name: str, timeout: float) -> None:
    """Wake a suspended or hibernated machine and wait until it is ready."""
    with daemon() as boxd, output.err.status(f"waking {name}"):
        resumed = boxd.machines.resume(name)
        ready = boxd.machines.wait_until_ready(resumed, timeout=timeout)
    output.machine(ready)


def _environment(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--env")
        env[key] = value
    return env


@machine.command(
    "exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option("--timeout", type=float, help="seconds before the command is killed")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="an environment variable (repeatable)")
@click.option("--cwd", help="working directory in the machine")
@click.option("--user", help="who runs the command (default: boxd)")
@click.option("--stdin", "send_stdin", is_flag=True, help="send this program's standard input to the command")
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def exec_command(
    ctx: click.Context,
    timeout: float | None,
    env_pairs: tuple[str, ...],
    cwd: str | None,
    user: str | None,
    send_stdin: bool,
    name: str,
    command: tuple[str, ...],
) -> None:
    """Run a command, its output streamed as it comes; exits with the command's exit code.

    One argument is a shell string (boxd machine exec NAME -- 'ls | wc -l'); several are
    the program and its arguments (boxd machine exec NAME -- ls -la /).
    """
    if command[:1] == ("--",):  # options stop at NAME, so click leaves the separator in
        command = command[1:]
    if not command:
        raise click.UsageError("give the command to run after the machine's name")
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    stdin = sys.stdin.buffer.read() if send_stdin else None
    exit_code = 0
    with daemon() as boxd:
        events = boxd.machines.exec_stream(
            name, cmd, timeout=timeout, env=_environment(env_pairs), cwd=cwd, user=user, stdin=stdin
        )
        for item in events:
            if item.type in ("stdout", "stderr"):
                stream = sys.stdout.buffer if item.type == "stdout" else sys.stderr.buffer
                stream.write(item.data)
                stream.flush()
            elif item.type == "exit":
                exit_code = item.exit_code or 0
                if item.timed_out:
                    output.err.print(f"error: the command timed out after {timeout:g} s")
    ctx.exit(exit_code)


@machine.group()
def files() -> None:
    """Copy files into and out of a machine."""


@files.command("upload")
@click.argument("name")
@click.argument("local", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("remote")
@click.option("--mode", help="permission bits in octal, e.g. 755 (default 644)")
def upload(name: str, local: Path, remote: str, mode: str | None) -> None:
    """Copy LOCAL to the absolute path REMOTE in the machine."""
    try:
        bits = None if mode is None else int(mode, 8)
    except ValueError:
        raise InvalidInput(f"--mode: expected octal permission bits such as 644, got {mode!r}", field="mode") from None
    with daemon() as boxd, open(local, "rb") as handle:
        written = boxd.machines.files.upload(name, remote, handle, mode=bits)
    output.err.print(f"uploaded {written.size} bytes to {name}:{written.path}")


@files.command("download")
@click.argument("name")
@click.argument("remote")
@click.argument("local", type=click.Path(dir_okay=False, writable=True, path_type=Path))
def download(name: str, remote: str, local: Path) -> None:
    """Copy the file REMOTE of the machine to LOCAL."""
    with daemon() as boxd:
        size = boxd.machines.files.download_to(name, remote, local)
    output.err.print(f"downloaded {size} bytes to {local}")


@machine.group()
def checkpoint() -> None:
    """Instants of a machine to rewind it to; they go when the machine does."""


@checkpoint.command("save")
@click.argument("name")
@click.argument("checkpoint_name", metavar="CHECKPOINT")
def save_checkpoint(name: str, checkpoint_name: str) -> None:
    """Keep this instant of the running machine NAME as CHECKPOINT."""
    with daemon() as boxd:
        saved = boxd.machines.checkpoints.save(name, checkpoint_name)
    output.err.print(f"saved checkpoint {saved.name} of {name} (it paused {output.pause(saved.pause_ms)})")


@checkpoint.command("restore")
@click.argument("name")
@click.argument("checkpoint_name", metavar="CHECKPOINT")
@click.option("-y", "--yes", is_flag=True, help="do not ask for confirmation")
def restore_checkpoint(name: str, checkpoint_name: str, yes: bool) -> None:
    """Rewind NAME in place to CHECKPOINT; what happened in it since is lost."""
    question = f"Rewind {name} to checkpoint {checkpoint_name}? What happened in it since is lost"
    if not yes and not click.confirm(question, default=False, err=True):
        raise click.ClickException(f"{name} not restored (give -y to restore without asking)")
    with daemon() as boxd, output.err.status(f"restoring {name} to {checkpoint_name}"):
        restored = boxd.machines.checkpoints.restore(name, checkpoint_name)
    output.err.print(f"restored {name} to checkpoint {checkpoint_name}")
    output.machine(restored)


@checkpoint.command("list")
@click.argument("name")
def list_checkpoints(name: str) -> None:
    """The checkpoints of machine NAME, oldest first."""
    with daemon() as boxd:
        output.checkpoints(boxd.machines.checkpoints.list(name))


@checkpoint.command("delete")
@click.argument("name")
@click.argument("checkpoint_name", metavar="CHECKPOINT")
def delete_checkpoint(name: str, checkpoint_name: str) -> None:
    """Forget a checkpoint of NAME and free what it held."""
    with daemon() as boxd:
        boxd.machines.checkpoints.delete(name, checkpoint_name)
    output.err.print(f"deleted checkpoint {checkpoint_name} of {name}")
