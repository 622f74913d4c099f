"""Pure: one worker's exact command line and environment, from the spec.

The same function feeds the process runtime (argv for exec), the unit renderer
(`ExecStart=` of the drop-in) and `reload` (a worker restarts only when this changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sglang_farm.sglang_flags import farm_argv, flag_name
from sglang_farm.spec import FarmSection, FlagValue, WorkerSpec


@dataclass(frozen=True, slots=True)
class Command:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted, so equal commands compare equal

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


def flag_argv(key: str, value: FlagValue) -> list[str]:
    """argv items for one `[sglang]` entry: true -> bare flag, false -> nothing, list -> nargs."""
    if value is True:
        return [flag_name(key)]
    if value is False:
        return []
    if isinstance(value, tuple):
        return [flag_name(key), *(str(v) for v in value)]
    return [flag_name(key), str(value)]


def build_command(
    farm: FarmSection, worker: WorkerSpec, flags: Mapping[str, FlagValue] | None = None
) -> Command:
    """The worker's argv and environment.

    `flags` replaces `worker.flags` (the OOM ladder passes the adjusted set).
    Farm-owned flags come last so that they are the ones SGLang sees.
    """
    argv = [farm.python, "-m", farm.module]
    for key, value in (worker.flags if flags is None else flags).items():
        argv += flag_argv(key, value)
    argv += farm_argv(worker.host, worker.port, worker.nccl_port, len(worker.gpus))
    env = dict(worker.env)
    # The worker sees its GPU(s) as CUDA ordinals 0..n-1; NVML keeps the host's indices.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in worker.gpus)
    # NVML's index order must equal CUDA's, or CUDA_VISIBLE_DEVICES=3 could be another card.
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # Log lines must reach the farm as they are written, not when a buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return Command(argv=tuple(argv), env=tuple(sorted(env.items())))
