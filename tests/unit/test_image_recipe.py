"""The pure parts of the image builder: recipes and digests, module order, host checks.

Nothing here runs debootstrap or QEMU; the VM tests boot real images.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from boxd.errors import HostError, ImageError, InvalidInput
from boxd.guest import image as image_module
from boxd.guest.image import (
    ImageRecipe,
    KernelPackage,
    check_host_tools,
    find_debian_mirror,
    image_digest,
    load_image,
    module_load_order,
    module_name,
)

KERNEL = KernelPackage("linux-image-6.1.0-57-amd64", "6.1.192-3")


@pytest.fixture
def host_files(tmp_path, monkeypatch):
    """The host files digests read, as temporary copies a test may change."""
    files = {
        "HOST_CA_BUNDLE": tmp_path / "ca.crt",
        "BOXD_INIT_SCRIPT": tmp_path / "boxd-init",
        "INIT_SCRIPT": tmp_path / "init",
        "AGENT_SOURCE": tmp_path / "agent.py",
        "BUSYBOX": tmp_path / "busybox",
    }
    for name, path in files.items():
        path.write_text(f"original {name}\n")
        monkeypatch.setattr(image_module, name, path)
    return files


# --- package names ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["htop", "python3-numpy", "g++", "libstdc++6", "xz-utils", "r-base-core", "0ad"])
def test_debian_package_names_are_accepted(name):
    assert ImageRecipe(packages=(name,)).packages == (name,)


@pytest.mark.parametrize(
    "name", ["", "a", "Git", "-rf", "foo bar", "foo,bar", "--include=x", "foo=1.0", "foo:amd64", "../x", "x\n"]
)
def test_anything_else_is_invalid_input(name):
    with pytest.raises(InvalidInput) as raised:
        ImageRecipe(packages=(name,))
    assert raised.value.field == "packages"
    assert repr(name) in raised.value.message


def test_a_single_string_is_not_mistaken_for_its_letters():
    with pytest.raises(InvalidInput):
        ImageRecipe(packages="git")


def test_packages_are_sorted_deduplicated_and_base_packages_dropped():
    recipe = ImageRecipe(packages=("vim", "htop", "vim", "python3", "sudo"))
    assert recipe.packages == ("htop", "vim")
    assert recipe == ImageRecipe(packages=("htop", "vim"))
    assert ImageRecipe(packages=("python3",)) == ImageRecipe()


def test_the_base_has_what_e2b_templates_have():
    # E2B's SDK tests and user code expect git, curl and a "python" command.
    assert {"git", "curl", "python-is-python3"} <= set(image_module.BASE_PACKAGES)
    assert ImageRecipe(packages=("git", "curl")) == ImageRecipe()


# --- digests ---------------------------------------------------------------------------


def test_equal_recipes_have_equal_digests(host_files):
    assert ImageRecipe(packages=("vim", "htop")).digest() == ImageRecipe(packages=("htop", "vim", "htop")).digest()
    assert len(ImageRecipe().digest()) == 64


def test_packages_and_ca_trust_change_the_rootfs_digest(host_files):
    digests = {
        ImageRecipe().digest(),
        ImageRecipe(packages=("htop",)).digest(),
        ImageRecipe(packages=("htop", "vim")).digest(),
        ImageRecipe(trust_host_ca=False).digest(),
    }
    assert len(digests) == 4


def test_host_ca_content_counts_only_when_trusted(host_files):
    trusted, untrusted = ImageRecipe().digest(), ImageRecipe(trust_host_ca=False).digest()
    host_files["HOST_CA_BUNDLE"].write_text("another proxy CA\n")
    assert ImageRecipe().digest() != trusted
    assert ImageRecipe(trust_host_ca=False).digest() == untrusted


def test_a_host_without_ca_bundle_still_has_a_digest(host_files):
    host_files["HOST_CA_BUNDLE"].unlink()
    assert ImageRecipe().digest() != ImageRecipe(trust_host_ca=False).digest()


def test_boxd_init_and_recipe_version_change_the_rootfs_digest(host_files, monkeypatch):
    before = ImageRecipe().digest()
    host_files["BOXD_INIT_SCRIPT"].write_text("#!/bin/sh\nexec tini -- other\n")
    after_init = ImageRecipe().digest()
    monkeypatch.setattr(image_module, "ROOTFS_RECIPE_VERSION", image_module.ROOTFS_RECIPE_VERSION + 1)
    assert len({before, after_init, ImageRecipe().digest()}) == 3


def test_a_new_agent_changes_the_image_but_not_the_rootfs(host_files):
    rootfs, image = ImageRecipe().digest(), image_digest(ImageRecipe().digest(), KERNEL)
    host_files["AGENT_SOURCE"].write_text("print('agent v2')\n")
    assert ImageRecipe().digest() == rootfs
    assert image_digest(rootfs, KERNEL) != image


@pytest.mark.parametrize("changed", ["INIT_SCRIPT", "BUSYBOX"])
def test_initramfs_contents_change_the_image_digest(host_files, changed):
    before = image_digest("r" * 64, KERNEL)
    host_files[changed].write_text("changed\n")
    assert image_digest("r" * 64, KERNEL) != before


def test_kernel_version_and_rootfs_change_the_image_digest(host_files):
    digests = {
        image_digest("a" * 64, KERNEL),
        image_digest("b" * 64, KERNEL),
        image_digest("a" * 64, KernelPackage(KERNEL.name, "6.1.193-1")),
    }
    assert len(digests) == 3


def test_a_missing_agent_is_an_image_error(host_files):
    host_files["AGENT_SOURCE"].unlink()
    with pytest.raises(ImageError, match="agent"):
        image_digest("a" * 64, KERNEL)


# --- kernel modules --------------------------------------------------------------------

GRAPH = {
    "virtio_ring": [],
    "virtio": [],
    "virtio_pci_modern_dev": [],
    "virtio_pci": ["virtio_ring", "virtio_pci_modern_dev", "virtio"],
    "virtio_blk": ["virtio", "virtio_ring"],
    "failover": [],
    "net_failover": ["failover"],
    "virtio_net": ["virtio_ring", "virtio", "net_failover"],
    "crc16": [],
    "mbcache": [],
    "jbd2": [],
    "ext4": ["jbd2", "mbcache", "crc16"],
    "virtio_rng": ["virtio", "rng_core"],
}


def assert_dependencies_first(order, graph):
    for position, name in enumerate(order):
        for dependency in graph[name]:
            assert dependency in order[:position] or dependency == "rng_core", (name, dependency, order)


def test_dependencies_load_first_and_each_module_once():
    order = module_load_order(["virtio_pci", "virtio_blk", "virtio_net", "ext4"], GRAPH.get, set())
    assert_dependencies_first(order, GRAPH)
    assert len(order) == len(set(order))
    assert set(order) == set(GRAPH) - {"virtio_rng"}
    assert order[-1] == "ext4"


def test_builtin_modules_are_left_out():
    order = module_load_order(["virtio_rng", "vmgenid"], GRAPH.get, {"rng_core", "vmgenid"})
    assert order == ["virtio", "virtio_rng"]


def test_dashes_and_underscores_name_the_same_module():
    assert module_load_order(["virtio-blk"], GRAPH.get, set()) == ["virtio", "virtio_ring", "virtio_blk"]
    assert module_load_order(["virtio_rng"], GRAPH.get, {"rng-core"}) == ["virtio", "virtio_rng"]


def test_a_missing_module_names_who_needs_it():
    with pytest.raises(ImageError, match="rng_core.*virtio_rng"):
        module_load_order(["virtio_rng"], GRAPH.get, set())
    with pytest.raises(ImageError, match="no module nonesuch"):
        module_load_order(["nonesuch"], GRAPH.get, set())


def test_a_dependency_cycle_is_an_error():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"]}
    with pytest.raises(ImageError, match="cycle: a -> b -> c -> a"):
        module_load_order(["a"], graph.get, set())


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("kernel/drivers/char/hw_random/virtio-rng.ko", "virtio_rng"),
        ("kernel/fs/ext4/ext4.ko.xz", "ext4"),
        ("kernel/crypto/crc32c_generic.ko.zst", "crc32c_generic"),
        ("rng-core", "rng_core"),
    ],
)
def test_module_names_from_paths(path, name):
    assert module_name(path) == name


def elf_with_sections(sections: dict[str, bytes]) -> bytes:
    """A minimal ELF64 file with the given sections and a section name table."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name in sections) + b".shstrtab\0"
    body, headers, name_at = b"", [bytes(64)], 1
    for name, content in [*sections.items(), (".shstrtab", names)]:
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, 64 + len(body), len(content), 0, 0, 1, 0))
        body += content
        name_at += len(name) + 1
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x28, 64 + len(body))
    struct.pack_into("<HHH", header, 0x3A, 64, len(headers), len(headers) - 1)
    return bytes(header) + body + b"".join(headers)


def test_module_dependencies_come_from_modinfo():
    modinfo = b"license=GPL\0depends=jbd2,mbcache,crc16\0softdep=pre: crypto-crc32c\0name=ext4\0"
    module = elf_with_sections({".text": b"\x90" * 16, ".modinfo": modinfo})
    assert image_module._module_depends(module) == ["jbd2", "mbcache", "crc16"]
    assert image_module._module_depends(elf_with_sections({".modinfo": b"depends=\0name=crc16\0"})) == []


def test_a_module_without_modinfo_is_an_error():
    with pytest.raises(ImageError, match="modinfo"):
        image_module._module_depends(elf_with_sections({".text": b"\x90"}))


def elf_with_note(name: bytes, note_type: int) -> bytes:
    """An ELF64 file whose one PT_NOTE segment holds one note."""
    padded = name + b"\0" * (-len(name) % 4)
    note = struct.pack("<III", len(name), 4, note_type) + padded + b"\0" * 4
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x20, 64)
    struct.pack_into("<HH", header, 0x36, 56, 1)
    note_segment = struct.pack("<IIQQQQQQ", 4, 4, 64 + 56, 0, 0, len(note), len(note), 4)
    return bytes(header) + note_segment + note


def test_only_a_kernel_with_the_xen_pvh_note_counts_as_pvh_bootable():
    assert image_module._has_pvh_note(elf_with_note(b"Xen\0", 18))
    assert not image_module._has_pvh_note(elf_with_note(b"Xen\0", 17))
    assert not image_module._has_pvh_note(elf_with_note(b"GNU\0", 18))
    assert not image_module._has_pvh_note(b"not an elf at all" * 8)


def test_a_kernel_without_an_xz_payload_is_booted_compressed():
    assert image_module._pvh_kernel(bytes(4096)) is None


# --- build steps -----------------------------------------------------------------------


def test_a_failed_tool_names_the_step_and_the_tail_of_its_output():
    with pytest.raises(ImageError) as raised:
        with image_module._BuildProgress(enabled=False) as steps, steps.step("pack rootfs") as run:
            run(["sh", "-c", "echo working; echo the real reason >&2; exit 3"])
    assert raised.value.message.startswith("pack rootfs failed: sh -c")
    assert "status 3" in raised.value.message
    assert "the real reason" in raised.value.message
    assert raised.value.details["step"] == "pack rootfs"


@pytest.mark.parametrize("problem", [ImageError("the kernel has no module ext4"), FileNotFoundError(2, "gone")])
def test_other_failures_in_a_step_are_named_after_it(problem):
    with pytest.raises(ImageError, match="^build initramfs failed: ") as raised:
        with image_module._BuildProgress(enabled=False) as steps, steps.step("build initramfs"):
            raise problem
    assert raised.value.details["step"] == "build initramfs"


# --- host tools ------------------------------------------------------------------------


def elf_executable(interpreter: bool) -> bytes:
    """An ELF64 header and program header table, with or without PT_INTERP."""
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x20, 64)
    struct.pack_into("<HH", header, 0x36, 56, 2)
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, 0, 0, 0)
    interp = struct.pack("<IIQQQQQQ", 3 if interpreter else 1, 4, 0, 0, 0, 0, 0, 0)
    return bytes(header) + load + interp


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """A PATH with only the tools a test puts there, and a static busybox."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(image_module, "SBIN_DIRS", ())
    busybox = tmp_path / "busybox"
    busybox.write_bytes(elf_executable(interpreter=False))
    monkeypatch.setattr(image_module, "BUSYBOX", busybox)

    def install(*tools: str) -> None:
        for tool in tools:
            (bin_dir / tool).write_text("#!/bin/sh\n")
            (bin_dir / tool).chmod(0o755)

    return install


def test_all_tools_present_passes(fake_host):
    fake_host(*image_module.REQUIRED_TOOLS)
    check_host_tools()


def test_a_missing_tool_is_named_with_its_package(fake_host):
    fake_host(*(tool for tool in image_module.REQUIRED_TOOLS if tool not in ("debootstrap", "qemu-img")))
    with pytest.raises(HostError) as raised:
        check_host_tools()
    message = raised.value.message
    assert "debootstrap (Debian package debootstrap)" in message
    assert "qemu-img (Debian package qemu-utils)" in message
    assert "apt-get install debootstrap qemu-utils" in message
    assert "cpio" not in message
    assert raised.value.details["missing"] == {"debootstrap": "debootstrap", "qemu-img": "qemu-utils"}


def test_a_dynamic_or_missing_busybox_asks_for_busybox_static(fake_host, monkeypatch, tmp_path):
    fake_host(*image_module.REQUIRED_TOOLS)
    dynamic = tmp_path / "dynamic-busybox"
    dynamic.write_bytes(elf_executable(interpreter=True))
    for busybox in (dynamic, tmp_path / "absent"):
        monkeypatch.setattr(image_module, "BUSYBOX", busybox)
        with pytest.raises(HostError, match="busybox-static"):
            check_host_tools()


# --- mirror ----------------------------------------------------------------------------

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_the_mirror_comes_from_the_bookworm_main_entry():
    assert find_debian_mirror({"debian.sources": DEB822}) == "http://mirror.example/debian"
    security_first = "\n\n".join(reversed(DEB822.split("\n\n")))
    assert find_debian_mirror({"debian.sources": security_first}) == "http://mirror.example/debian"


def test_one_line_sources_are_read_too():
    sources = (
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] https://one.example/debian bookworm main contrib\n"
    )
    assert find_debian_mirror({"sources.list": sources}) == "https://one.example/debian"


def test_other_suites_disabled_entries_and_nothing_fall_back_to_deb_debian_org():
    fallback = "http://deb.debian.org/debian"
    assert find_debian_mirror({}) == fallback
    assert find_debian_mirror({"a.list": "deb http://x.example/debian trixie main\n"}) == fallback
    assert find_debian_mirror({"a.list": "deb http://x.example/debian bookworm contrib\n"}) == fallback
    disabled = "Types: deb\nURIs: http://x.example/debian\nSuites: bookworm\nComponents: main\nEnabled: no\n"
    assert find_debian_mirror({"x.sources": disabled}) == fallback


# --- loading ---------------------------------------------------------------------------


def fake_image(images: Path, digest: str = "d" * 64) -> Path:
    path = images / digest
    path.mkdir(parents=True)
    files = {}
    for name in ("vmlinux", "initrd.img", "rootfs.qcow2"):
        (path / name).write_bytes(b"x" * 10)
        files[name] = {"sha256": "0" * 64, "bytes": 10}
    manifest = {"digest": digest, "kernel": {"boot_file": "vmlinux", "release": "6.1.0-57-amd64"}, "files": files}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_loading_an_unknown_digest_or_a_non_digest_fails(tmp_path):
    with pytest.raises(ImageError, match="no image at"):
        load_image("e" * 64, home=tmp_path)
    with pytest.raises(ImageError, match="not an image digest"):
        load_image("latest", home=tmp_path)


def test_loading_names_the_broken_part(tmp_path):
    path = fake_image(tmp_path / "images")
    (path / "initrd.img").write_bytes(b"short")
    with pytest.raises(ImageError, match="initrd.img"):
        load_image(path)
    (path / "manifest.json").write_text("{")
    with pytest.raises(ImageError, match="manifest.json"):
        load_image(path)


def test_a_manifest_for_another_digest_is_rejected(tmp_path):
    path = fake_image(tmp_path / "images")
    path.rename(tmp_path / "images" / ("f" * 64))
    with pytest.raises(ImageError, match="different digest"):
        load_image("f" * 64, home=tmp_path)
