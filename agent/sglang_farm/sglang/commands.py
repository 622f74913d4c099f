"""Pure: what each worker runs: its flags at its OOM-ladder step with the farm's
`"auto"` picks made, and the command line built from them.

The one home of a worker's command: the runtime (`Runtime.prepare`, `start`), the
units and the secrets (`units.render`, `unit_secrets.render_secrets`), `reload` (a worker
restarts only when its command changes) and the doctor all take what `worker_commands`
returns, so none of them can disagree on what a worker runs.

`resolve_attention_backend(cc)` is the farm's `attention_backend = "auto"`: one
backend per architecture (SGLang's own default order; docs/reference/seed-host.md §5 for
SM 12.0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from sglang_farm.sglang.argv import Command, build_command
from sglang_farm.sglang.flags import ATTENTION_BACKEND_KEYS
from sglang_farm.sglang.ladder import FlagChange, apply_ladder
from sglang_farm.spec import FarmSpec, FlagValue

AUTO = "auto"
# Compute capability per GPU index, as NVML reports it (unknown GPUs are absent).
ComputeCaps = Mapping[int, tuple[int, int]]


def resolve_attention_backend(cc: tuple[int, int]) -> str:
    """The farm's pick for `attention_backend = "auto"` on compute capability `cc`.

    SGLang's own default order for MHA models (docs/reference/sglang.md §14.2): Hopper -> fa3,
    datacenter Blackwell (SM 10.x) -> trtllm_mha, everything else -> flashinfer. On
    SM 12.x flashinfer is the only backend the seed host could run (no tcgen05 for
    FA3/FA4; Triton's tiles want more than the ~99 KB of shared memory per block).
    Below SM 8.0 flashinfer's prebuilt kernels do not apply: triton.
    """
    major = cc[0]
    if major == 9:
        return "fa3"
    if major == 10:
        return "trtllm_mha"
    if major >= 8:
        return "flashinfer"
    return "triton"


def resolve_flags(
    flags: Mapping[str, FlagValue], cc: tuple[int, int] | None
) -> dict[str, FlagValue]:
    """`flags` with every `"auto"` attention backend resolved for `cc`.

    With `cc` unknown the flag is dropped, so SGLang picks by itself.
    """
    out: dict[str, FlagValue] = {}
    for key, value in flags.items():
        if key in ATTENTION_BACKEND_KEYS and value == AUTO:
            if cc is not None:
                out[key] = resolve_attention_backend(cc)
            continue
        out[key] = value
    return out


def ladder_step(spec: FarmSpec, step: int) -> int:
    """`step` within the config's ladder: a reload may have shortened it."""
    return min(step, len(spec.oom.steps))


def ladder_changes(spec: FarmSpec, worker: int, oom_step: int) -> list[FlagChange]:
    """The changes the OOM ladder makes to `worker`'s flags at `oom_step` (for the log)."""
    steps = spec.oom.steps
    _flags, changes = apply_ladder(spec.worker(worker).flags, steps, ladder_step(spec, oom_step))
    return changes


def at_ladder_steps(spec: FarmSpec, oom_steps: Mapping[int, int]) -> FarmSpec:
    """`spec` with each worker's flags at its OOM-ladder step (`"auto"` kept as written):
    the workers as they will run, which is what the doctor judges. A worker absent from
    `oom_steps` is at step 0."""
    workers = tuple(
        replace(w, flags=MappingProxyType(worker_flags_raw(spec, w.id, oom_steps.get(w.id, 0))))
        for w in spec.workers
    )
    return replace(spec, workers=workers)


def worker_flags_raw(spec: FarmSpec, worker: int, oom_step: int = 0) -> dict[str, FlagValue]:
    """The worker's flags at its OOM-ladder step, before the farm's `"auto"` picks."""
    flags, _changes = apply_ladder(
        spec.worker(worker).flags, spec.oom.steps, ladder_step(spec, oom_step)
    )
    return flags


def worker_flags(
    spec: FarmSpec, worker: int, oom_step: int = 0, caps: ComputeCaps | None = None
) -> dict[str, FlagValue]:
    """The worker's SGLang flags: the config's, at its OOM-ladder step, `"auto"` resolved
    for its first GPU's compute capability (`caps`; dropped when unknown)."""
    flags = worker_flags_raw(spec, worker, oom_step)
    return resolve_flags(flags, (caps or {}).get(spec.worker(worker).gpus[0]))


def worker_command(
    spec: FarmSpec, worker: int, oom_step: int = 0, caps: ComputeCaps | None = None
) -> Command:
    """The exact command line `worker` runs at `oom_step` (`worker_flags`)."""
    flags = worker_flags(spec, worker, oom_step, caps)
    return build_command(spec.farm, spec.worker(worker), flags)


def worker_commands(
    spec: FarmSpec, oom_steps: Mapping[int, int], caps: ComputeCaps | None = None
) -> dict[int, Command]:
    """Every worker's command line, by worker id; a worker absent from `oom_steps` is at
    step 0."""
    return {w: worker_command(spec, w, oom_steps.get(w, 0), caps) for w in spec.worker_ids}
