"""Pure parts of the runtime: accelerator choice, QEMU command lines, error mapping."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from boxd.errors import Conflict, HostError, InvalidInput, NotFound, VMError
from boxd.runtime.accel import detect_accelerator
from boxd.runtime.agent_client import fault_to_error
from boxd.runtime.interface import VMSpec
from boxd.runtime.local import LocalRuntime
from boxd.runtime.qemu import Launch


def test_pvm_kvm_counts_as_no_kvm(tmp_path):
    (tmp_path / "kvm").touch()
    (tmp_path / "modules" / "kvm_pvm").mkdir(parents=True)
    chosen = detect_accelerator(dev_kvm=tmp_path / "kvm", sys_module=tmp_path / "modules")
    assert chosen.name == "tcg" and "PVM" in chosen.reason


def test_real_kvm_is_used_with_a_cpu_model_qemu_7_2_accepts(tmp_path, monkeypatch):
    monkeypatch.delenv("BOXD_ACCEL", raising=False)
    (tmp_path / "kvm").touch()
    (tmp_path / "modules").mkdir()
    chosen = detect_accelerator(dev_kvm=tmp_path / "kvm", sys_module=tmp_path / "modules")
    assert chosen.name == "kvm"
    assert chosen.qemu_args() == ["-accel", "kvm", "-cpu", "host,arch-capabilities=off"]


def test_no_dev_kvm_means_tcg_with_a_cpu_numpy_can_run_on(tmp_path, monkeypatch):
    monkeypatch.delenv("BOXD_ACCEL", raising=False)
    chosen = detect_accelerator(dev_kvm=tmp_path / "absent", sys_module=tmp_path)
    assert chosen.name == "tcg" and chosen.qemu_args()[-1] == "max"


def launch(**overrides) -> Launch:
    values = dict(
        name="m1",
        run_dir=Path("/run/x"),
        ram_file=Path("/run/x/ram"),
        ram_shared=True,
        disk=Path("/data/top.qcow2"),
        kernel=Path("/img/vmlinuz"),
        initrd=Path("/img/initrd.img"),
        console_log=Path("/data/console.log"),
        accelerator=detect_accelerator(forced="tcg"),
        vcpus=2,
        memory_mib=768,
        isolated=False,
    )
    values.update(overrides)
    return Launch(**values)


def option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, item in enumerate(argv) if item == flag]


def test_a_booting_machine_owns_its_ram_file_and_boots():
    argv = launch().argv()
    assert "-incoming" not in argv and "-S" not in argv
    backend = next(o for o in option(argv, "-object") if o.startswith("memory-backend-file"))
    assert "size=768M" in backend and "mem-path=/run/x/ram" in backend and "share=on" in backend
    assert option(argv, "-smp") == ["2"]
    # its own passt process, never slirp, whose gateway is the host's loopback
    assert option(argv, "-netdev") == ["stream,id=net0,server=off,addr.type=unix,addr.path=/run/x/net.sock"]


def test_a_fork_maps_its_capture_privately_and_waits_for_state():
    argv = launch(ram_shared=False, incoming=True, ram_file=Path("/caps/c1/ram")).argv()
    backend = next(o for o in option(argv, "-object") if o.startswith("memory-backend-file"))
    assert "share=off" in backend and "mem-path=/caps/c1/ram" in backend
    assert option(argv, "-incoming") == ["defer"] and "-S" in argv


def test_an_isolated_machine_gets_a_restricted_network():
    assert option(launch(isolated=True).argv(), "-netdev") == ["user,id=net0,restrict=on"]


def test_every_start_gets_a_new_vm_generation_id():
    def vmgenid(argv):
        return next(o for o in option(argv, "-device") if o.startswith("vmgenid"))

    assert vmgenid(launch().argv()) != vmgenid(launch().argv())


@pytest.mark.parametrize(
    "code, expected",
    [("not_found", NotFound), ("invalid_input", InvalidInput), ("conflict", Conflict), ("weird", VMError)],
)
def test_agent_faults_map_by_code(code, expected):
    error = fault_to_error({"code": code, "message": "path: something about it"})
    assert type(error) is expected


def test_agent_faults_name_the_field():
    fault = {"code": "invalid_input", "message": "cwd: no such directory '/x'", "field": "cwd"}
    assert fault_to_error(fault).field == "cwd"
    # the field comes from the agent's answer, never from its wording
    assert fault_to_error({"code": "invalid_input", "message": "cwd: no such directory '/x'"}).field is None


def test_a_disk_larger_than_the_host_can_hold_is_refused_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    runtime = LocalRuntime(tmp_path / "home")
    free_gib = shutil.disk_usage(runtime.layers_dir).free // 1024**3
    runtime._check_room(VMSpec(image="x", memory_mib=128, disk_gib=max(1, free_gib - 1)))
    with pytest.raises(HostError) as refused:
        runtime._check_room(VMSpec(image="x", memory_mib=128, disk_gib=free_gib + 1))
    assert refused.value.field == "disk_gib" and "GiB free" in refused.value.message


def test_a_port_from_a_range_skips_the_ones_taken_and_says_when_none_is_left():
    import socket

    from boxd.errors import HostError
    from boxd.runtime.qemu import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        assert port < free_port(range(port, port + 20)) < port + 20  # never the one taken
        with pytest.raises(HostError) as none_left:
            free_port(range(port, port + 1))
    assert none_left.value.field == "ports"
