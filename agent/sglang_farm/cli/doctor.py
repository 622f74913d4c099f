"""I/O: `sglang-farm doctor [--config] [--gpus N] [--json]`: the doctor as a command.

Reads the config with the GPU count of the GPU source it names (or `--gpus N`), runs
the doctor (`sglang_farm.doctor`) and prints its report; exit 0 when nothing fails, 1
otherwise. Without NVML the other checks still run: NVML's absence is one row of the
report (never a log line), and `--gpus N` says what `gpus = "all"` stands for.
"""

from __future__ import annotations

import json
import sys
import tomllib

import click

from sglang_farm.cli.options import config_error_text, config_option, gpus_option
from sglang_farm.doctor import format_report, run_doctor
from sglang_farm.errors import ConfigError
from sglang_farm.gpus.nvml import NvmlPoller
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuPoller


class _NoGpus:
    """A poller for `gpu_source = "none"`: NVML treated as absent."""

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(
            taken_at=0.0, duration_s=0.0, nvml_up=False, error='[metrics] gpu_source = "none"'
        )

    def close(self) -> None:
        return None


DOCTOR_FAKE_GPUS = 8  # FakeGpuPoller's own default


def _poller_for(config_path: str, gpus: int | None) -> GpuPoller:
    """The GPU source the config names ([metrics] gpu_source), read before full validation
    because `gpus = "all"` needs the GPU count to validate."""
    source = "nvml"
    try:
        with open(config_path, "rb") as f:
            metrics = tomllib.load(f).get("metrics", {})
        if isinstance(metrics, dict) and isinstance(metrics.get("gpu_source"), str):
            source = metrics["gpu_source"]
    except (OSError, tomllib.TOMLDecodeError):
        pass  # load_spec_file reports it properly
    if source == "nvml":
        # Quiet: the report's NVML row says what NVML did; the agent's "will retry" log
        # line means nothing to a one-shot check and would land in the report.
        return NvmlPoller(quiet=True)
    from sglang_farm.gpus.nvml import choose_gpu_poller

    # The doctor's simulated GPUs: as many as --gpus says, else the simulator's default.
    return choose_gpu_poller(source, gpus or DOCTOR_FAKE_GPUS) or _NoGpus()


class _CountingPoller:
    """Takes one snapshot up front (for the GPU count) and hands the same one to the doctor."""

    def __init__(self, snap: FleetSnapshot) -> None:
        self._snap = snap

    def snapshot(self) -> FleetSnapshot:
        return self._snap

    def close(self) -> None:
        return None


@click.command()
@config_option
@gpus_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(config_path: str, gpus: int | None, as_json: bool) -> None:
    """Check the GPUs, the SGLang environment and every worker's command line before a start.

    Runs the workers' interpreter with a small probe (torch and its CUDA build,
    sglang-kernel binaries, deep_gemm and CUDA_HOME, flashinfer), checks the
    attention backend against each GPU's architecture, every rendered command line
    against SGLang's own parser, ports, the model, memory, and workers reachable from
    other hosts without an API key. Exit 0 when nothing fails, 1 when a check fails
    (warnings do not count).
    """
    from sglang_farm.config import load_spec_file

    poller = _poller_for(config_path, gpus)
    try:
        snap = poller.snapshot()
    finally:
        poller.close()
    count = gpus if gpus is not None else len(snap.gpus) if snap.nvml_up else None
    try:
        spec = load_spec_file(config_path, gpu_count=count)
    except ConfigError as exc:
        click.echo(config_error_text(exc, gpus_given=gpus is not None), err=True)
        sys.exit(1)
    report = run_doctor(spec, _CountingPoller(snap))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(format_report(report), nl=False)
    sys.exit(0 if report.ok else 1)
