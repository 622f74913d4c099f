"""Pure: the sections that map onto one spec class each (the first pass: shape and types).

`[farm]`, `[startup]`, `[health]`, `[restart]`, `[metrics]`, `[control]`, `[gateway]`,
`[model]` and `[batch]`; `[oom]` and `[workers]` have modules of their own.
"""

from __future__ import annotations

import re
from types import MappingProxyType

from sglang_farm.config.problems import _ConversionError, _show
from sglang_farm.config.reader import _Reader, _Table
from sglang_farm.config.values import (
    AGENT_PYTHON,
    _abs_path,
    _account,
    _bool,
    _canary,
    _choice,
    _duration,
    _farm_name,
    _host,
    _http_url,
    _http_urls,
    _int,
    _key_file,
    _listen,
    _model_source,
    _module,
    _python,
    _ready_path,
    _revision,
    _size,
    _socket_path,
    _str_list,
    _url_path,
)
from sglang_farm.gateway import routing as gateway_routing
from sglang_farm.gateway.managed import OWNED_FLAGS as GATEWAY_OWNED_FLAGS
from sglang_farm.gateway.managed import POLICIES as GATEWAY_POLICIES
from sglang_farm.gateway.managed import POLICIES_NEEDING_WORKERS as GATEWAY_POLICIES_NEEDING_WORKERS
from sglang_farm.gateway.managed import is_loopback
from sglang_farm.spec import (
    PRIORITY_HEADER,
    BatchSpec,
    ControlSpec,
    FarmSection,
    GatewayRouting,
    GatewaySpec,
    HealthPolicy,
    MetricsSpec,
    ModelSpec,
    RestartPolicy,
    StartupPolicy,
)


def _farm(reader: _Reader, doc: _Table, agent_python: str | None) -> FarmSection:
    path = ("farm",)
    d = FarmSection()
    tbl = reader.table(
        path, doc.get("farm", {}), ("name", "python", "module", "user", "group", "state_dir", "env")
    )
    python = reader.get(tbl, path, "python", _python, d.python)
    if python == AGENT_PYTHON:
        if agent_python is None:
            reader.problems.add(
                (*path, "python"),
                f"{AGENT_PYTHON!r} means the interpreter running the "
                "agent, which this caller did not give; write an absolute path instead",
            )
        python = agent_python or d.python
    return FarmSection(
        name=reader.get(tbl, path, "name", _farm_name, d.name),
        python=python,
        module=reader.get(tbl, path, "module", _module, d.module),
        user=reader.get(tbl, path, "user", _account("user"), d.user),
        group=reader.get(tbl, path, "group", _account("group"), d.group),
        state_dir=reader.get(tbl, path, "state_dir", _abs_path, d.state_dir),
        env=MappingProxyType(reader.env(tbl, path)),
    )


def _startup(reader: _Reader, doc: _Table) -> StartupPolicy:
    path = ("startup",)
    d = StartupPolicy()
    tbl = reader.table(
        path, doc.get("startup", {}), ("canary", "parallel", "load_timeout", "poll_interval")
    )
    return StartupPolicy(
        # An invalid canary becomes None so that the cross-check does not report it twice.
        canary=reader.get(tbl, path, "canary", _canary, d.canary if "canary" not in tbl else None),
        parallel=reader.get(tbl, path, "parallel", _int(1), d.parallel),
        load_timeout=reader.get(tbl, path, "load_timeout", _duration(), d.load_timeout),
        poll_interval=reader.get(tbl, path, "poll_interval", _duration(), d.poll_interval),
    )


def _health(reader: _Reader, doc: _Table) -> HealthPolicy:
    path = ("health",)
    d = HealthPolicy()
    tbl = reader.table(
        path,
        doc.get("health", {}),
        (
            "period",
            "timeout",
            "failure_threshold",
            "path",
            "ready_path",
            "busy_window",
            "stall_window",
        ),
    )
    # No lower bound on timeout: SGLang's /health may take up to 20 s (hence the 25 s
    # default), but the simulator answers in about 1 s and the demo wants short probes.
    return HealthPolicy(
        period=reader.get(tbl, path, "period", _duration(), d.period),
        timeout=reader.get(tbl, path, "timeout", _duration(), d.timeout),
        failure_threshold=reader.get(tbl, path, "failure_threshold", _int(1), d.failure_threshold),
        path=reader.get(tbl, path, "path", _url_path, d.path),
        ready_path=reader.get(tbl, path, "ready_path", _ready_path, d.ready_path),
        busy_window=reader.get(tbl, path, "busy_window", _duration(allow_zero=True), d.busy_window),
        stall_window=reader.get(tbl, path, "stall_window", _duration(), d.stall_window),
    )


def _restart(reader: _Reader, doc: _Table) -> RestartPolicy:
    path = ("restart",)
    d = RestartPolicy()
    tbl = reader.table(
        path,
        doc.get("restart", {}),
        ("backoff_initial", "backoff_max", "reset_after", "max_failures", "stop_timeout"),
    )
    policy = RestartPolicy(
        backoff_initial=reader.get(
            tbl, path, "backoff_initial", _duration(allow_zero=True), d.backoff_initial
        ),
        backoff_max=reader.get(tbl, path, "backoff_max", _duration(allow_zero=True), d.backoff_max),
        reset_after=reader.get(tbl, path, "reset_after", _duration(), d.reset_after),
        max_failures=reader.get(tbl, path, "max_failures", _int(1), d.max_failures),
        stop_timeout=reader.get(tbl, path, "stop_timeout", _duration(), d.stop_timeout),
    )
    if policy.backoff_max < policy.backoff_initial:
        reader.problems.add(
            (*path, "backoff_max"),
            f"must be >= backoff_initial "
            f"({policy.backoff_initial:g} s), got {policy.backoff_max:g} s",
        )
    return policy


def _metrics(reader: _Reader, doc: _Table) -> MetricsSpec:
    path = ("metrics",)
    d = MetricsSpec()
    tbl = reader.table(
        path,
        doc.get("metrics", {}),
        (
            "listen",
            "gpu_poll_interval",
            "worker_poll_interval",
            "worker_poll_timeout",
            "gpu_source",
        ),
    )
    return MetricsSpec(
        listen=reader.get(tbl, path, "listen", _listen, d.listen),
        gpu_poll_interval=reader.get(
            tbl, path, "gpu_poll_interval", _duration(), d.gpu_poll_interval
        ),
        worker_poll_interval=reader.get(
            tbl, path, "worker_poll_interval", _duration(), d.worker_poll_interval
        ),
        worker_poll_timeout=reader.get(
            tbl, path, "worker_poll_timeout", _duration(), d.worker_poll_timeout
        ),
        gpu_source=reader.get(
            tbl, path, "gpu_source", _choice("nvml", "fake", "none"), d.gpu_source
        ),
    )


def _control(reader: _Reader, doc: _Table) -> ControlSpec:
    path = ("control",)
    d = ControlSpec()
    tbl = reader.table(path, doc.get("control", {}), ("socket", "group"))
    return ControlSpec(
        socket=reader.get(tbl, path, "socket", _socket_path, d.socket),
        group=reader.get(tbl, path, "group", _account("group"), d.group),
    )


def _gateway(reader: _Reader, doc: _Table) -> GatewaySpec:
    path = ("gateway",)
    d = GatewaySpec()
    tbl = reader.table(
        path,
        doc.get("gateway", {}),
        (
            "mode",
            "listen",
            "url",
            "urls",
            "policy",
            "metrics_listen",
            "extra_args",
            "admin_key_file",
            "api_key_file",
            "worker_host",
            "drain_timeout",
            *gateway_routing.KEYS,
        ),
    )
    g = GatewaySpec(
        mode=reader.get(tbl, path, "mode", _choice("off", "managed", "external"), d.mode),
        listen=reader.get(tbl, path, "listen", _listen, d.listen),
        url=reader.get(tbl, path, "url", _http_url, d.url),
        urls=reader.get(tbl, path, "urls", _http_urls, d.urls),
        policy=reader.get(tbl, path, "policy", _choice(*GATEWAY_POLICIES), d.policy),
        metrics_listen=reader.get(tbl, path, "metrics_listen", _listen, d.metrics_listen),
        extra_args=reader.get(tbl, path, "extra_args", _str_list, d.extra_args),
        admin_key_file=reader.get(tbl, path, "admin_key_file", _key_file, d.admin_key_file),
        api_key_file=reader.get(tbl, path, "api_key_file", _key_file, d.api_key_file),
        worker_host=reader.get(tbl, path, "worker_host", _host, d.worker_host),
        drain_timeout=reader.get(
            tbl, path, "drain_timeout", _duration(allow_zero=True), d.drain_timeout
        ),
        routing=_gateway_routing(reader, tbl, path),
    )
    if g.mode == "external" and g.url is None and not g.urls and "urls" not in tbl:
        reader.problems.add(
            (*path, "url"),
            "missing: mode = 'external' needs the gateway's url "
            "(e.g. url = 'http://10.0.0.5:8000'), or urls = [...] for several gateways",
        )
    if g.url is not None and "urls" in tbl:
        reader.problems.add(
            (*path, "urls"),
            "url and urls are both set: keep url for one gateway, or list every gateway "
            "in urls (e.g. urls = ['http://10.0.0.5:8000', 'http://10.0.0.6:8000']) and "
            "remove url",
        )
    if "urls" in tbl and g.mode != "external":
        reader.problems.add(
            (*path, "urls"),
            f"urls is for mode = 'external' (the farm registers with gateways it does not "
            f"run); mode is {g.mode!r}: set mode = 'external' or remove urls",
        )
    if g.mode == "managed" and g.policy in GATEWAY_POLICIES_NEEDING_WORKERS:
        reader.problems.add(
            (*path, "policy"),
            f"smg 1.13 refuses to start {g.policy!r} with fewer than 2 workers, and the "
            "managed gateway starts with none (each worker joins when ready): choose "
            "'least_load' (also picks the less loaded worker) or another policy",
        )
    if g.mode == "managed":
        for arg in g.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in GATEWAY_OWNED_FLAGS:
                reader.problems.add(
                    (*path, "extra_args"),
                    f"{flag} is set by the farm from [gateway] "
                    "(listen, policy, metrics_listen, the key files); remove it",
                )
            elif key := gateway_routing.owned_flag(arg):
                reader.problems.add(
                    (*path, "extra_args"),
                    f"{flag} is set by the farm from [gateway] {key} "
                    f"(default {_toml(getattr(d.routing, key))}); remove it from extra_args "
                    f"and set {key} instead",
                )
        host = g.listen.host
        # The worker API always has a key (admin_key_file, else one the agent generates:
        # gateway/adminkey.py); only users' requests may be open.
        if g.api_key_file is None and not is_loopback(host):
            reader.problems.warn(
                (*path, "listen"),
                f"the gateway listens on {host!r} (not loopback) "
                "without api_key_file: anyone who reaches it can send requests; set "
                "api_key_file to require a key, or listen on 127.0.0.1",
            )
    return g


# ---- [gateway]'s routing opinions (issue 34 §3; gateway/routing.py) ----------------------


def _toml(v: object) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v)


def _number(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _ConversionError(f"expected a number, got {_show(v)}")
    return float(v)


def _whole(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _ConversionError(
            f"expected whole seconds as an integer (smg takes no fractions or units), "
            f"got {_show(v)}"
        )
    return v


def _gateway_routing(reader: _Reader, tbl: _Table, path: tuple[str, ...]) -> GatewayRouting:
    """smg's routing opinions from `[gateway]`: types here, ranges in `gateway.routing`
    (the same checks `smg_argv` makes), each problem on its own key."""
    d = GatewayRouting()
    r = GatewayRouting(
        overload_protection=reader.get(
            tbl, path, "overload_protection", _bool, d.overload_protection
        ),
        overload_waiting_requests=reader.get(
            tbl, path, "overload_waiting_requests", _int(), d.overload_waiting_requests
        ),
        overload_token_usage=reader.get(
            tbl, path, "overload_token_usage", _number, d.overload_token_usage
        ),
        overload_shed=reader.get(tbl, path, "overload_shed", _bool, d.overload_shed),
        stall_secs=reader.get(tbl, path, "stall_secs", _whole, d.stall_secs),
        wedge_secs=reader.get(tbl, path, "wedge_secs", _whole, d.wedge_secs),
        stale_secs=reader.get(tbl, path, "stale_secs", _whole, d.stale_secs),
        warmup_secs=reader.get(tbl, path, "warmup_secs", _whole, d.warmup_secs),
        warmup_blocks=reader.get(tbl, path, "warmup_blocks", _int(), d.warmup_blocks),
        warmup_share=reader.get(tbl, path, "warmup_share", _number, d.warmup_share),
        priority_scheduler=reader.get(tbl, path, "priority_scheduler", _bool, d.priority_scheduler),
        priority_user_share=reader.get(
            tbl, path, "priority_user_share", _number, d.priority_user_share
        ),
    )
    for key, message in gateway_routing.problems(r):
        reader.problems.add((*path, key), message)
    return r


def _model(reader: _Reader, doc: _Table) -> ModelSpec | None:
    if "model" not in doc:
        return None
    path = ("model",)
    tbl = reader.table(
        path,
        doc["model"],
        ("source", "revision", "warm_page_cache", "headroom", "token_file", "cache_dir"),
    )
    if "source" not in tbl:
        if isinstance(doc["model"], dict):
            reader.problems.add(
                (*path, "source"),
                "missing: [model] needs source = '/persistent/dir' "
                "or a Hugging Face repo id ('org/name')",
            )
        return None
    source = reader.get(tbl, path, "source", _model_source, "")
    d = ModelSpec(source)
    m = ModelSpec(
        source=source,
        revision=reader.get(tbl, path, "revision", _revision, d.revision),
        warm_page_cache=reader.get(tbl, path, "warm_page_cache", _bool, d.warm_page_cache),
        headroom=reader.get(tbl, path, "headroom", _size, d.headroom),
        token_file=reader.get(tbl, path, "token_file", _key_file, d.token_file),
        cache_dir=reader.get(tbl, path, "cache_dir", _abs_path, d.cache_dir),
    )
    if not source:
        return None  # its problem is recorded; the other keys were checked all the same
    if m.is_local:
        for key in ("revision", "token_file", "cache_dir"):
            if key in tbl:
                reader.problems.add(
                    (*path, key),
                    f"only for a Hugging Face repo source; {source!r} is a "
                    "local directory: remove it",
                )
    return m


# An HTTP header name (RFC 9110's token).
_HEADER_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _batch_store(v: object) -> str:
    if v == "sqlite" or (
        isinstance(v, str) and re.fullmatch(r"postgres(?:ql)?://\S+", v) is not None
    ):
        return str(v)
    raise _ConversionError(
        f"expected 'sqlite' (the embedded store, <state_dir>/batch.db) or a PostgreSQL URL "
        f"like 'postgresql://batch@db.example/batch' (a queue several hosts share), got {_show(v)}"
    )


def _batch_concurrency(v: object) -> int | None:
    if v == "auto":
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return v
    raise _ConversionError(
        f"expected 'auto' (follow what the farm can serve now) or an integer >= 1 "
        f"(at most that many requests in flight), got {_show(v)}"
    )


def _batch_headers(reader: _Reader, tbl: _Table, path: tuple[str, ...]) -> dict[str, str]:
    raw = tbl.get("headers", {})
    hpath = (*path, "headers")
    if not isinstance(raw, dict):
        reader.problems.add(hpath, f'expected a table of Header-Name = "value", got {_show(raw)}')
        return {}
    out: dict[str, str] = {}
    for name, value in raw.items():
        if not _HEADER_RE.fullmatch(name):
            reader.problems.add(
                (*hpath, name), "expected an HTTP header name (letters, digits, '-')"
            )
        elif name.lower() in ("authorization", "content-length", "content-type", "host"):
            reader.problems.add(
                (*hpath, name),
                "set by the batch service itself (the key comes from gateway_key_file); remove it",
            )
        elif name.lower() == PRIORITY_HEADER:
            reader.problems.add(
                (*hpath, name), "set from [batch] priority; set that instead (or 'none')"
            )
        elif not isinstance(value, str):
            reader.problems.add((*hpath, name), f"expected a string, got {_show(value)}")
        else:
            out[name] = value
    return out


def _batch(reader: _Reader, doc: _Table) -> BatchSpec:
    path = ("batch",)
    d = BatchSpec()
    tbl = reader.table(
        path,
        doc.get("batch", {}),
        (
            "enabled",
            "listen",
            "api_key_file",
            "store",
            "state_dir",
            "concurrency",
            "max_attempts",
            "retry_backoff_s",
            "request_timeout_s",
            "gateway_key_file",
            "priority",
            "headers",
        ),
    )
    b = BatchSpec(
        enabled=reader.get(tbl, path, "enabled", _bool, d.enabled),
        listen=reader.get(tbl, path, "listen", _listen, d.listen),
        api_key_file=reader.get(tbl, path, "api_key_file", _key_file, d.api_key_file),
        store=reader.get(tbl, path, "store", _batch_store, d.store),
        state_dir=reader.get(tbl, path, "state_dir", _abs_path, d.state_dir),
        concurrency=reader.get(tbl, path, "concurrency", _batch_concurrency, d.concurrency),
        max_attempts=reader.get(tbl, path, "max_attempts", _int(1, 1000), d.max_attempts),
        retry_backoff_s=reader.get(
            tbl, path, "retry_backoff_s", _duration(allow_zero=True), d.retry_backoff_s
        ),
        request_timeout_s=reader.get(
            tbl, path, "request_timeout_s", _duration(), d.request_timeout_s
        ),
        gateway_key_file=reader.get(tbl, path, "gateway_key_file", _key_file, d.gateway_key_file),
        priority=reader.get(
            tbl,
            path,
            "priority",
            _choice("bulk", "default", "interactive", "system", "none"),
            d.priority,
        ),
        headers=MappingProxyType(_batch_headers(reader, tbl, path)),
    )
    if b.enabled and b.api_key_file is None:
        reader.problems.add(
            (*path, "api_key_file"),
            "missing: enabled = true needs api_key_file, a file only the batch service reads "
            "holding the key its clients send (Authorization: Bearer <key>)",
        )
    return b
