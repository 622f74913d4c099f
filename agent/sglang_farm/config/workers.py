"""Pure: worker resolution, `[workers]` and its overrides -> one `WorkerSpec` per worker.

The GPUs are laid out `gpus_per_worker` at a time, ports counted up from the base
ports, and each override applied; `_Claim` remembers which key gave a worker its GPUs
and ports, so that a clash (`checks`) is reported where the fix is.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from sglang_farm.config.lines import _Path
from sglang_farm.config.problems import _show
from sglang_farm.config.reader import _Reader, _Table
from sglang_farm.config.values import _PORT, _host, _int, _is_int
from sglang_farm.spec import FarmSection, FlagValue, WorkerSpec


@dataclass(frozen=True, slots=True)
class WorkersDefaults:
    """`[workers]` defaults (the section resolves into `WorkerSpec`s, so it has no spec class)."""

    gpus: str = "all"
    gpus_per_worker: int = 1
    host: str = "127.0.0.1"  # SGLang's own default; "0.0.0.0" serves other hosts too
    base_port: int = 30000  # SGLang's default port; worker i listens on base_port + i
    # Outside SGLang's random NCCL range (22000-29999) so a pinned port never races a
    # random one; worker i uses nccl_base_port + i.
    nccl_base_port: int = 31000


@dataclass(frozen=True, slots=True)
class _Claim:
    """Where a worker's GPUs/ports came from, for problems about clashes."""

    gpus_path: _Path
    port_path: _Path
    nccl_path: _Path
    host_path: _Path


def _gpu_list(
    reader: _Reader, path: _Path, value: object, gpu_count: int | None
) -> list[int] | None:
    if value == "all":
        if gpu_count is None:
            reader.problems.add(
                path,
                'gpus = "all" needs NVML to count GPUs, and no count was given '
                "here; list them instead, e.g. gpus = [0, 1, 2, 3]",
            )
            return None
        if gpu_count < 1:
            reader.problems.add(path, 'gpus = "all" but this host has no GPU that NVML can see')
            return None
        return list(range(gpu_count))
    if not isinstance(value, list) or not value or not all(_is_int(g) and g >= 0 for g in value):
        reader.problems.add(
            path,
            f'expected "all" or a non-empty list of GPU indices (integers >= 0), '
            f"got {_show(value)}",
        )
        return None
    gpus: list[int] = [g for g in value if isinstance(g, int)]
    ok = True
    for i, g in enumerate(gpus):
        if g in gpus[:i]:
            reader.problems.add(path, f"GPU {g} is listed twice; each GPU belongs to one worker")
            ok = False
        if gpu_count is not None and g >= gpu_count:
            reader.problems.add(
                path,
                f"GPU {g} does not exist; this host has {gpu_count} GPU(s), 0..{gpu_count - 1}",
            )
            ok = False
    return gpus if ok else None


def _workers(
    reader: _Reader,
    doc: _Table,
    farm: FarmSection,
    base_flags: dict[str, FlagValue],
    gpu_count: int | None,
) -> tuple[list[WorkerSpec], dict[int, _Claim]] | None:
    path = ("workers",)
    d = WorkersDefaults()
    tbl = reader.table(
        path,
        doc.get("workers", {}),
        ("gpus", "gpus_per_worker", "host", "base_port", "nccl_base_port", "overrides"),
    )
    before = len(reader.problems.items)
    per = reader.get(tbl, path, "gpus_per_worker", _int(1), d.gpus_per_worker)
    per_ok = len(reader.problems.items) == before
    host = reader.get(tbl, path, "host", _host, d.host)
    base_port = reader.get(tbl, path, "base_port", _PORT, d.base_port)
    nccl_base = reader.get(tbl, path, "nccl_base_port", _PORT, d.nccl_base_port)
    gpus = _gpu_list(reader, (*path, "gpus"), tbl.get("gpus", d.gpus), gpu_count)
    raw_overrides = tbl.get("overrides", {})
    if not isinstance(raw_overrides, dict):
        reader.problems.add(
            (*path, "overrides"),
            f"expected tables [workers.overrides.N], got {_show(raw_overrides)}",
        )
        raw_overrides = {}
    if gpus is None or not per_ok:
        # Nothing to lay workers out on; still check the overrides' shapes.
        for key, raw in raw_overrides.items():
            _override(reader, (*path, "overrides", key), raw, gpu_count)
        return None
    if len(gpus) % per:
        reader.problems.add(
            (*path, "gpus_per_worker"),
            f"{len(gpus)} GPU(s) do not split into workers "
            f"of {per}; list a multiple of {per} GPUs in workers.gpus",
            line_of=(*path, "gpus_per_worker"),
        )
        return None
    count = len(gpus) // per
    for key, base in (("base_port", base_port), ("nccl_base_port", nccl_base)):
        if base + count - 1 > 65535:
            reader.problems.add(
                (*path, key),
                f"{base} + {count - 1} (the last worker) exceeds 65535; "
                f"choose a base port <= {65536 - count}",
            )
    overrides: dict[int, _Table] = {}
    for key, raw in raw_overrides.items():
        opath = (*path, "overrides", key)
        ov = _override(reader, opath, raw, gpu_count)
        if not key.isdigit():
            reader.problems.add(
                opath, f"expected a worker id (an integer 0..{count - 1}), got {key!r}"
            )
        elif int(key) >= count:
            reader.problems.add(
                opath,
                f"no worker {int(key)}; workers are 0..{count - 1} "
                f"({len(gpus)} GPU(s), {per} per worker)",
            )
        elif ov is not None:
            overrides[int(key)] = ov
    workers: list[WorkerSpec] = []
    claims: dict[int, _Claim] = {}
    for wid in range(count):
        ov = overrides.get(wid, {})
        opath = (*path, "overrides", str(wid))
        flags = dict(base_flags)
        ov_flags = ov.get("sglang", {})
        assert isinstance(ov_flags, dict)
        flags.update(ov_flags)
        env = dict(farm.env)
        ov_env = ov.get("env", {})
        assert isinstance(ov_env, dict)
        env.update(ov_env)
        wgpus = ov.get("gpus", gpus[wid * per : (wid + 1) * per])
        assert isinstance(wgpus, list)
        whost, wport, wnccl = ov.get("host", host), ov.get("port"), ov.get("nccl_port")
        assert isinstance(whost, str)
        assert wport is None or isinstance(wport, int)
        assert wnccl is None or isinstance(wnccl, int)
        workers.append(
            WorkerSpec(
                id=wid,
                gpus=tuple(wgpus),
                host=whost,
                port=wport if wport is not None else base_port + wid,
                nccl_port=wnccl if wnccl is not None else nccl_base + wid,
                flags=MappingProxyType(flags),
                env=MappingProxyType(env),
            )
        )
        claims[wid] = _Claim(
            gpus_path=(*opath, "gpus") if "gpus" in ov else (*path, "gpus"),
            port_path=(*opath, "port") if "port" in ov else (*path, "base_port"),
            nccl_path=(*opath, "nccl_port") if "nccl_port" in ov else (*path, "nccl_base_port"),
            host_path=(*opath, "host") if "host" in ov else (*path, "host"),
        )
    return workers, claims


def _override(reader: _Reader, path: _Path, raw: object, gpu_count: int | None) -> _Table | None:
    """A valid override as a table of converted values; None if it has problems."""
    tbl = reader.table(path, raw, ("gpus", "host", "port", "nccl_port", "env", "sglang"))
    before = len(reader.problems.items)
    out: _Table = {}
    if "gpus" in tbl:
        gpus = _gpu_list(reader, (*path, "gpus"), tbl["gpus"], gpu_count)
        if gpus is not None and tbl["gpus"] == "all":
            reader.problems.add((*path, "gpus"), "expected a list of this worker's GPUs, got 'all'")
        elif gpus is not None:
            out["gpus"] = gpus
    for key, conv in (("host", _host), ("port", _PORT), ("nccl_port", _PORT)):
        value = reader.get(tbl, path, key, conv, None)
        if value is not None:
            out[key] = value
    out["env"] = reader.env(tbl, path)
    raw_flags = tbl.get("sglang", {})
    if isinstance(raw_flags, dict):
        out["sglang"] = reader.flags(raw_flags, (*path, "sglang"))
    else:
        reader.problems.add(
            (*path, "sglang"), f"expected a table of SGLang flags, got {_show(raw_flags)}"
        )
    return out if len(reader.problems.items) == before else None
