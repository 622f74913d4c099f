"""The doctor's NUMA check (issue 34 §5): on a host of more than one NUMA node, would SGLang
bind each worker to its GPU's node? Tested on a faked sysfs of a two-socket, 8-GPU host
(GPUs 0-3 on node 0, 4-7 on node 1), and on this machine's own (one node)."""

from __future__ import annotations

from pathlib import Path

import pytest

from numa_fakes import BUS, report
from numa_fakes import facts as _facts
from numa_fakes import fleet as _fleet
from numa_fakes import spec as _spec
from sglang_farm.doctor.checks import Check, CheckId, Status
from sglang_farm.doctor.gather import numa_facts
from sglang_farm.doctor.numa_rules import numa_checks
from sglang_farm.host.numa_facts import (
    NumaFacts,
    SyscallFilter,
    parse_cpulist,
    parse_numa_node,
    parse_systemctl_filter,
    sysfs_pci_name,
)
from sglang_farm.host.numa_probe import read_numa_facts
from sglang_farm.spec import FarmSpec

# What systemd prints for the shipped sglang@.service (a deny-list without @resources), cut
# short: the names around the binding's calls.
SHIPPED_FILTER = "~acct adjtimex bpf clock_settime init_module mount reboot swapon umount2"
# An operator's drop-in `SystemCallFilter=@basic-io @file-system @network-io ...`: an
# allow-list without @resources.
NARROW_FILTER = "accept4 bind close connect read write openat mmap munmap futex"


def _rows(spec: FarmSpec, facts: NumaFacts, simulated: bool = False) -> list[Check]:
    return [c for c in report(spec, facts, simulated).checks if c.id is CheckId.NUMA]


def test_kernel_lists_and_bus_ids_parse_as_sysfs_writes_them() -> None:
    assert parse_cpulist("0\n") == (0,)
    assert parse_cpulist("0-1") == (0, 1)
    assert parse_cpulist("0,2-3") == (0, 2, 3)
    assert parse_cpulist("") == ()
    with pytest.raises(ValueError):
        parse_cpulist("3-1")
    assert parse_numa_node("-1\n") is None
    assert parse_numa_node("1\n") == 1
    assert sysfs_pci_name("00000000:9A:00.0") == "0000:9a:00.0"
    with pytest.raises(ValueError):
        sysfs_pci_name("9A:00")


def test_a_filter_is_read_as_allow_or_deny_list() -> None:
    calls = ("mbind", "sched_setaffinity", "set_mempolicy")
    assert parse_systemctl_filter("").refused(calls) == ()
    assert parse_systemctl_filter(SHIPPED_FILTER).refused(calls) == ()
    assert parse_systemctl_filter("~set_mempolicy:EPERM mbind").refused(calls) == (
        "mbind",
        "set_mempolicy",
    )
    assert parse_systemctl_filter(NARROW_FILTER).refused(calls) == calls
    assert SyscallFilter(deny=False, names=frozenset(calls)).refused(calls) == ()


def test_a_two_socket_host_shows_each_worker_on_its_gpus_node(tmp_path: Path) -> None:
    rows = _rows(_spec(), _facts(tmp_path, filt=SHIPPED_FILTER))
    assert [(c.status, c.workers) for c in rows] == [
        (Status.PASS, (0, 1, 2, 3)),
        (Status.PASS, (4, 5, 6, 7)),
    ]
    assert "NUMA node 0 (of 2)" in rows[0].message
    assert "NUMA node 1 (of 2)" in rows[1].message


def test_missing_libnuma_or_numactl_is_named_for_the_whole_farm(tmp_path: Path) -> None:
    rows = _rows(_spec(), _facts(tmp_path, libnuma=False, numactl=False))
    farm = [c for c in rows if not c.workers]
    assert len(farm) == 1 and farm[0].status is Status.WARN
    assert "libnuma and numactl not installed" in farm[0].message
    assert "apt install libnuma1 numactl" in farm[0].fix


def test_a_unit_filter_that_refuses_the_binding_is_a_warning(tmp_path: Path) -> None:
    rows = _rows(_spec(), _facts(tmp_path, filt=NARROW_FILTER))
    assert [(c.status, c.workers) for c in rows] == [(Status.WARN, tuple(range(8)))]
    assert "refuses mbind, sched_setaffinity, set_mempolicy" in rows[0].message
    assert "@resources" in rows[0].fix


def test_an_unknown_gpu_node_on_a_multi_socket_host_is_named(tmp_path: Path) -> None:
    rows = _rows(_spec(), _facts(tmp_path, nodes={5: "-1"}))
    warn = [c for c in rows if c.status is Status.WARN]
    assert [c.workers for c in warn] == [(5,)]
    assert "GPU 5" in warn[0].message and "numa_node" in warn[0].message
    assert "--numa-node" in warn[0].fix


def test_a_configured_numa_node_away_from_the_gpu_is_a_warning(tmp_path: Path) -> None:
    rows = _rows(_spec(numa_node="numa_node = [0]"), _facts(tmp_path))
    warn = [c for c in rows if c.status is Status.WARN]
    assert [c.workers for c in warn] == [(4, 5, 6, 7)]
    assert "binds the worker away from its GPUs' node 1" in warn[0].message


def test_binding_turned_off_in_the_environment_is_said(tmp_path: Path) -> None:
    rows = _rows(_spec(env='SGLANG_AUTO_NUMA_BIND = "0"'), _facts(tmp_path, filt=NARROW_FILTER))
    assert [c.status for c in rows] == [Status.SKIP]
    assert "turned off (SGLANG_AUTO_NUMA_BIND=0" in rows[0].message


def test_one_node_means_nothing_to_bind_as_on_the_h200_machine(tmp_path: Path) -> None:
    # The H200 machine: one node, the GPU's numa_node -1, NVML's node "not supported".
    facts = _facts(tmp_path, online="0", nodes={g: "-1" for g in range(8)}, filt=NARROW_FILTER)
    rows = _rows(_spec(), facts)
    assert [(c.status, c.workers) for c in rows] == [(Status.SKIP, ())]
    assert rows[0].message == "one NUMA node on this host: SGLang has nothing to bind"


def test_simulated_gpus_have_no_node_to_bind(tmp_path: Path) -> None:
    rows = _rows(_spec(), _facts(tmp_path), simulated=True)
    assert [c.status for c in rows] == [Status.SKIP]
    assert "simulated" in rows[0].message


def test_no_sysfs_is_said_not_guessed(tmp_path: Path) -> None:
    facts = read_numa_facts(BUS, sysfs=tmp_path / "absent", libnuma=lambda: True)
    rows = numa_checks(_spec(), facts, simulated=False)
    assert [(w, c.status) for w, c in rows] == [(None, Status.SKIP)]
    assert "NUMA nodes are not known" in rows[0][1].message


def test_this_machines_own_sysfs_is_read(tmp_path: Path) -> None:
    """The real reader over this host's /sys: whatever the node count, the facts are read
    (no error) and the verdict is one of the check's own."""
    facts = numa_facts(_spec(), _fleet())
    assert facts.nodes_error is None and facts.nodes
    rows = numa_checks(_spec(), facts, simulated=False)
    assert rows and all(c.id is CheckId.NUMA for _, c in rows)
