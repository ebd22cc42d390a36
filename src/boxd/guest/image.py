"""Build, cache and load guest images.

An image is a directory ``images_dir()/<digest>/`` with what QEMU needs to boot a guest:
``vmlinuz`` (Debian's kernel), ``initrd.img`` (busybox, the virtio and ext4 modules and
the agent), ``rootfs.qcow2`` (Debian bookworm) and ``manifest.json``. Most images also
hold ``vmlinux``, the same kernel uncompressed, which QEMU boots directly through its
PVH entry point: under TCG that skips about 3 s of decompressing an xz kernel at every
boot. ``Image.kernel`` is whichever of the two to pass to ``-kernel``.

Two cache levels keep rebuilds cheap:

1. The root filesystem is the slow part (debootstrap, about a minute). It is cached as
   ``cache/rootfs/<recipe digest>.qcow2``, where the digest (``ImageRecipe.digest()``)
   covers everything that goes into it: packages, the host CA bundle when trusted,
   ``files/boxd-init`` and ``ROOTFS_RECIPE_VERSION``.
2. The image digest adds what goes into the initramfs: ``files/init``, the kernel
   package, busybox and ``agent.py``. The initramfs carries the agent and its ``/init``
   copies it into the root filesystem at boot, so a new agent means a new initramfs
   (seconds), never a new root filesystem.

Everything is built in a hidden directory next to its final place and renamed there
when complete, so an interrupted build leaves nothing that looks like an image. A lock
per digest keeps two builders of the same image or root filesystem apart.

Building needs root (debootstrap chroots) and the host tools in ``REQUIRED_TOOLS``.
"""

from __future__ import annotations

import fcntl
import functools
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from boxd.durable import fsync_path, sha256_file
from boxd.config import boxd_home, images_dir
from boxd.errors import HostError, ImageError, InvalidInput

# Bump when the steps that make a root filesystem change, so cached ones are rebuilt.
ROOTFS_RECIPE_VERSION = 2
# Bump when the way the kernel and initramfs are put into an image changes.
IMAGE_RECIPE_VERSION = 1
MANIFEST_FORMAT = 1

SUITE = "bookworm"
FALLBACK_MIRROR = "http://deb.debian.org/debian"
# git, curl and the "python" name (python-is-python3) are in E2B's base template too.
BASE_PACKAGES = (
    "ca-certificates",
    "curl",
    "e2fsprogs",
    "git",
    "iproute2",
    "procps",
    "python-is-python3",
    "python3",
    "python3-pip",
    "python3-venv",
    "sudo",
    "tini",
)
GUEST_USERS = (("boxd", 1000), ("user", 1001))  # "user" is E2B's default user
GUEST_HOSTNAME = "boxd"
GUEST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

KERNEL_METAPACKAGE = "linux-image-amd64"
# Loaded in this order where they do not depend on each other. ext4 and jbd2 only
# soft-depend on "crypto-crc32c", which insmod cannot resolve, hence crc32c_generic.
KERNEL_MODULES = (
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "virtio_rng",
    "vmgenid",
    "crc32c_generic",
    "ext4",
)

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUSYBOX = Path("/bin/busybox")
FILES = Path(__file__).with_name("files")
INIT_SCRIPT = FILES / "init"
BOXD_INIT_SCRIPT = FILES / "boxd-init"
AGENT_SOURCE = Path(__file__).with_name("agent.py")

# Host tool -> the Debian package that provides it.
REQUIRED_TOOLS = {
    "apt-cache": "apt",
    "apt-get": "apt",
    "cpio": "cpio",
    "debootstrap": "debootstrap",
    "dpkg-deb": "dpkg",
    "mkfs.ext4": "e2fsprogs",
    "qemu-img": "qemu-utils",
    "zstd": "zstd",  # kernels whose modules are .ko.zst
}

# debootstrap and mkfs.ext4 live here, which is not always on a user's PATH.
SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")

MIN_ROOTFS_BYTES = 1 << 30
ROOTFS_HEADROOM = 1.3
OUTPUT_TAIL_LINES = 25

PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+\Z")  # Debian policy 5.6.1
DIGEST = re.compile(r"[0-9a-f]{64}\Z")
PEM_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----")


@dataclass(frozen=True)
class ImageRecipe:
    """What goes into an image's root filesystem beyond the fixed base.

    ``packages`` are extra Debian packages (main component of bookworm). They are
    validated and kept sorted and without duplicates or base packages, so equal
    recipes compare and digest equal.

    ``trust_host_ca`` copies this host's CA bundle (``HOST_CA_BUNDLE``) into the guest's
    trust store. It is on by default on purpose: hosts that reach the internet through
    a TLS-intercepting proxy (like the machines boxd is developed on) or that trust a
    company CA need it, or ``pip install`` in the guest fails certificate checks.
    Turn it off (``boxd image build --no-host-ca``) for a guest that trusts only
    Debian's CAs.
    """

    packages: tuple[str, ...] = ()
    trust_host_ca: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.packages, str):
            raise InvalidInput("packages must be a list of package names", field="packages")
        for name in self.packages:
            if not isinstance(name, str) or not PACKAGE_NAME.match(name):
                raise InvalidInput(f"not a Debian package name: {name!r}", field="packages")
        object.__setattr__(self, "packages", tuple(sorted(set(self.packages) - set(BASE_PACKAGES))))

    def digest(self) -> str:
        """Digest of the root filesystem this recipe builds (the first cache level)."""
        host_ca = _host_ca_bundle() if self.trust_host_ca else None
        return _digest_of(
            {
                "rootfs_recipe_version": ROOTFS_RECIPE_VERSION,
                "suite": SUITE,
                "base_packages": BASE_PACKAGES,
                "packages": self.packages,
                "trust_host_ca": self.trust_host_ca,
                "host_ca_sha256": _sha256(host_ca) if host_ca is not None else None,
                "boxd_init_sha256": _sha256(BOXD_INIT_SCRIPT.read_bytes()),
            }
        )


@dataclass(frozen=True)
class KernelPackage:
    name: str  # linux-image-6.1.0-57-amd64
    version: str  # 6.1.192-3


@dataclass(frozen=True)
class Image:
    digest: str
    path: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_version: str  # the kernel release, as uname -r reports it in the guest
    manifest: dict = field(repr=False, compare=False)


def image_digest(rootfs_digest: str, kernel: KernelPackage) -> str:
    """The image digest: the root filesystem's plus everything in the initramfs."""
    return _digest_of(
        {
            "rootfs": rootfs_digest,
            "image_recipe_version": IMAGE_RECIPE_VERSION,
            "kernel_package": kernel.name,
            "kernel_package_version": kernel.version,
            "kernel_modules": KERNEL_MODULES,
            "init_sha256": _sha256(INIT_SCRIPT.read_bytes()),
            "busybox_sha256": _sha256(BUSYBOX.read_bytes()),
            "agent_sha256": _sha256(_agent_source()),
        }
    )


def ensure_image(recipe: ImageRecipe = ImageRecipe(), home: Path | None = None, *, progress: bool = False) -> Image:
    """The image for ``recipe``: the cached one if it is there and intact, else a new build."""
    return build_image(recipe, home=home, progress=progress)


def build_image(
    recipe: ImageRecipe = ImageRecipe(), *, home: Path | None = None, force: bool = False, progress: bool = True
) -> Image:
    """Build the image for ``recipe``, reusing cached levels, and return it.

    An intact image with the same digest is returned as is unless ``force``. ``force``
    rebuilds the root filesystem and the initramfs and replaces the image in place:
    disks of existing machines that use the old image as their backing file are then
    no longer valid.
    """
    check_host_tools()
    kernel = resolve_kernel_package()
    rootfs_digest = recipe.digest()
    digest = image_digest(rootfs_digest, kernel)
    final = images_dir(home) / digest
    if not force and (cached := _intact_image(final)):
        return cached
    if os.geteuid() != 0:
        raise HostError("building a guest image needs root: debootstrap and chroot need it")

    started = time.monotonic()
    with _BuildProgress(progress) as steps, _locked(final.parent / f".lock-{digest}", steps):
        if not force and (cached := _intact_image(final)):
            return cached  # another builder finished it while we waited
        _remove_stale_builds(final.parent, digest)
        build_dir = Path(tempfile.mkdtemp(prefix=f".build-{digest}-", dir=final.parent))
        try:
            scratch = build_dir / "scratch"
            deb = _download_kernel(kernel, _cache_dir(home), steps)
            with steps.step("unpack kernel") as run:
                release, boot_file = _unpack_kernel(deb, scratch / "kernel", build_dir, run)
            with steps.step("build initramfs") as run:
                modules = _build_initramfs(scratch, release, build_dir / "initrd.img", run)
            kernel_facts = {"package": kernel.name, "version": kernel.version, "release": release}
            kernel_facts |= {"boot_file": boot_file, "modules": modules}
            cached_rootfs = _ensure_rootfs(recipe, rootfs_digest, home, force, steps)
            with steps.step("write image"):
                _link_or_copy(cached_rootfs, build_dir / "rootfs.qcow2")
                _remove_tree(scratch)
                manifest = _manifest(recipe, digest, rootfs_digest, kernel_facts, build_dir, started)
                (build_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
                for path in [*build_dir.iterdir(), build_dir]:
                    fsync_path(path)
                build_dir.chmod(0o755)  # mkdtemp made it private; QEMU may run as another user
                _replace_dir(build_dir, final)
        except BaseException:
            _remove_tree(build_dir)
            raise
    return load_image(final)


def load_image(digest_or_path: str | Path, home: Path | None = None) -> Image:
    """The image with this digest (or in this directory), checked to be complete.

    Raises ImageError naming what is missing or broken.
    """
    if isinstance(digest_or_path, str) and DIGEST.match(digest_or_path):
        path = images_dir(home) / digest_or_path
    elif isinstance(digest_or_path, Path) or "/" in digest_or_path:
        path = Path(digest_or_path)
    else:
        raise ImageError(f"not an image digest or path: {digest_or_path!r}")
    if not path.is_dir():
        raise ImageError(f"no image at {path}")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        digest, kernel, files = manifest["digest"], manifest["kernel"], manifest["files"]
        boot_file, release = kernel["boot_file"], kernel["release"]
        image = Image(digest, path, path / boot_file, path / "initrd.img", path / "rootfs.qcow2", release, manifest)
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
    except KeyError as error:
        raise ImageError(f"image {path}: manifest.json has no {error} (built by an older boxd?)") from error
    except (OSError, ValueError, TypeError) as error:
        raise ImageError(f"image {path}: unreadable manifest.json ({error})") from error
    if digest != path.name:
        raise ImageError(f"image {path}: its manifest names a different digest, {digest}")
    for part in (image.kernel, image.initrd, image.rootfs):
        if part.name not in sizes:
            raise ImageError(f"image {path}: its manifest does not list {part.name}")
    for name, size in sizes.items():
        if not (path / name).is_file() or (path / name).stat().st_size != size:
            raise ImageError(f"image {path}: {name} is missing or not the size its manifest says")
    try:
        info = json.loads(_run("check image", ["qemu-img", "info", "-U", "--output=json", image.rootfs]))
    except ValueError as error:
        raise ImageError(f"image {path}: qemu-img info gave no JSON for rootfs.qcow2 ({error})") from error
    if info.get("format") != "qcow2" or "backing-filename" in info:
        raise ImageError(f"image {path}: rootfs.qcow2 is not a standalone qcow2 image")
    return image


def check_host_tools() -> None:
    """Raise HostError naming every missing tool and the Debian package that provides it."""
    missing = {tool: package for tool, package in REQUIRED_TOOLS.items() if not _which(tool)}
    if not BUSYBOX.is_file() or not _is_static_elf(BUSYBOX):
        missing[f"a static busybox at {BUSYBOX}"] = "busybox-static"
    if missing:
        listed = ", ".join(f"{tool} (Debian package {package})" for tool, package in missing.items())
        packages = " ".join(sorted(set(missing.values())))
        raise HostError(
            f"building a guest image needs {listed}; install with: apt-get install {packages}",
            missing=missing,
        )


def resolve_kernel_package() -> KernelPackage:
    """The versioned kernel package behind linux-image-amd64, as the host's apt knows it."""
    step = "find kernel package"
    try:
        depends = _run(step, ["apt-cache", "depends", KERNEL_METAPACKAGE])
    except ImageError as error:
        raise HostError(
            f"apt does not know {KERNEL_METAPACKAGE} (run apt-get update?): {error.details.get('output', '')}"
        ) from error
    name = re.search(r"Depends:\s*(linux-image-\d\S*-amd64)\s*$", depends, re.MULTILINE)
    if not name:
        raise HostError(f"apt lists no versioned kernel package behind {KERNEL_METAPACKAGE}:\n{depends}")
    shown = _run(step, ["apt-cache", "show", "--no-all-versions", name.group(1)])
    version = re.search(r"^Version:\s*(\S+)", shown, re.MULTILINE)
    if not version:
        raise HostError(f"apt shows no version of {name.group(1)}")
    return KernelPackage(name.group(1), version.group(1))


def module_load_order(
    wanted: Iterable[str], depends_of: Callable[[str], Sequence[str] | None], builtin: Iterable[str]
) -> list[str]:
    """Modules to insmod, each after its dependencies; built-in modules are left out.

    ``depends_of(name)`` gives a module's direct dependencies, or None when the kernel
    has no such module. ``builtin`` may hold names or paths (modules.builtin lines).
    Names compare with ``-`` and ``_`` alike, as the kernel does.
    """
    builtin = {module_name(name) for name in builtin}
    order: list[str] = []
    in_progress: list[str] = []

    def visit(name: str, needed_by: str | None) -> None:
        name = module_name(name)
        if name in builtin or name in order:
            return
        if name in in_progress:
            raise ImageError(f"kernel modules depend on each other in a cycle: {' -> '.join([*in_progress, name])}")
        depends = depends_of(name)
        if depends is None:
            wanted_by = f" (needed by {needed_by})" if needed_by else ""
            raise ImageError(f"the kernel has no module {name}{wanted_by}")
        in_progress.append(name)
        for dependency in depends:
            visit(dependency, name)
        in_progress.pop()
        order.append(name)

    for name in wanted:
        visit(name, None)
    return order


def module_name(file_or_name: str) -> str:
    """``kernel/drivers/char/hw_random/virtio-rng.ko.xz`` -> ``virtio_rng``."""
    base = file_or_name.rsplit("/", 1)[-1]
    return re.sub(r"\.ko(\.\w+)?$", "", base).replace("-", "_")


def find_debian_mirror(sources: dict[str, str]) -> str:
    """The URI the host's apt uses for bookworm main, from apt source files by name.

    Reads both the one-line format (``*.list``) and deb822 (``*.sources``).
    """
    for filename, text in sources.items():
        if filename.endswith(".sources"):
            entries = [_deb822_entry(stanza) for stanza in re.split(r"\n\s*\n", text)]
        else:
            entries = [_one_line_entry(line) for line in text.splitlines()]
        for entry in entries:
            if (
                entry
                and "deb" in entry["types"]
                and SUITE in entry["suites"]
                and "main" in entry["components"]
                and entry.get("enabled", "yes") != "no"
            ):
                for uri in entry["uris"]:
                    if uri.startswith(("http://", "https://")):
                        return uri.rstrip("/")
    return FALLBACK_MIRROR


def _host_debian_mirror() -> str:
    apt = Path("/etc/apt")
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    files += sorted((apt / "sources.list.d").glob("*.sources"))
    return find_debian_mirror({str(path): path.read_text(errors="replace") for path in files if path.is_file()})


def _one_line_entry(line: str) -> dict | None:
    match = re.match(r"\s*(deb)\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)", line.split("#", 1)[0])
    if not match:
        return None
    kind, uri, suite, components = match.groups()
    return {"types": [kind], "uris": [uri], "suites": [suite], "components": components.split()}


def _deb822_entry(stanza: str) -> dict | None:
    fields: dict[str, str] = {}
    key = None
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0].isspace() and key:
            fields[key] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            key = key.strip().lower()
            fields[key] = value.strip()
    if "uris" not in fields:
        return None
    entry = {name: fields.get(name, "").split() for name in ("types", "uris", "suites", "components")}
    entry["enabled"] = fields.get("enabled", "yes").lower()
    return entry


# --- building blocks -------------------------------------------------------------------


class _StepMark(SpinnerColumn):
    """A spinner while a step runs, then its outcome."""

    def render(self, task: Task) -> Text:
        return Text.from_markup(task.fields["mark"]) if task.finished else super().render(task)


class _BuildProgress:
    """Named build steps on a rich progress display on stderr (silent when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self._display = Progress(
            _StepMark(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )

    def __enter__(self) -> _BuildProgress:
        self._display.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._display.stop()

    @contextmanager
    def step(self, name: str) -> Iterator[Callable[..., str]]:
        """Show a step; yields a run(argv) bound to it. Errors come out as ImageErrors naming the step."""
        task = self._display.add_task(name, total=1, mark="")
        try:
            yield functools.partial(_run, name)
        except BaseException as error:
            self._display.update(task, completed=1, mark="[red]✗[/]", description=f"[red]{name}[/]")
            unnamed = isinstance(error, ImageError) and "step" not in error.details
            if unnamed or isinstance(error, OSError):
                message = error.message if isinstance(error, ImageError) else str(error)
                raise ImageError(f"{name} failed: {message}", step=name) from error
            raise
        self._display.update(task, completed=1, mark="[green]✓[/]")


def _run(step: str, argv: Sequence[str | Path], *, cwd: Path | None = None, input: str | None = None) -> str:
    """Run a host tool and return its stdout; failure is an ImageError naming the step, with the output's tail."""
    argv = [str(arg) for arg in argv]
    try:
        done = subprocess.run(
            argv, cwd=cwd, input=input, capture_output=True, text=True, errors="replace", env=_tool_environment()
        )
    except OSError as error:
        raise ImageError(f"{step} failed: cannot run {argv[0]}: {error}", step=step, command=argv) from error
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-OUTPUT_TAIL_LINES:])
        shown = " ".join(argv[:3]) + (" ..." if len(argv) > 3 else "")
        raise ImageError(
            f"{step} failed: {shown} exited with status {done.returncode}:\n{tail}",
            step=step,
            command=argv,
            output=tail,
        )
    return done.stdout


def _tool_environment() -> dict[str, str]:
    return {**os.environ, "PATH": _search_path(), "LC_ALL": "C.UTF-8"}


def _search_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=_search_path())


def _is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a program interpreter (a dynamic busybox has one)."""
    with path.open("rb") as handle:
        header = handle.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
            return False
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        handle.seek(phoff)
        table = handle.read(phentsize * phnum)
    pt_interp = 3
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def _cache_dir(home: Path | None) -> Path:
    return (home or boxd_home()) / "cache"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _digest_of(fields: dict) -> str:
    return _sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


def _host_ca_bundle() -> bytes | None:
    """The host's CA bundle, or None when it has none (then there is nothing to carry over)."""
    try:
        return HOST_CA_BUNDLE.read_bytes()
    except FileNotFoundError:
        return None


def _agent_source() -> bytes:
    try:
        return AGENT_SOURCE.read_bytes()
    except OSError as error:
        raise ImageError(f"the guest agent {AGENT_SOURCE} is missing: boxd is not installed completely") from error


def _intact_image(path: Path) -> Image | None:
    if not path.is_dir():
        return None
    try:
        return load_image(path)
    except ImageError:
        return None


@contextmanager
def _locked(lock_file: Path, steps: _BuildProgress) -> Iterator[None]:
    """Hold an exclusive flock on lock_file; show a step while another builder holds it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with steps.step("wait for another build"):
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _remove_stale_builds(parent: Path, held_digest: str) -> None:
    """Remove what killed builds left in parent: build dirs whose digest's lock nobody holds.

    We hold held_digest's lock ourselves (a second flock on it would fail), so its
    leftovers are stale by definition.
    """
    for stale in parent.glob(".build-*"):
        digest = stale.name.split("-")[1]
        if digest == held_digest:
            _remove_tree(stale)
            continue
        with (parent / f".lock-{digest}").open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            _remove_tree(stale)


def _remove_tree(path: Path) -> None:
    """rm -rf, but first unmount anything a killed debootstrap left mounted inside."""
    if not path.exists():
        return
    inside = str(path.resolve()) + "/"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mountpoint in sorted((m for m in mounts if m.startswith(inside)), reverse=True):
        _run("clean up", ["umount", "--lazy", mountpoint])
    shutil.rmtree(path)


def _replace_dir(source: Path, target: Path) -> None:
    if target.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".build-{target.name}-old-", dir=target.parent))
        target.rename(retired / target.name)
        source.rename(target)
        shutil.rmtree(retired)
    else:
        source.rename(target)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


# --- kernel and initramfs --------------------------------------------------------------


def _download_kernel(kernel: KernelPackage, cache: Path, steps: _BuildProgress) -> Path:
    """The kernel .deb, from the cache or downloaded into it (never installed on the host)."""
    deb = cache / f"{kernel.name}_{kernel.version}_amd64.deb"
    with steps.step("download kernel" + (" (cached)" if deb.is_file() else "")) as run:
        if not deb.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as download:
                run(["apt-get", "download", f"{kernel.name}={kernel.version}"], cwd=Path(download))
                (fetched,) = Path(download).glob("*.deb")
                fetched.rename(deb)
    return deb


def _unpack_kernel(deb: Path, into: Path, image_dir: Path, run: Callable[..., str]) -> tuple[str, str]:
    """Extract the kernel package, put vmlinuz (and vmlinux if PVH-bootable) in image_dir.

    Returns the kernel release and the name of the file to boot.
    """
    into.mkdir(parents=True)
    run(["dpkg-deb", "-x", deb, into])
    releases = [path.name for path in _modules_root(into).iterdir() if path.is_dir()]
    if len(releases) != 1:
        raise ImageError(f"{deb.name} should hold the modules of one kernel, found {releases}")
    (release,) = releases
    bzimage = (into / "boot" / f"vmlinuz-{release}").read_bytes()
    (image_dir / "vmlinuz").write_bytes(bzimage)
    elf = _pvh_kernel(bzimage)
    if elf is None:
        return release, "vmlinuz"
    (image_dir / "vmlinux").write_bytes(elf)
    return release, "vmlinux"


def _pvh_kernel(bzimage: bytes) -> bytes | None:
    """The uncompressed kernel inside an xz bzImage, if it has a PVH entry point QEMU can boot."""
    setup_bytes = ((bzimage[0x1F1] or 4) + 1) * 512  # setup_sects, per the x86 boot protocol
    payload_offset, payload_length = struct.unpack_from("<II", bzimage, 0x248)
    payload = bzimage[setup_bytes + payload_offset : setup_bytes + payload_offset + payload_length]
    if not payload.startswith(b"\xfd7zXZ\x00"):
        return None
    try:
        elf = lzma.LZMADecompressor().decompress(payload)
    except lzma.LZMAError:
        return None
    return elf if _has_pvh_note(elf) else None


def _has_pvh_note(elf: bytes) -> bool:
    """True if the ELF has the Xen PHYS32_ENTRY note that QEMU's PVH boot looks for."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return False
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    pt_note, xen_elfnote_phys32_entry = 4, 18
    for index in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf, phoff + index * phentsize)
        at, end = p_offset, p_offset + p_filesz
        while p_type == pt_note and at + 12 <= end:
            namesz, descsz, note_type = struct.unpack_from("<III", elf, at)
            name = elf[at + 12 : at + 12 + namesz]
            if name == b"Xen\0" and note_type == xen_elfnote_phys32_entry:
                return True
            at += 12 + -(-namesz // 4) * 4 + -(-descsz // 4) * 4
    return False


def _modules_root(unpacked: Path) -> Path:
    for candidate in (unpacked / "lib" / "modules", unpacked / "usr" / "lib" / "modules"):
        if candidate.is_dir():
            return candidate
    raise ImageError("the kernel package has no lib/modules")


def _build_initramfs(scratch: Path, release: str, initrd: Path, run: Callable[..., str]) -> list[str]:
    """Write initrd.img (gzip'd newc cpio) with busybox, /init, the modules and the agent.

    Works in scratch, where the kernel is unpacked. Returns the module load order.
    """
    modules_dir = _modules_root(scratch / "kernel") / release
    files = {module_name(str(path)): path for path in modules_dir.rglob("*.ko*")}
    builtin_file = modules_dir / "modules.builtin"
    builtin = set(builtin_file.read_text().split()) if builtin_file.exists() else set()

    def depends_of(name: str) -> list[str] | None:
        return _module_depends(_module_bytes(files[name], run)) if name in files else None

    loaded = module_load_order(KERNEL_MODULES, depends_of, builtin)
    staging = scratch / "initramfs"

    for directory in ("bin", "dev", "proc", "sys", "newroot", "lib/modules", "usr/lib/boxd"):
        (staging / directory).mkdir(parents=True)
    shutil.copy2(BUSYBOX, staging / "bin" / "busybox")
    shutil.copy2(INIT_SCRIPT, staging / "init")
    (staging / "init").chmod(0o755)
    (staging / "usr/lib/boxd/agent.py").write_bytes(_agent_source())
    load_order = []
    for name in loaded:
        relative = re.sub(r"\.ko\.\w+$", ".ko", str(files[name].relative_to(modules_dir)))
        target = staging / "lib/modules" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_module_bytes(files[name], run))
        load_order.append(relative)
    (staging / "lib/modules/load-order").write_text("".join(f"{path}\n" for path in load_order))

    members = sorted(str(path.relative_to(staging)) for path in staging.rglob("*"))
    archive = staging.with_suffix(".cpio")
    run(
        ["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0", "--reproducible", "-O", archive],
        cwd=staging,
        input="\n".join(members) + "\n",
    )
    initrd.write_bytes(gzip.compress(archive.read_bytes(), mtime=0))
    return loaded


def _module_bytes(path: Path, run: Callable[..., str]) -> bytes:
    """A module's ELF, decompressed: busybox insmod cannot load compressed modules."""
    if path.name.endswith(".ko"):
        return path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(path.read_bytes())
    if path.name.endswith(".ko.gz"):
        return gzip.decompress(path.read_bytes())
    if path.name.endswith(".ko.zst"):
        decompressed = path.with_suffix("")  # beside it, in the unpacked kernel
        if not decompressed.exists():
            run(["zstd", "-q", "-d", "-o", decompressed, path])
        return decompressed.read_bytes()
    raise ImageError(f"unknown kernel module compression: {path.name}")


def _module_depends(module: bytes) -> list[str]:
    """The ``depends=`` entry of a module's .modinfo section (what depmod would put in modules.dep)."""
    if module[:4] != b"\x7fELF" or module[4] != 2:
        raise ImageError("a kernel module is not a 64-bit ELF file")
    (shoff,) = struct.unpack_from("<Q", module, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", module, 0x3A)

    def section(index: int) -> tuple[int, int, int]:  # name offset, file offset, size
        fields = struct.unpack_from("<IIQQQQ", module, shoff + index * shentsize)
        return fields[0], fields[4], fields[5]

    _, names, _ = section(shstrndx)
    for index in range(shnum):
        name_at, offset, size = section(index)
        name = module[names + name_at : module.index(b"\0", names + name_at)]
        if name == b".modinfo":
            for entry in module[offset : offset + size].split(b"\0"):
                if entry.startswith(b"depends="):
                    return [dep for dep in entry[len(b"depends=") :].decode().split(",") if dep]
            return []
    raise ImageError("a kernel module has no .modinfo section")


# --- root filesystem -------------------------------------------------------------------


def _ensure_rootfs(recipe: ImageRecipe, digest: str, home: Path | None, force: bool, steps: _BuildProgress) -> Path:
    """The cached root filesystem qcow2 for this recipe, built first if needed."""
    cache = _cache_dir(home) / "rootfs"
    qcow2 = cache / f"{digest}.qcow2"
    with _locked(cache / f".lock-{digest}", steps):
        if qcow2.is_file() and not force:
            with steps.step("root filesystem (cached)"):
                return qcow2
        _remove_stale_builds(cache, digest)
        build_dir = Path(tempfile.mkdtemp(prefix=f".build-{digest}-", dir=cache))
        try:
            root = build_dir / "root"
            with steps.step("debootstrap") as run:
                debootstrap_cache = _cache_dir(home) / "debootstrap"
                debootstrap_cache.mkdir(parents=True, exist_ok=True)
                run(
                    [
                        "debootstrap",
                        "--variant=minbase",
                        "--components=main",
                        f"--include={','.join(BASE_PACKAGES + recipe.packages)}",
                        f"--cache-dir={debootstrap_cache.resolve()}",
                        SUITE,
                        root,
                        _host_debian_mirror(),
                    ]
                )
            with steps.step("configure rootfs") as run:
                _configure_rootfs(root, recipe, run)
            with steps.step("pack rootfs") as run:
                raw = build_dir / "rootfs.raw"
                with raw.open("wb") as handle:
                    handle.truncate(_filesystem_size(root))
                run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "boxd-root", "-d", root, raw])
                _remove_tree(root)
                run(["qemu-img", "convert", "-O", "qcow2", raw, build_dir / "rootfs.qcow2"])
                (build_dir / "rootfs.qcow2").chmod(0o444)  # a backing file: never written again
                fsync_path(build_dir / "rootfs.qcow2")
                (build_dir / "rootfs.qcow2").replace(qcow2)
        finally:
            _remove_tree(build_dir)
    return qcow2


def _configure_rootfs(root: Path, recipe: ImageRecipe, run: Callable[..., str]) -> None:
    for name, uid in GUEST_USERS:
        run(
            ["chroot", root, "/usr/sbin/useradd", "--uid", str(uid), "--user-group", "--create-home"]
            + ["--home-dir", f"/home/{name}", "--shell", "/bin/bash", name]
        )
    sudoers = "".join(f"{name} ALL=(ALL:ALL) NOPASSWD: ALL\n" for name, _ in GUEST_USERS)
    _write_guest_file(root, "etc/sudoers.d/boxd", sudoers, 0o440)

    # Debian marks its python "externally managed"; in a sandbox plain pip install is the point.
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    _write_guest_file(root, "etc/pip.conf", f"[global]\ncert = {GUEST_CA_BUNDLE}\n")
    environment = f"SSL_CERT_FILE={GUEST_CA_BUNDLE}\nREQUESTS_CA_BUNDLE={GUEST_CA_BUNDLE}\n"
    _write_guest_file(root, "etc/environment", environment)
    host_ca = _host_ca_bundle() if recipe.trust_host_ca else None
    if host_ca is not None:
        _trust_certificates(root, host_ca.decode(errors="replace"), run)

    _write_guest_file(root, "etc/hostname", f"{GUEST_HOSTNAME}\n")
    hosts = f"127.0.0.1\tlocalhost\n127.0.1.1\t{GUEST_HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    _write_guest_file(root, "etc/hosts", hosts)
    _write_guest_file(root, "etc/resolv.conf", "nameserver 10.0.2.3\n")  # QEMU user-mode DNS
    _write_guest_file(root, "sbin/boxd-init", BOXD_INIT_SCRIPT.read_text(), 0o755)

    # Package lists go stale anyway (50 MB); like Debian's container images, run apt-get update first.
    for stale in [*root.glob("var/cache/apt/archives/*.deb"), *root.glob("var/lib/apt/lists/*_*")]:
        stale.unlink()


def _trust_certificates(root: Path, bundle: str, run: Callable[..., str]) -> None:
    """Add the bundle's certificates that the guest lacks to its trust store.

    They go to /usr/local/share/ca-certificates, so they survive the guest regenerating
    its bundle (update-ca-certificates runs whenever ca-certificates is upgraded).
    """
    known = {_normalized(pem) for pem in PEM_CERTIFICATE.findall((root / GUEST_CA_BUNDLE.lstrip("/")).read_text())}
    extra = [pem for pem in PEM_CERTIFICATE.findall(bundle) if _normalized(pem) not in known]
    if not extra:
        return
    for index, pem in enumerate(dict.fromkeys(extra)):
        _write_guest_file(root, f"usr/local/share/ca-certificates/boxd-host/host-{index:03d}.crt", pem + "\n")
    run(["chroot", root, "/usr/sbin/update-ca-certificates"])


def _normalized(pem: str) -> str:
    return "".join(pem.split())


def _write_guest_file(root: Path, relative: str, text: str, mode: int = 0o644) -> None:
    """Write a file in the guest tree without following a symlink out of it onto the host."""
    target = root / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.parent.resolve().is_relative_to(root.resolve()):
        raise ImageError(f"{relative} in the root filesystem points outside it")
    if target.is_symlink():
        target.unlink()
    target.write_text(text)
    target.chmod(mode)


def _filesystem_size(root: Path) -> int:
    """Bytes for the ext4 image: what the tree uses plus headroom, at least MIN_ROOTFS_BYTES."""
    used = 0
    for directory, subdirectories, files in os.walk(root):
        for name in [*subdirectories, *files]:
            used += os.lstat(os.path.join(directory, name)).st_blocks * 512
    size = max(MIN_ROOTFS_BYTES, int(used * ROOTFS_HEADROOM))
    granule = 64 << 20
    return -(-size // granule) * granule


def _manifest(
    recipe: ImageRecipe,
    digest: str,
    rootfs_digest: str,
    kernel_facts: dict,
    build_dir: Path,
    started: float,
) -> dict:
    host_ca = _host_ca_bundle() if recipe.trust_host_ca else None
    files = {}
    for path in sorted(build_dir.iterdir()):
        files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return {
        "format": MANIFEST_FORMAT,
        "digest": digest,
        "rootfs_digest": rootfs_digest,
        "recipe": {"packages": list(recipe.packages), "trust_host_ca": recipe.trust_host_ca},
        "host_ca_sha256": _sha256(host_ca) if host_ca is not None else None,
        "debian": {"suite": SUITE, "base_packages": list(BASE_PACKAGES)},
        "kernel": kernel_facts,
        "agent_sha256": _sha256(_agent_source()),
        "files": files,
        "qemu_version": _run("write image", ["qemu-img", "--version"]).splitlines()[0],
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(time.monotonic() - started, 1),
    }
