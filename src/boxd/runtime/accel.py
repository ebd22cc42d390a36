"""Which accelerator QEMU should use on this host, and why."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Accelerator:
    name: str  # "kvm" or "tcg"
    cpu: str
    reason: str

    def qemu_args(self) -> list[str]:
        if self.name == "kvm":
            return ["-accel", "kvm", "-cpu", self.cpu]
        # The default code cache size on purpose: a small one (tb-size=64) flushes often,
        # and forks taken while it flushed came out with corrupt memory.
        return ["-accel", "tcg", "-cpu", self.cpu]


def detect_accelerator(
    dev_kvm: Path = Path("/dev/kvm"), sys_module: Path = Path("/sys/module"), forced: str | None = None
) -> Accelerator:
    """KVM where the host really has it, TCG otherwise.

    A ``/dev/kvm`` backed by ``kvm_pvm`` only runs guests built for PVM (a stock Debian
    kernel hangs at boot), so such a host counts as having no usable KVM.
    ``BOXD_ACCEL=tcg|kvm`` overrides the choice.
    """
    choice = forced or os.environ.get("BOXD_ACCEL")
    # On KVM, QEMU 7.2 aborts with plain "-cpu host" ("failed to set MSR 0x10a").
    kvm = Accelerator("kvm", "host,arch-capabilities=off", "hardware KVM at /dev/kvm")
    # "max" because the default qemu64 model lacks x86-64-v2 and numpy 2 needs it.
    if choice == "kvm":
        return Accelerator("kvm", kvm.cpu, "forced by BOXD_ACCEL=kvm")
    if choice == "tcg":
        return Accelerator("tcg", "max", "forced by BOXD_ACCEL=tcg")
    if (sys_module / "kvm_pvm").exists():
        return Accelerator("tcg", "max", "/dev/kvm is PVM (kvm_pvm), which cannot run a stock guest kernel")
    if not dev_kvm.exists():
        return Accelerator("tcg", "max", "no /dev/kvm")
    if not os.access(dev_kvm, os.R_OK | os.W_OK):
        return Accelerator("tcg", "max", f"{dev_kvm} is not readable and writable by this user")
    return kvm
