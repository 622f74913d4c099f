"""Pure: one worker's exact command line and environment (`Command`), from its flags.

With an API key the worker runs a short launcher (`launcher_code`) that hands SGLang the
key without putting it on any command line; docs/units.md says why and how.
`worker_commands` decides which flags a worker runs; this module only builds the line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sglang_farm.sglang.flags import farm_argv, flag_name
from sglang_farm.spec import FarmSection, FarmSpec, FlagValue, WorkerSpec

# The environment variable the process runtime hands the key over in (docs/units.md).
API_KEY_ENV = "SGLANG_FARM_API_KEY"
# The credential's name under $CREDENTIALS_DIRECTORY (the drop-in's LoadCredential=).
API_KEY_CREDENTIAL = "api-key"


def launcher_code(module: str) -> str:
    """The `python -c` code that runs `module` with the API key added to its argv.

    One line, no secret in it; `module` is written as a Python literal. Exits 1 with a
    message (no traceback) when no key was handed over.
    """
    return (
        "import os,runpy,sys;"
        f"k=os.environ.pop({API_KEY_ENV!r},None);"
        "d=os.environ.get('CREDENTIALS_DIRECTORY');"
        f"k=k if k is not None else open(d+'/{API_KEY_CREDENTIAL}').read() if d else None;"
        "k is None and sys.exit('sglang-farm: this worker needs an API key and none was "
        f"handed over ({API_KEY_ENV} or the {API_KEY_CREDENTIAL} credential)');"
        f"m={module!r};"
        "sys.argv=[m,*sys.argv[1:],'--api-key',k];"
        "runpy.run_module(m,run_name='__main__',alter_sys=True)"
    )


@dataclass(frozen=True, slots=True)
class Command:
    """A worker's command line, environment and API key.

    `argv` never holds the key: with one, it is the launcher form (docs/units.md).
    `api_key` is part of equality (a changed key restarts the worker) but not of repr.

    `public_env`: the names in `env` the farm itself set (`CUDA_VISIBLE_DEVICES` and the
    like), the only ones a world-readable unit drop-in may show; every other variable
    came from the config that built this command and may be a token, so its value goes
    to a root-only file (`runtime.unit_secrets`). Carried here, not looked up in a spec
    at render time: during a canary analysis the units are rendered from the candidate
    config while the baseline workers run the accepted one's commands. Empty (a command
    made by hand) treats every variable as private. Not part of equality: where a value
    is written does not change what the worker runs.
    """

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted, so equal commands compare equal
    api_key: str | None = field(default=None, repr=False)
    public_env: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def private_env(self) -> tuple[tuple[str, str], ...]:
        """The config's variables (`env` less `public_env`), sorted: never world-readable."""
        return tuple((k, v) for k, v in self.env if k not in self.public_env)

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
    Farm-owned flags come last so that they are the ones SGLang sees. An `api_key`
    flag is left out of `argv` and returned as `api_key`, with the launcher in front.
    """
    chosen = worker.flags if flags is None else flags
    key = chosen.get("api_key")
    api_key = key if isinstance(key, str) and key else None
    if api_key is None:
        argv = [farm.python, "-m", farm.module]
    else:
        argv = [farm.python, "-c", launcher_code(farm.module)]
    for name, value in chosen.items():
        if name != "api_key" or api_key is None:
            argv += flag_argv(name, value)
    argv += farm_argv(worker.host, worker.port, worker.nccl_port, len(worker.gpus))
    env = dict(worker.env)
    # The worker sees its GPU(s) as CUDA ordinals 0..n-1; NVML keeps the host's indices.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in worker.gpus)
    # NVML's index order must equal CUDA's, or CUDA_VISIBLE_DEVICES=3 could be another card.
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # Log lines must reach the farm as they are written, not when a buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return Command(
        argv=tuple(argv),
        env=tuple(sorted(env.items())),
        api_key=api_key,
        public_env=frozenset(env) - frozenset(worker.env),
    )


def worker_api_key(spec: FarmSpec, worker: int) -> str | None:
    """The worker's SGLang `--api-key`, which its `/v1/loads` requires (None: none set)."""
    if worker not in spec.worker_ids:
        return None
    key = spec.worker(worker).flags.get("api_key")
    return key if isinstance(key, str) and key else None
