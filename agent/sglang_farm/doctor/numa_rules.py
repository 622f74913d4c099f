"""Pure: the doctor's NUMA check: would SGLang bind each worker to its GPU's NUMA node?

Only a host with more than one node has anything to bind. There, SGLang binds each
scheduler itself (`SGLANG_AUTO_NUMA_BIND`, on by default; `--numa-node` overrides the node)
through libnuma and `numactl`, and *warns and runs unbound* when it cannot: without libnuma
or numactl, or when the unit's system-call filter refuses the calls the binding makes. None
of that stops a worker, so every finding here is a warning, never a failure: an unbound
worker serves, more slowly (host memory across the socket link). docs/gpu-health.md, "NUMA".
"""

from __future__ import annotations

from collections.abc import Mapping

from sglang_farm.doctor.checks import Check, CheckId, Status
from sglang_farm.host.numa_facts import BINDING_SYSCALLS, NumaFacts
from sglang_farm.spec import FarmSpec, WorkerSpec

AUTO_BIND_ENV = "SGLANG_AUTO_NUMA_BIND"
_OFF = frozenset({"0", "false", "no", "off"})


def binding_off(env: Mapping[str, str]) -> bool:
    """True when the worker's environment turns SGLang's own binding off."""
    return env.get(AUTO_BIND_ENV, "").strip().lower() in _OFF


def _configured_nodes(w: WorkerSpec) -> tuple[int, ...] | None:
    """The worker's `--numa-node` (one node per TP rank), None when not set."""
    value = w.flags.get("numa_node")
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[int] = []
    for item in items:
        try:
            out.append(int(str(item)))
        except ValueError:
            return None  # SGLang's parser and the flag rules say what is wrong with it
    return tuple(out)


def _worker_checks(w: WorkerSpec, numa: NumaFacts, count: int) -> list[Check]:
    if binding_off(w.env):
        return [
            Check(
                CheckId.NUMA,
                Status.SKIP,
                f"SGLang's NUMA binding is turned off ({AUTO_BIND_ENV}="
                f"{w.env[AUTO_BIND_ENV]} in the worker's environment): it runs unbound",
                f"remove {AUTO_BIND_ENV} from its [workers] env to let SGLang bind it",
            )
        ]
    found: list[Check] = []
    nodes = {g: numa.gpu_nodes.get(g) for g in w.gpus}
    unknown = [g for g, n in nodes.items() if n is None]
    configured = _configured_nodes(w)
    if unknown and configured is None:
        where = ", ".join(numa.gpu_sources.get(g, f"GPU {g}: no PCI id from NVML") for g in unknown)
        found.append(
            Check(
                CheckId.NUMA,
                Status.WARN,
                f"the NUMA node of GPU {', '.join(map(str, unknown))} is not known ({where} "
                "does not name one): SGLang cannot tell where to bind the worker",
                "set the worker's numa_node flag (--numa-node) to its GPU's socket, or fix the "
                "firmware's NUMA tables (numa_node = -1 on a multi-socket host)",
            )
        )
    if configured is not None:
        wanted = tuple(n for g in w.gpus if (n := nodes.get(g)) is not None)
        if len(wanted) == len(w.gpus) and tuple(configured) != wanted:
            found.append(
                Check(
                    CheckId.NUMA,
                    Status.WARN,
                    f"--numa-node {' '.join(map(str, configured))} binds the worker away from "
                    f"its GPUs' node{'s' if len(set(wanted)) > 1 else ''} "
                    f"{' '.join(map(str, wanted))}",
                    "set numa_node to the GPUs' nodes, or leave it out (SGLang finds them)",
                )
            )
    unit = numa.unit_filters.get(w.id)
    if unit is not None:
        if unit.filter is None:
            found.append(
                Check(
                    CheckId.NUMA,
                    Status.WARN,
                    f"could not read the worker unit's system-call filter ({unit.error})",
                    "run `systemctl show -p SystemCallFilter sglang@N` to see it",
                )
            )
        elif refused := unit.filter.refused(BINDING_SYSCALLS):
            found.append(
                Check(
                    CheckId.NUMA,
                    Status.WARN,
                    f"the worker unit's SystemCallFilter= refuses {', '.join(refused)}, which "
                    "SGLang's NUMA binding calls: it runs unbound",
                    "allow @resources in SystemCallFilter= (the shipped sglang@.service does): "
                    "`systemctl cat sglang@N` shows the drop-in that narrows it",
                )
            )
    if not found:
        bound = sorted({n for n in nodes.values() if n is not None} | set(configured or ()))
        found.append(
            Check(
                CheckId.NUMA,
                Status.PASS,
                f"SGLang can bind the worker to NUMA node {', '.join(map(str, bound))} "
                f"(of {count}), its GPU's",
            )
        )
    return found


def numa_checks(
    spec: FarmSpec, numa: NumaFacts | None, *, simulated: bool
) -> list[tuple[int | None, Check]]:
    """The NUMA verdicts, per worker (id) or for the farm (None). Empty when not looked at."""
    if numa is None:
        return []
    if numa.nodes_error is not None and not numa.nodes:
        return [
            (
                None,
                Check(
                    CheckId.NUMA,
                    Status.SKIP,
                    f"the host's NUMA nodes are not known ({numa.nodes_error})",
                ),
            )
        ]
    if len(numa.nodes) <= 1:
        return [
            (
                None,
                Check(
                    CheckId.NUMA,
                    Status.SKIP,
                    "one NUMA node on this host: SGLang has nothing to bind",
                ),
            )
        ]
    if simulated:
        return [
            (
                None,
                Check(
                    CheckId.NUMA,
                    Status.SKIP,
                    f"{len(numa.nodes)} NUMA nodes, but the GPUs are simulated: no GPU's node "
                    "to bind to",
                ),
            )
        ]
    found: list[tuple[int | None, Check]] = []
    tools = [name for name, ok in (("libnuma", numa.libnuma), ("numactl", numa.numactl)) if not ok]
    if tools:
        found.append(
            (
                None,
                Check(
                    CheckId.NUMA,
                    Status.WARN,
                    f"{' and '.join(tools)} not installed on a host of {len(numa.nodes)} NUMA "
                    "nodes: SGLang runs every worker unbound",
                    "install them (Debian: apt install libnuma1 numactl)",
                ),
            )
        )
    for w in spec.workers:
        found += [(w.id, c) for c in _worker_checks(w, numa, len(numa.nodes))]
    return found
