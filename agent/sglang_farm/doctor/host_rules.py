"""Pure: the doctor's host rules: what the host gives a worker beside its GPU.

Ports (free now, and who else may bind them: `port_privilege_checks`), the model
directory and /dev/shm, who can reach a worker (exposure), the config's secrets and key
files, and a managed gateway's smg.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from sglang_farm.doctor.checks import (
    GIB,
    Check,
    CheckId,
    GatewayFacts,
    KeyFileFacts,
    Observations,
    Status,
    gb,
)
from sglang_farm.gateway.managed import is_loopback
from sglang_farm.spec import FarmSpec, ModelSpec, WorkerSpec

# Weights above this share of the static budget leave a KV cache too small to be useful.
WEIGHTS_SHARE_WARN = 0.9
# SGLang's processes and NCCL put shared-memory segments in /dev/shm too.
SHM_MIN_FREE_BYTES = 1 * GIB
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def port_checks(obs: Observations, w: WorkerSpec) -> list[Check]:
    out = []
    for cid, host, port, what, key in (
        (CheckId.PORT_HTTP, w.host, w.port, "HTTP", "base_port"),
        (CheckId.PORT_NCCL, "0.0.0.0", w.nccl_port, "NCCL", "nccl_base_port"),
    ):
        busy = obs.ports.get((host, port))
        if busy is None:
            out.append(Check(cid, Status.PASS, f"{what} port free"))
        elif obs.own_ports.get((host, port)) == w.id:
            out.append(
                Check(cid, Status.PASS, f"{what} port {port} is worker {w.id}'s own (it runs)")
            )
        else:
            out.append(
                Check(
                    cid,
                    Status.FAIL,
                    f"{what} port {port} on {host}: {busy}",
                    f"stop what listens there (`ss -ltnp 'sport = :{port}'`) or change "
                    f"workers.{key} (the port of a worker of this farm that runs is no "
                    "conflict: run the doctor as the agent's user if it is one)",
                )
            )
    return out


def model_checks(
    obs: Observations, w: WorkerSpec, mem_total: int | None, model: ModelSpec | None = None
) -> list[Check]:
    raw = w.flags.get("model_path")
    if not isinstance(raw, str):
        return []
    facts = obs.models.get(raw)
    out: list[Check] = []
    if facts is None:
        return out
    if not facts.exists and model is not None and raw.startswith("/"):
        # [model]: the agent stages it here before any worker starts (docs/staging.md).
        out.append(
            Check(
                CheckId.MODEL_PATH,
                Status.PASS,
                f"{raw} is not there yet: the agent stages it from {model.source} "
                "before any worker starts ([model])",
            )
        )
        return out
    if not facts.exists:
        if _HF_REPO_RE.match(raw) and not raw.startswith((".", "/")):
            out.append(
                Check(
                    CheckId.MODEL_PATH,
                    Status.WARN,
                    f"{raw} is not a local directory: SGLang will download it from "
                    "Hugging Face at the first start (minutes, on every worker at once)",
                    "download it once (`huggingface-cli download`) and set model_path "
                    "to the local directory",
                )
            )
        else:
            tmpfs = (
                " (/dev/shm is a tmpfs, emptied at every boot: copy the model there again)"
                if raw.startswith("/dev/shm")
                else ""
            )
            fix = (
                "add a [model] section (source = the model's persistent directory or Hugging "
                "Face repo id): the agent then stages it here at every start, before any "
                "worker (docs/staging.md)"
                if raw.startswith("/dev/shm")
                else "copy the model there or set model_path in [sglang]"
            )
            out.append(Check(CheckId.MODEL_PATH, Status.FAIL, f"{raw} does not exist{tmpfs}", fix))
        return out
    if not facts.is_dir or not facts.has_config:
        out.append(
            Check(
                CheckId.MODEL_PATH,
                Status.FAIL,
                f"{raw} has no config.json: not a Hugging Face model directory",
                "point model_path at the directory that holds config.json and the weights",
            )
        )
        return out
    size = f" ({gb(facts.weights_bytes)} of weights)" if facts.weights_bytes else ""
    out.append(Check(CheckId.MODEL_PATH, Status.PASS, f"{raw} has config.json{size}"))
    if facts.in_shm and model is None:
        out.append(
            Check(
                CheckId.SHM,
                Status.WARN,
                f"{raw} is on /dev/shm, a tmpfs emptied at every boot, and nothing "
                "puts it back: after a reboot every worker fails its load",
                "add a [model] section (source = the model's persistent directory or "
                "Hugging Face repo id): the agent stages it into model_path at every "
                "start, before any worker (docs/staging.md)",
            )
        )
    if facts.in_shm and obs.shm_free_bytes is not None:
        used = gb(facts.size_bytes or 0)
        if obs.shm_free_bytes < SHM_MIN_FREE_BYTES:
            out.append(
                Check(
                    CheckId.SHM,
                    Status.WARN,
                    f"the model takes {used} of /dev/shm (RAM-backed) and only "
                    f"{gb(obs.shm_free_bytes)} is left; SGLang and NCCL need "
                    "/dev/shm for shared-memory segments",
                    "free /dev/shm or enlarge it (mount -o remount,size=...)",
                )
            )
        else:
            out.append(
                Check(
                    CheckId.SHM,
                    Status.PASS,
                    f"the model takes {used} of /dev/shm; {gb(obs.shm_free_bytes)} free",
                )
            )
    frac = w.flags.get("mem_fraction_static")
    if isinstance(frac, int | float) and not isinstance(frac, bool) and mem_total:
        budget = frac * mem_total
        per_gpu = (facts.weights_bytes or 0) / max(1, len(w.gpus))
        tp = f" per GPU (tp {len(w.gpus)})" if len(w.gpus) > 1 else ""
        if per_gpu and per_gpu > budget:
            out.append(
                Check(
                    CheckId.MEMORY,
                    Status.FAIL,
                    f"the weights alone ({gb(per_gpu)}{tp}) exceed "
                    f"mem_fraction_static {frac} x {gb(mem_total)} = {gb(budget)}: "
                    "SGLang stops with 'Loaded weights leave no GPU memory for the KV "
                    "cache'",
                    "raise mem_fraction_static, use more GPUs per worker "
                    "(gpus_per_worker), or a smaller/quantized model",
                )
            )
        elif per_gpu and per_gpu > WEIGHTS_SHARE_WARN * budget:
            out.append(
                Check(
                    CheckId.MEMORY,
                    Status.WARN,
                    f"the weights ({gb(per_gpu)}{tp}) fill over "
                    f"{WEIGHTS_SHARE_WARN:.0%} of mem_fraction_static {frac} x "
                    f"{gb(mem_total)}: little room for the KV cache",
                    "raise mem_fraction_static a little or use more GPUs per worker",
                )
            )
    return out


_FIX_EXPOSURE = (
    'bind the workers to loopback (host = "127.0.0.1" in [workers]) and serve through the '
    'gateway ([gateway] mode = "managed"), or set api_key and keep the key out of '
    'world-readable files (docs/config.md, "Exposure and keys")'
)


def exposure_check(w: WorkerSpec) -> Check:
    """Whether anyone on the network can use the worker (docs/reference/sglang.md §6.2:
    without --api-key SGLang serves every route, admin ones included, to any caller)."""
    if is_loopback(w.host):
        return Check(CheckId.EXPOSURE, Status.PASS, f"listens on loopback ({w.host})")
    if w.flags.get("api_key"):
        return Check(
            CheckId.EXPOSURE,
            Status.PASS,
            f"listens on {w.host!r}; api_key is set (routes need the key)",
        )
    return Check(
        CheckId.EXPOSURE,
        Status.WARN,
        f"workers listen on {w.host!r} (not loopback) without api_key: anyone who "
        "can reach this host can use them, admin routes included",
        _FIX_EXPOSURE,
    )


# Words in an environment variable's name that mark its value as a credential
# (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, a PASSWORD...), as whole words of the
# name: TOKENIZERS_PARALLELISM holds no token. A word ending in one counts too (HFTOKEN).
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says its value is a credential."""
    words = [w.removesuffix("S") for w in re.split(r"[^A-Z0-9]+", name.upper()) if w]
    return any(w.endswith(_SECRET_WORDS) for w in words)


def _is_api_key(flag: str) -> bool:
    return flag.replace("-", "_") == "api_key"


def credential_paths(doc: Mapping[str, object]) -> list[str]:
    """Where a config document (the TOML as parsed) holds a credential, as key paths
    (`sglang.api_key`, `farm.env.HF_TOKEN`, `workers.overrides.3.env.WANDB_API_KEY`):
    an SGLang `api_key` and every `env` value whose name says it is one
    (`is_secret_name`). For check-config's refusal of a file every user can read."""

    def table(v: object) -> Mapping[str, object]:
        return v if isinstance(v, Mapping) else {}

    found: list[str] = []

    def look(prefix: str, t: Mapping[str, object], sglang_key: str) -> None:
        found.extend(
            f"{prefix}{sglang_key}.{k}" for k in table(t.get(sglang_key)) if _is_api_key(k)
        )
        found.extend(f"{prefix}env.{n}" for n in table(t.get("env")) if is_secret_name(n))

    found.extend(f"sglang.{k}" for k in table(doc.get("sglang")) if _is_api_key(k))
    found.extend(
        f"farm.env.{n}" for n in table(table(doc.get("farm")).get("env")) if is_secret_name(n)
    )
    for wid, o in table(table(doc.get("workers")).get("overrides")).items():
        look(f"workers.overrides.{wid}.", table(o), "sglang")
    return found


def config_secrets_check(spec: FarmSpec, mode: int | None) -> Check | None:
    """A warning when the config holds a secret (an `api_key`, or an `env` value whose
    name says it is a credential: `HF_TOKEN`, not `SGLANG_SIM_FAIL_AFTER`) and the file
    is readable by every local user (`mode & 0o004`); None otherwise. The units never
    show any configured value (every one goes to a root-only file: docs/security.md),
    but the file itself would."""
    if mode is None or not mode & 0o004:
        return None
    what = []
    if any(w.flags.get("api_key") for w in spec.workers):
        what.append("api_key")
    names = sorted(
        {
            n
            for env in (spec.farm.env, *(w.env for w in spec.workers))
            for n in env
            if is_secret_name(n)
        }
    )
    if names:
        what.append(f"environment values that look like credentials ({', '.join(names)})")
    if not what:
        return None
    return Check(
        CheckId.EXPOSURE,
        Status.WARN,
        f"{spec.source} holds {' and '.join(what)} and is readable by every local user "
        f"(mode {mode & 0o7777:04o})",
        f"chmod 0640 {spec.source} (root:sglang-farm) or chmod 0600 {spec.source}",
    )


def key_files(spec: FarmSpec) -> tuple[tuple[str, str], ...]:
    """The files the config names that hold a secret: (its key in the config, path)."""
    named = [
        ("[gateway] admin_key_file", spec.gateway.admin_key_file),
        ("[gateway] api_key_file", spec.gateway.api_key_file),
        ("[model] token_file", spec.model.token_file if spec.model is not None else None),
    ]
    return tuple((key, path) for key, path in named if path)


def key_file_checks(
    spec: FarmSpec, facts: Mapping[str, KeyFileFacts], agent_uid: int
) -> list[Check]:
    """A warning for each key file (`key_files`) that another user could read or replace:
    any group or other permission bit, or an owner other than the agent's user
    (`agent_uid`). The Hub token file is refused at stage time for the same reasons
    (`staging.hub.read_token`); the gateway's keys are read by whoever starts smg, so the
    config check and the doctor say it before a key leaks (issue 22, item 12)."""
    out = []
    for key, path in key_files(spec):
        f = facts.get(path)
        fix = f"chown root: {path} && chmod 0600 {path}"
        if f is None:
            continue  # not looked at
        if f.error is not None:
            out.append(
                Check(
                    CheckId.EXPOSURE,
                    Status.WARN,
                    f"{key} {path}: cannot read it: {f.error}",
                    f"write the key alone into {path}; {fix}",
                )
            )
            continue
        if f.mode is not None and f.mode & 0o077:
            out.append(
                Check(
                    CheckId.EXPOSURE,
                    Status.WARN,
                    f"{key} {path} is open to other users (mode {f.mode:04o}): "
                    "only its owner may read a key",
                    fix,
                )
            )
        if f.uid is not None and f.uid != agent_uid:
            out.append(
                Check(
                    CheckId.EXPOSURE,
                    Status.WARN,
                    f"{key} {path} is owned by uid {f.uid}, not by the agent's user "
                    f"(uid {agent_uid}): its owner can change the key",
                    fix,
                )
            )
    return out


# The `gateway` extra's pin (pyproject.toml): the farm is tested against this smg.
SMG_REQUIREMENT = "smg==1.13.0"


def gateway_check(spec: FarmSpec, facts: GatewayFacts | None) -> Check | None:
    """A managed gateway needs smg in the interpreter that runs it (the agent's own):
    without it the gateway never starts and the farm has no front door. None when the
    gateway is not managed here (or was not looked at)."""
    if facts is None or not spec.gateway.enabled or spec.gateway.mode != "managed":
        return None
    if facts.error is None:
        return Check(
            CheckId.GATEWAY,
            Status.PASS,
            f"the managed gateway runs: {facts.version or 'smg'} ({facts.python})",
        )
    return Check(
        CheckId.GATEWAY,
        Status.FAIL,
        f'[gateway] mode = "managed" but smg does not run under {facts.python}: '
        f"{facts.error}; the farm has no front door until it does",
        f"install it into that Python: `{facts.python} -m pip install '{SMG_REQUIREMENT}'` "
        "(the `gateway` extra: `pip install 'sglang-farm[gateway]'`); from the Debian "
        "package: `apt install --reinstall sglang-farm`, which ships it",
    )


# Issue 30 item 4: the ports below `net.ipv4.ip_unprivileged_port_start` need root or
# CAP_NET_BIND_SERVICE to bind (ip(7)); the kernel refuses a value at or above the first
# port of `ip_local_port_range` (measured: 32768 refused, 32767 taken, with 32768-60999).
UNPRIVILEGED_SYSCTL = "net.ipv4.ip_unprivileged_port_start"
SYSCTL_FILE = "/etc/sysctl.d/60-sglang-farm.conf"


def farm_ports(spec: FarmSpec) -> list[tuple[str, int]]:
    """(what, port) for every port another local user could squat to the farm's harm:
    each worker's HTTP and NCCL port, and a managed gateway's two."""
    out: list[tuple[str, int]] = []
    for w in spec.workers:
        out += [("workers' HTTP", w.port), ("workers' NCCL", w.nccl_port)]
    g = spec.gateway
    if g.enabled and g.mode == "managed":
        out += [("the gateway's", g.listen.port), ("the gateway's /metrics", g.metrics_listen.port)]
    return out


def _spans(ports: list[int]) -> str:
    """`30000-30007, 30009`: sorted ports, runs of consecutive ones as a span."""
    runs: list[list[int]] = []
    for p in sorted(set(ports)):
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _describe(found: list[tuple[str, int]]) -> str:
    groups: dict[str, list[int]] = {}
    for what, port in found:
        groups.setdefault(what, []).append(port)
    return "; ".join(
        f"{what} port{'s' if len(ps) > 1 else ''} {_spans(ps)}" for what, ps in groups.items()
    )


def port_privilege_checks(spec: FarmSpec, obs: Observations) -> list[Check]:
    """Whether any local user may bind the farm's ports while they are free (a worker's
    after its crash, until the gateway drops it), from the host's sysctl; empty when it
    was not read."""
    start = obs.unprivileged_port_start
    if start is None:
        return []
    ports = farm_ports(spec)
    open_ = [(what, p) for what, p in ports if p >= start]
    out: list[Check] = []
    if not open_:
        out.append(
            Check(
                CheckId.PORT_PRIVILEGE,
                Status.PASS,
                f"every farm port is below {UNPRIVILEGED_SYSCTL} ({start}): only root or a "
                "process with CAP_NET_BIND_SERVICE can bind one (the systemd units give it to "
                "the workers and the gateway for such ports; under the process runtime a "
                "worker user other than root has no way to bind them)",
            )
        )
    else:
        top = max(p for _, p in ports)
        limit = obs.local_port_range_start
        if limit is not None and top + 1 >= limit:
            fix = (
                f"the kernel refuses {UNPRIVILEGED_SYSCTL} at or above the first port of "
                f"net.ipv4.ip_local_port_range ({limit}): move the farm's ports below "
                f"{limit - 1} first, then raise it as docs/security.md says"
            )
        else:
            fix = (
                f"on a host shared with users you do not trust: `sysctl -w "
                f"{UNPRIVILEGED_SYSCTL}={top + 1}`, and the same line in {SYSCTL_FILE}; the "
                "farm's systemd units then give its workers and gateway CAP_NET_BIND_SERVICE "
                f"for those ports, but every other service that binds a port below {top + 1} "
                "without root or that capability fails (see `ss -ltnp`), the agent's "
                "[metrics] listen included; docs/security.md says what is left open"
            )
        out.append(
            Check(
                CheckId.PORT_PRIVILEGE,
                Status.WARN,
                f"{_describe(open_)}: at or above {UNPRIVILEGED_SYSCTL} ({start}), so any "
                "local user can bind one while it is free. A worker's port is free from its "
                "crash until the gateway drops it (milliseconds, in which smg sends whoever "
                "bound it users' prompts with the worker's key); a loading worker's port and "
                "the gateway's are guarded (never ready; no key sent), but a squatter there "
                "still keeps them from starting",
                fix,
            )
        )
    metrics = spec.metrics.listen.port
    if 0 < metrics < start:  # 0: any free port the kernel picks (tests), never a low one
        out.append(
            Check(
                CheckId.PORT_PRIVILEGE,
                Status.WARN,
                f"[metrics] listen port {metrics} is below {UNPRIVILEGED_SYSCTL} ({start}): "
                "the agent's systemd unit has no capabilities, so its exporter cannot bind it",
                f"move [metrics] listen to a port of {start} or above",
            )
        )
    return out
