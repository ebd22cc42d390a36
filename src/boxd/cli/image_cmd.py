"""``boxd image ...``: build guest images on this host (no daemon involved)."""

from __future__ import annotations

import click

from boxd.guest.image import ImageRecipe, build_image


@click.group()
def image() -> None:
    """Guest images: kernel, initramfs and Debian root filesystem."""


@image.command("build")
@click.option(
    "--package", "-p", "packages", multiple=True, metavar="PKG", help="an extra Debian package to install (repeatable)"
)
@click.option(
    "--no-host-ca",
    is_flag=True,
    help="do not copy this host's CA bundle into the guest (it is copied by default, for TLS-intercepting proxies)",
)
@click.option(
    "--force",
    is_flag=True,
    help="rebuild even if the image exists; disks of machines made from the old one stop working",
)
def build(packages: tuple[str, ...], no_host_ca: bool, force: bool) -> None:
    """Build the guest image into BOXD_HOME (needs root; about a minute the first time)."""
    built = build_image(ImageRecipe(packages=packages, trust_host_ca=not no_host_ca), force=force)
    # Plain lines, not a rich table: long paths must never be cut to the terminal's width.
    for key, value in [
        ("digest", built.digest),
        ("path", built.path),
        ("kernel", built.kernel),
        ("initrd", built.initrd),
        ("rootfs", built.rootfs),
        ("kernel version", built.kernel_version),
    ]:
        click.echo(f"{key:<16}{value}")
