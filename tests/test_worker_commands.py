"""worker_commands: the one home of what a worker runs (issue 24 §2). The runtime, the
units, the secrets and the doctor are all fed from it: these tests pin that each of them
sees the command at the worker's OOM-ladder step, not the config's flags."""

from __future__ import annotations

from pathlib import PurePosixPath
from textwrap import dedent
from typing import Any

from sglang_farm.config import load_spec
from sglang_farm.doctor import CheckId, DoctorReport, run_doctor
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.runtime.unit_secrets import render_secrets
from sglang_farm.runtime.unit_syntax import exec_line
from sglang_farm.runtime.units import dropin_path, render
from sglang_farm.sglang.argv import build_command
from sglang_farm.sglang.commands import (
    at_ladder_steps,
    ladder_changes,
    resolve_flags,
    worker_command,
    worker_commands,
    worker_flags,
)
from sglang_farm.spec import FarmSpec

TOML = """
[farm]
python = "/opt/sglang/bin/python3"
module = "sglang.launch_server"
user = "root"
group = "root"

[workers]
gpus = [0, 1]
base_port = 30000

[sglang]
model_path = "/srv/models/m"
mem_fraction_static = 0.88
attention_backend = "auto"
api_key = "k-123"

[[oom.steps]]
name = "less-kv"
add = { mem_fraction_static = -0.05 }

[[oom.steps]]
name = "no-graphs"
set = { disable_cuda_graph = true }
"""


def _spec() -> FarmSpec:
    return load_spec(dedent(TOML), source="farm.toml", gpu_count=2)


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_each_worker_runs_its_own_ladder_step() -> None:
    spec = _spec()
    cmds = worker_commands(spec, {1: 2}, {0: (9, 0), 1: (12, 0)})
    assert _flag(cmds[0].argv, "--mem-fraction-static") == "0.88"
    assert _flag(cmds[1].argv, "--mem-fraction-static") == "0.83"
    assert "--disable-cuda-graph" not in cmds[0].argv
    assert "--disable-cuda-graph" in cmds[1].argv
    # "auto" is resolved per worker, for its own GPU.
    assert _flag(cmds[0].argv, "--attention-backend") == "fa3"
    assert _flag(cmds[1].argv, "--attention-backend") == "flashinfer"
    assert cmds[1] == worker_command(spec, 1, 2, {0: (9, 0), 1: (12, 0)})


def test_unknown_gpu_leaves_auto_to_sglang_and_no_step_means_the_config() -> None:
    spec = _spec()
    cmd = worker_commands(spec, {})[0]
    assert "--attention-backend" not in cmd.argv
    flags = dict(spec.worker(0).flags)
    assert cmd == build_command(spec.farm, spec.worker(0), resolve_flags(flags, None))


def test_a_step_past_a_shortened_ladder_is_its_last_step() -> None:
    spec = _spec()
    assert worker_flags(spec, 0, 7) == worker_flags(spec, 0, 2)
    assert [c.step_name for c in ladder_changes(spec, 0, 7)] == ["less-kv", "no-graphs"]
    assert ladder_changes(spec, 0, 0) == []


def test_units_and_secrets_run_the_commands_they_are_given() -> None:
    spec = _spec()
    cmds = worker_commands(spec, {1: 1}, {0: (12, 0), 1: (12, 0)})
    files = render(spec, commands=cmds)
    for wid, cmd in cmds.items():
        assert f"\nExecStart={exec_line(cmd.argv, wrap=True)}\n" in files[dropin_path(wid)]
    assert "--mem-fraction-static 0.83" in files[PurePosixPath("sglang@1.service.d/50-farm.conf")]
    assert render_secrets(spec, cmds)["sglang@1.api-key"] == b"k-123"


class _Cc120:
    def snapshot(self) -> FleetSnapshot:
        gpus = tuple(
            GpuSnapshot(
                index=i,
                name="card",
                compute_capability=(12, 0),
                memory_total_bytes=48 << 30,
                memory_used_bytes=0,
            )
            for i in range(2)
        )
        return FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=True, gpus=gpus)

    def close(self) -> None:
        return None


def test_the_doctor_judges_the_command_at_the_ladder_step() -> None:
    """SGLang's parser is handed what the worker will run (step 2 adds a flag)."""
    spec = _spec()
    seen: list[list[list[str]]] = []

    def probe(python: str, env: Any, mode: str, payload: Any) -> dict[str, Any]:
        if mode == "flags":
            seen.append(payload["argvs"])
            return {"parser": True, "results": [{"tokens": []} for _ in payload["argvs"]]}
        return {}

    cmds = worker_commands(spec, {1: 2}, {0: (12, 0), 1: (12, 0)})
    run_doctor(spec, _Cc120(), run_probe=probe, port_check=lambda h, p: None, commands=cmds)
    argvs = [a for group in seen for a in group]
    assert [list(c.argv[3:]) for c in cmds.values()] == argvs
    assert "--disable-cuda-graph" in argvs[1] and "--disable-cuda-graph" not in argvs[0]
    # Without commands: each worker at step 0, "auto" picked for the GPUs NVML reports.
    seen.clear()
    run_doctor(spec, _Cc120(), run_probe=probe, port_check=lambda h, p: None)
    default = worker_commands(spec, {}, {0: (12, 0), 1: (12, 0)})
    assert [a for group in seen for a in group] == [list(c.argv[3:]) for c in default.values()]


def _memory_messages(report: DoctorReport) -> dict[int, str]:
    return {w: c.message for c in report.checks if c.id is CheckId.MEMORY for w in c.workers}


def test_the_agents_doctor_judges_each_worker_at_its_ladder_step() -> None:
    """DoctorReportCache asks the agent for its OOM steps: the rules judge the flags the
    worker will run (worker 1 at step 1: 0.83), not the config's (0.88)."""
    import asyncio

    from sglang_farm.doctor.cache import DoctorReportCache

    spec = _spec()
    cache = DoctorReportCache(_Cc120(), oom_steps=lambda: {1: 1})
    asyncio.run(cache.refresh(spec))
    assert cache.report is not None
    said = _memory_messages(cache.report)
    assert said[0].startswith("mem_fraction_static 0.88") and said[1].startswith(
        "mem_fraction_static 0.83"
    )
    assert cache.compute_caps == {0: (12, 0), 1: (12, 0)}


def test_at_ladder_steps_is_the_spec_as_the_workers_run() -> None:
    spec = _spec()
    stepped = at_ladder_steps(spec, {1: 2})
    assert stepped.worker(0).flags == spec.worker(0).flags
    assert stepped.worker(1).flags["mem_fraction_static"] == 0.83
    assert stepped.worker(1).flags["disable_cuda_graph"] is True
    assert stepped.worker(1).flags["attention_backend"] == "auto"  # the rules judge "auto"
    assert worker_commands(stepped, {}) == worker_commands(spec, {1: 2})
