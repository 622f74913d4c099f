"""Pure: what the farm knows of SGLang's command line, in one place.

- `SGLANG_MODULE`: the module a worker runs (`python -m sglang.launch_server`).
- `FARM_OWNED`: the flags the farm sets per worker (never in `[sglang]`), with where
  the farm takes each from; `farm_argv` spells them.
- `ATTENTION_BACKEND_KEYS`, `NOT_NVIDIA_BACKENDS`: the attention backend flags and the
  backends that are for other hardware.
- `RENAMES`: flags SGLang renamed, split or deprecated, each with the versions in which
  each spelling is valid, so the knowledge works in both directions: `spelling_for`
  ("what does SGLang X call this?"), `stale_spelling` (check-config without SGLang),
  `unknown_flag_hint` (the doctor, with the installed SGLang's version) and
  `log_advice` (a worker's log, version unknown).

Keys are the farm config's snake_case (`mem_fraction_static`); `flag_name` turns one
into SGLang's spelling (`--mem-fraction-static`). The facts are in
docs/reference/sglang.md §3-§4 (SGLang's flags) and docs/reference/seed-host.md §1 (the seed
host ran SGLang 0.5.12 with `--mamba-scheduler-strategy`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# Defined with the config's default (`[farm] module`), which sits below this folder.
from sglang_farm.spec import SGLANG_MODULE as SGLANG_MODULE

Version = tuple[int, ...]


def parse_version(text: str | None) -> Version | None:
    """`"0.5.12"` -> (0, 5, 12); the first three numbers before any `+local` part.

    `"0.5.23rc1"` and `"0.5.23.post1"` give (0, 5, 23). None for no text or no number.
    """
    if not text:
        return None
    nums = re.findall(r"\d+", text.split("+")[0])
    return tuple(int(n) for n in nums[:3]) if nums else None


def version_text(v: Version) -> str:
    return ".".join(str(n) for n in v)


def flag_name(key: str) -> str:
    """`mem_fraction_static` -> `--mem-fraction-static`."""
    return "--" + key.replace("_", "-")


def flag_key(flag: str) -> str:
    """`--mem-fraction-static=0.8` -> `mem_fraction_static`."""
    return flag.split("=", 1)[0].lstrip("-").replace("-", "_")


# --- flags the farm owns ---------------------------------------------------------------

_WHERE_TP = (
    "the farm passes --tp-size from workers.gpus_per_worker "
    "(one worker: the length of workers.overrides.N.gpus)"
)
_WHERE_GPUS = (
    "the farm gives each worker its GPUs through CUDA_VISIBLE_DEVICES from "
    "workers.gpus; inside the worker they are always 0..n-1"
)

FARM_OWNED: Mapping[str, str] = MappingProxyType(
    {
        "host": "the farm passes --host from workers.host (one worker: workers.overrides.N.host)",
        "port": "the farm passes --port from workers.base_port + worker id "
        "(one worker: workers.overrides.N.port)",
        "nccl_port": "the farm passes --nccl-port from workers.nccl_base_port + worker id "
        "(one worker: workers.overrides.N.nccl_port)",
        "tp_size": _WHERE_TP,
        # SGLang's alias of --tp-size, and the prefix argparse expands to it (allow_abbrev).
        "tensor_parallel_size": _WHERE_TP,
        "tp": _WHERE_TP,
        "base_gpu_id": _WHERE_GPUS,
        "gpu_id_step": _WHERE_GPUS,
    }
)
"""Flag key -> where the farm takes its value from (the reason it is refused in [sglang])."""

# SGLang aliases the farm refuses in favour of the canonical key, and why.
REFUSED_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "model": "write model_path (the farm reads it for preflight; --model is only its alias)",
    }
)


def farm_argv(host: str, port: int, nccl_port: int, tp_size: int) -> list[str]:
    """The farm-owned part of a worker's argv (`--tp-size` only for more than one GPU)."""
    argv = ["--host", host, "--port", str(port), "--nccl-port", str(nccl_port)]
    if tp_size > 1:
        argv += ["--tp-size", str(tp_size)]
    return argv


# --- attention backends ----------------------------------------------------------------

ATTENTION_BACKEND_KEYS = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
)
# Backends in SGLang's choices that run on other hardware than NVIDIA GPUs.
NOT_NVIDIA_BACKENDS: Mapping[str, str] = MappingProxyType(
    {
        "aiter": "AMD ROCm",
        "wave": "AMD ROCm",
        "ascend": "Huawei Ascend NPUs",
        "intel_amx": "Intel CPUs (AMX)",
        "intel_xpu": "Intel GPUs",
    }
)

MAMBA_STRATEGIES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")


# --- renames -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rename:
    """One flag SGLang renamed (one new key), split (several) or deprecated.

    `old` is accepted up to `old_until` (None: still accepted, deprecated since
    `version`); `new` from `version` on. `how` says how values carry over when they
    are not the same values under a new name.
    """

    old: str
    new: tuple[str, ...]
    version: Version
    old_until: Version | None
    source: str
    how: str = ""

    @property
    def removed(self) -> bool:
        return self.old_until is not None

    def accepts_old(self, v: Version) -> bool:
        return self.old_until is None or v <= self.old_until

    def accepts_new(self, v: Version) -> bool:
        return v >= self.version

    def new_text(self) -> str:
        return " and ".join(flag_name(n) for n in self.new)

    def write_new(self) -> str:
        """What to write instead of `old` (config keys)."""
        return self.how or " and/or ".join(self.new)


# SGLang 0.5.12 (the seed host) accepts --mamba-scheduler-strategy and --cuda-graph-max-bs;
# 0.5.23 accepts neither (docs/reference/sglang.md §4). The release that switched lies
# between them and is not pinned down: the farm takes 0.5.23 as the first version with
# the new spellings, which only shapes messages (with SGLang at hand its parser decides).
RENAMES: tuple[Rename, ...] = (
    Rename(
        "mamba_scheduler_strategy",
        ("mamba_radix_cache_strategy",),
        (0, 5, 23),
        (0, 5, 22),
        "sgl-project/sglang#27418",
    ),
    Rename(
        "cuda_graph_max_bs",
        ("cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill"),
        (0, 5, 23),
        (0, 5, 22),
        "split per CUDA graph runner",
    ),
    Rename(
        "disable_cuda_graph",
        ("cuda_graph_backend_decode", "cuda_graph_backend_prefill"),
        (0, 5, 23),
        None,
        "sglang/srt/server_args.py",
        how="cuda_graph_backend_decode = 'disabled' and cuda_graph_backend_prefill = 'disabled'",
    ),
)

_BY_KEY: Mapping[str, Rename] = MappingProxyType({k: r for r in RENAMES for k in (r.old, *r.new)})


def _before(v: Version) -> Version:
    """The last release before `v` as the table writes it ((0, 5, 23) -> (0, 5, 22))."""
    return (*v[:-1], v[-1] - 1) if v and v[-1] > 0 else v


def rename_of(key: str) -> Rename | None:
    """The table's entry in which `key` is the old or a new spelling."""
    return _BY_KEY.get(key)


def spelling_for(key: str, version: Version) -> str | None:
    """The key SGLang `version` uses for what `key` means.

    `key` itself when that version accepts it, or when the table does not know it; the
    other spelling of a known rename; None when that version has no equivalent under
    another name (a flag split in two, or one whose values do not carry over).
    """
    r = rename_of(key)
    if r is None:
        return key
    if key == r.old:
        if r.accepts_old(version):
            return key
        return r.new[0] if len(r.new) == 1 and not r.how else None
    if r.accepts_new(version):
        return key
    return r.old if r.accepts_old(version) and not r.how else None


def stale_spelling(key: str) -> str | None:
    """Without SGLang at hand: why `key` is a spelling of an older SGLang, else None.

    Never a refusal (some SGLang accepts the key): a warning naming both versions, e.g.
    "SGLang 0.5.23 renamed --mamba-scheduler-strategy to --mamba-radix-cache-strategy
    (sgl-project/sglang#27418); keep it for SGLang <= 0.5.22, write
    mamba_radix_cache_strategy for SGLang >= 0.5.23".
    """
    r = rename_of(key)
    if r is None or key != r.old:
        return None
    v, new = version_text(r.version), r.new_text()
    if r.old_until is None:
        return (
            f"SGLang {v} deprecated {flag_name(key)} ({r.source}); it still works, and "
            f"for SGLang >= {v} you may write {r.write_new()}"
        )
    verb = "renamed" if len(r.new) == 1 else "split"
    into = "to" if len(r.new) == 1 else "into"
    return (
        f"SGLang {v} {verb} {flag_name(key)} {into} {new} ({r.source}); keep it for "
        f"SGLang <= {version_text(r.old_until)}, write {r.write_new()} for SGLang >= {v}"
    )


def unknown_flag_hint(
    key: str, installed: Version, where: str = "in [sglang]"
) -> tuple[str, str] | None:
    """With SGLang at hand: what SGLang `installed` calls `key`, and what to write `where`.

    E.g. ("SGLang 0.5.12 calls it --mamba-scheduler-strategy", "write
    mamba_scheduler_strategy instead of mamba_radix_cache_strategy in [sglang] (same
    values)").
    None when the table knows no other spelling of `key`, or `installed` accepts `key`.
    """
    r = rename_of(key)
    if r is None:
        return None
    v = version_text(installed)
    other = spelling_for(key, installed)
    if other == key:
        return None
    if other is not None:
        return (
            f"SGLang {v} calls it {flag_name(other)}",
            f"write {other} instead of {key} {where} (same values)",
        )
    if key == r.old:
        return (
            f"SGLang {v} has no {flag_name(key)} (replaced by {r.new_text()} in SGLang "
            f"{version_text(r.version)})",
            f"write {r.write_new()} instead of {key} {where}",
        )
    return (
        f"SGLang {v} has no {flag_name(key)} (it came with SGLang "
        f"{version_text(r.version)}); SGLang {v} has {flag_name(r.old)}",
        f"write {r.old} instead of {key} {where} (see `--help` for its values)",
    )


def log_advice(key: str) -> str | None:
    """For a log whose SGLang version is unknown: the other spelling of a rejected `key`."""
    r = rename_of(key)
    if r is None:
        return None
    v = version_text(r.version)
    if key == r.old:
        if not r.removed:
            return f"`{key}` is deprecated since SGLang {v}: write {r.write_new()} instead."
        if len(r.new) == 1:
            return (
                f"`{key}` was renamed in SGLang {v}: in the farm config write "
                f"`{r.new[0]}` instead (same values)."
            )
        return (
            f"`{key}` was removed from SGLang in {v}: use "
            + " and/or ".join(f"`{n}`" for n in r.new)
            + " in the farm config instead."
        )
    older = f"SGLang <= {version_text(r.old_until or _before(r.version))}"
    if r.how:
        return f"`{key}` came with SGLang {v}; {older} has `{r.old}` instead."
    return (
        f"`{key}` is the spelling of SGLang >= {v}; {older} calls it `{r.old}`: write "
        f"`{r.old}` in the farm config for this SGLang."
    )


MAMBA_STRATEGY_KEYS = ("mamba_radix_cache_strategy", "mamba_scheduler_strategy")
"""The mamba radix-cache strategy's key in SGLang >= 0.5.23, then in older SGLang."""


def mamba_strategy(flags: Mapping[str, object]) -> tuple[str, object] | None:
    """The mamba radix-cache strategy in `flags` under either spelling: (key, value)."""
    for key in MAMBA_STRATEGY_KEYS:
        if key in flags:
            return key, flags[key]
    return None
