"""Pure: what the doctor knows of the host's NUMA layout and of what would stop SGLang
binding a worker to its GPU's node, and the parsing of the texts it is read from.

SGLang binds each scheduler to its GPU's NUMA node by itself (`SGLANG_AUTO_NUMA_BIND`, on
by default), through libnuma and `numactl`; when either is missing, or the system-call
filter refuses the calls the binding makes, it warns and runs unbound: on a two-socket
host, half the workers then allocate their host memory across the socket link. The I/O
that fills these facts is `host/numa_probe.py`; the verdict is `doctor/numa_rules.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# The calls libnuma makes to bind a process to a node: its CPUs (sched_setaffinity) and its
# memory (set_mempolicy; mbind for ranges). All three are in systemd's @resources group.
BINDING_SYSCALLS = ("mbind", "sched_setaffinity", "set_mempolicy")


@dataclass(frozen=True, slots=True)
class SyscallFilter:
    """A unit's effective `SystemCallFilter=`, as systemd reports it (`systemctl show`):
    an allow-list of call names, or a deny-list (`deny=True`). `names` empty and
    `deny=True` is no filter at all."""

    deny: bool
    names: frozenset[str]

    def refused(self, calls: Iterable[str]) -> tuple[str, ...]:
        """The calls of `calls` this filter refuses, sorted."""
        wanted = set(calls)
        out = wanted & self.names if self.deny else wanted - self.names
        return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class UnitFilter:
    """A worker unit's filter, or why it could not be read."""

    filter: SyscallFilter | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class NumaFacts:
    """The host's NUMA nodes, each GPU's node, the binding's tools, and the worker units'
    system-call filters (absent when the workers are not systemd units)."""

    nodes: tuple[int, ...] = ()  # online nodes; () when /sys does not say
    nodes_error: str | None = None
    # GPU index -> its PCI device's node; None: not known (no PCI id, no sysfs entry, -1).
    gpu_nodes: Mapping[int, int | None] = field(default_factory=lambda: MappingProxyType({}))
    # GPU index -> where its node was read from (the sysfs file), for the report.
    gpu_sources: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    libnuma: bool = False
    numactl: bool = False
    # worker id -> its unit's filter; empty when not under systemd (no filter applies).
    unit_filters: Mapping[int, UnitFilter] = field(default_factory=lambda: MappingProxyType({}))

    def gpu_node_map(self) -> dict[int, int]:
        """GPU index -> its node, for the GPUs whose node is known; empty on a host of one
        node (or of unknown nodes), where there is no node to tell apart."""
        if len(self.nodes) <= 1:
            return {}
        return {g: n for g, n in self.gpu_nodes.items() if n is not None}


def parse_cpulist(text: str) -> tuple[int, ...]:
    """The kernel's list format (`0`, `0-1`, `0,2-3`) -> the numbers, sorted.
    Raises ValueError for anything else."""
    out: set[int] = set()
    body = text.strip()
    if not body:
        return ()
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        first = int(lo)
        last = int(hi) if sep else first
        if first < 0 or last < first:
            raise ValueError(f"not a kernel list range: {part!r}")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


def parse_numa_node(text: str) -> int | None:
    """A PCI device's `numa_node` file: its node, or None for -1 (the firmware does not
    say, as on one-socket hosts). Raises ValueError for a non-number."""
    node = int(text.strip())
    return None if node < 0 else node


def sysfs_pci_name(nvml_bus_id: str) -> str:
    """NVML's PCI bus id (`00000000:18:00.0`, 8-digit domain, upper case) -> the name of its
    folder under /sys/bus/pci/devices (`0000:18:00.0`). Raises ValueError when malformed."""
    parts = nvml_bus_id.strip().lower().split(":")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {nvml_bus_id!r}")
    domain, bus, devfn = parts
    dev, _, fn = devfn.partition(".")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"


def parse_systemctl_filter(value: str) -> SyscallFilter:
    """`systemctl show -p SystemCallFilter --value UNIT`: empty (no filter), a list of call
    names (an allow-list), or `~` and a list (a deny-list). A `:errno` suffix, which some
    systemd versions print per call, is dropped."""
    text = value.strip()
    deny = text.startswith("~")
    if deny:
        text = text[1:]
    names = frozenset(n.partition(":")[0] for n in text.split() if n)
    if not names:
        return SyscallFilter(deny=True, names=frozenset())
    return SyscallFilter(deny=deny, names=names)
