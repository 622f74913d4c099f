"""Each worker's NUMA node in `farmctl status` and `why` (issue 34 §5): the GPU's node
from its PCI device, as the doctor reads it, on a faked sysfs of a two-socket 8-GPU host
(GPUs 0-3 on node 0, 4-7 on node 1); absent on a host of one node, for a GPU whose node
is not known, and with simulated GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fake_ops import FakeOps
from numa_fakes import facts, report, spec
from ops_socket import serving
from sglang_farm.cli.readings import numa_line


def _report_nodes(tmp_path: Path, *, simulated: bool = False, **sysfs: Any) -> dict[int, int]:
    return report(spec(), facts(tmp_path, **sysfs), simulated).gpu_numa_nodes()


def test_the_doctors_report_keeps_each_gpus_node_on_a_two_socket_host(tmp_path: Path) -> None:
    assert _report_nodes(tmp_path / "a") == {g: 0 if g < 4 else 1 for g in range(8)}
    # A GPU whose PCI device does not say (-1) is left out, not guessed.
    assert 5 not in _report_nodes(tmp_path / "b", nodes={5: "-1"})
    # One node: nothing to tell apart. Simulated GPUs: their PCI ids are made up.
    assert _report_nodes(tmp_path / "c", online="0", nodes={g: "0" for g in range(8)}) == {}
    assert _report_nodes(tmp_path / "d", simulated=True) == {}


def test_status_and_why_show_each_workers_node_and_nothing_on_one_node() -> None:
    ops = FakeOps(n=4)
    ops.gpu_nodes = {0: 0, 1: 0, 2: 1}  # GPU 3's node is not known
    with serving(ops) as agent:
        st = json.loads(agent.run("--json", "status").output)
        text = agent.run("status").output
        why2 = agent.run("why", "2").output
        why2_json = json.loads(agent.run("--json", "why", "2").output)
        why3_json = json.loads(agent.run("--json", "why", "3").output)
        ops.gpu_nodes = {}  # a host of one node
        plain = agent.run("status").output
        plain_json = json.loads(agent.run("--json", "status").output)
    assert [w.get("numa_nodes") for w in st["workers"]] == [[0], [0], [1], None]
    lines = text.splitlines()
    assert lines[2].split()[:4] == ["WORKER", "GPU", "NODE", "PORT"]
    assert lines[5].split()[:3] == ["2", "2", "1"]
    assert lines[6].split()[:3] == ["3", "3", "-"]
    assert numa_line([2], [1]) in why2
    assert "NUMA node 1 (GPU 2's PCI device)" in why2
    assert why2_json["gpus"] == [2] and why2_json["numa_nodes"] == [1]
    assert "numa_nodes" not in why3_json
    assert "NODE" not in plain and "NUMA" not in plain
    assert all("numa_nodes" not in w for w in plain_json["workers"])


def test_a_worker_on_gpus_of_two_nodes_names_each() -> None:
    assert numa_line([3, 4], [0, 1]) == (
        "NUMA GPU 3: node 0, GPU 4: node 1; SGLang binds the worker's schedulers there by "
        "itself: sglang-farm doctor says whether it can"
    )
