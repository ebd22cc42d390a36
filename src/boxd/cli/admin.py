"""``boxd keys ...`` and ``boxd accounts ...``: served by the local daemon only."""

from __future__ import annotations

import click

from boxd.cli import output
from boxd.cli.clients import local_admin


@click.group()
def keys() -> None:
    """API keys (admin, local daemon only)."""


@keys.command("create")
@click.option("--account", default="local", show_default=True, help="the account the key acts for")
@click.option("--name", help="a label to recognise the key by")
def create_key(account: str, name: str | None) -> None:
    """Create a key; it is printed this once."""
    with local_admin() as boxd:
        created = boxd.admin.create_key(account, name=name)
    output.err.print(f"key {created.id} for account {created.account}; it is shown only now:")
    click.echo(created.key)


@keys.command("list")
def list_keys() -> None:
    """Every key, revoked ones included (never their secrets)."""
    with local_admin() as boxd:
        output.keys(boxd.admin.list_keys())


@keys.command("revoke")
@click.argument("key_id", metavar="ID")
def revoke_key(key_id: str) -> None:
    """Revoke a key: calls made with it fail from now on."""
    with local_admin() as boxd:
        revoked = boxd.admin.revoke_key(key_id)
    output.err.print(f"revoked key {revoked.id} of account {revoked.account}")


@click.group()
def accounts() -> None:
    """Accounts and their limits (admin, local daemon only)."""


@accounts.command("set")
@click.argument("name")
@click.option("--max-machines", type=int, help="machines it may run at once (50 for a new account)")
def set_account(name: str, max_machines: int | None) -> None:
    """Create an account, or change its limit."""
    with local_admin() as boxd:
        output.accounts([boxd.admin.set_account(name, max_machines=max_machines)])


@accounts.command("list")
def list_accounts() -> None:
    with local_admin() as boxd:
        output.accounts(boxd.admin.list_accounts())
