"""Pure: the results table (rows with their targets) from a benchmark run's results dict."""

# ruff: noqa: E501, RUF001 - long row labels, and the typographic signs the docs table prints

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Row:
    bench: str
    figure: str
    measured: str
    target: str = ""
    met: bool | None = None  # None: no target

    @property
    def verdict(self) -> str:
        return "" if self.met is None else ("yes" if self.met else "**NO**")


def _ms(d: dict[str, Any]) -> str:
    return f"p50 {d['median']:.2f} / p99 {d['p99']:.2f} ms (min–max {d['min']:.2f}–{d['max']:.2f}, n={d['n']})"


def _s(d: dict[str, Any]) -> str:
    return f"median {d['median']:.3f} / p99 {d['p99']:.3f} s (min–max {d['min']:.3f}–{d['max']:.3f}, n={d['n']})"


def _format_rows(n: str, fc: dict[str, Any]) -> list[Row]:
    """The first scrape after a swap, in process: the library's encoder (the old path)
    against the farm's writer after each kind of swap."""
    if "format_ms" in fc:  # a run before the farm's writer: generate_latest alone
        return [
            Row(
                "1 scrape",
                f"in-process generate_latest, hand-built state of {n} workers ({fc['body_bytes']} B)",
                _ms(fc["format_ms"]),
            )
        ]
    out = []
    for fmt, label in (("text", "text format"), ("prometheus", "Prometheus' Accept (OpenMetrics)")):
        row = fc[fmt]
        lib = row["library_ms"]["median"]
        out.append(
            Row(
                "1 scrape",
                f"body after a swap, {n} workers ({fc['body_bytes']} B), {label}: prometheus_client over the whole registry (OLD)",
                _ms(row["library_ms"]),
            )
        )
        for kind in ("worker poll", "gpu poll", "view change"):
            d = row[f"{kind}_ms"]
            out.append(
                Row(
                    "1 scrape",
                    f"body after a {kind}, {n} workers, {label}: the farm's writer (NEW; {lib / d['median']:.1f}× less at p50)",
                    _ms(d),
                )
            )
    return out


def rows(r: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    sim = r.get("sim_load")
    if sim:
        out.append(
            Row(
                "sim",
                "simulator alone: spawn → /health 200",
                _s(sim["single"]["spawn_to_health_s"]),
            )
        )
        out.append(
            Row(
                "sim",
                "4 simulators at once → all healthy",
                _s(sim["wave4"]["spawn_to_all_healthy_s"]),
            )
        )
        out.append(
            Row(
                "sim",
                "3 simulators at once → all healthy",
                _s(sim["wave3"]["spawn_to_all_healthy_s"]),
            )
        )
    for n, fc in r.get("format", {}).items():
        out.extend(_format_rows(n, fc))
    base = r.get("baseline_commit", "")
    for key, label in (
        ("farm8", "8 workers"),
        ("farm64_old", f"64 workers, OLD ({base})"),
        ("farm64", "64 workers" + (", NEW" if base else "")),
    ):
        f = r.get(key)
        if not f:
            continue
        if "error" in f:
            out.append(Row(key, "benchmark failed", f["error"]))
            continue
        if "rollout_s" in f:
            out.append(
                Row(
                    "4 start-up",
                    f"{label}: first launch → rollout done (parallel 16)",
                    f"{f['rollout_s']:.1f} s",
                )
            )
        sa = f.get("sims_alone")
        if sa:
            out.append(
                Row(
                    "4 start-up",
                    f"{label}: the simulators alone, same plan (no agent; canary then 16 at a time)",
                    f"{sa['total_s']:.1f} s (canary {sa['canary_s']:.2f} s)",
                )
            )
            after = f.get("sims_alone_after")
            if after:
                out.append(
                    Row(
                        "4 start-up",
                        f"{label}:   … the simulators alone again, after the farm",
                        f"{after['total_s']:.1f} s (canary {after['canary_s']:.2f} s)",
                    )
                )
            share = f["agent_share_s"]
            out.append(
                Row(
                    "4 start-up",
                    f"{label}: agent's own share = rollout − simulators alone (mean of the two)",
                    f"{share:.2f} s",
                    "≤ 1 s",
                    share <= 1,
                )
            )
            if "agent_cpu_to_rollout_s" in f:
                ln = f["launch_s"]
                out.append(
                    Row(
                        "4 start-up",
                        f"{label}: agent CPU from its start to rollout done; its fork+exec per launch",
                        f"{f['agent_cpu_to_rollout_s']:.2f} s CPU; launch median "
                        f"{ln['each']['median'] * 1000:.0f} ms, sum {ln['sum']:.2f} s",
                    )
                )
        ph = f.get("poll_health")
        if ph:
            out.append(
                Row(
                    "5 footprint",
                    f"worker-stats polls, {label}, idle",
                    f"{ph['workers_up']} up, {ph['workers_down']} down, {ph['workers_stale']} stale",
                )
            )
        sc = f.get("scrape")
        if sc:
            lat = sc["healthy"]["latency_ms"]
            tgt = "p99 ≤ 5 ms" if key == "farm8" else ""
            met = lat["p99"] <= 5 if key == "farm8" else None
            out.append(
                Row(
                    "1 scrape",
                    f"/metrics, {label}, healthy ({sc['healthy']['body_bytes']} B)",
                    _ms(lat),
                    tgt,
                    met,
                )
            )
            hung = sc.get("hung")
            if hung:
                out.append(
                    Row(
                        "1 scrape",
                        f"/metrics, {label}, one worker SIGSTOPped",
                        _ms(hung["latency_ms"]),
                    )
                )
                rt = sc["ratio_hung_to_healthy_p99"]
                out.append(
                    Row(
                        "1 scrape",
                        f"hung ÷ healthy, {label} (p99; median {sc['ratio_hung_to_healthy_median']:.2f}×)",
                        f"{rt:.2f}×",
                        "≤ 1.2×",
                        rt <= 1.2,
                    )
                )
        sp = f.get("scrape_prometheus")
        if sp:
            out.append(
                Row(
                    "1 scrape",
                    f"/metrics, {label}, healthy, with Prometheus' Accept (OpenMetrics; {sp['body_bytes']} B)",
                    _ms(sp["latency_ms"]),
                )
            )
        ctl = f.get("control")
        if ctl:
            lat = ctl["status"]["latency_ms"]
            out.append(
                Row(
                    "2 control",
                    f"`status` socket round trip, {label}",
                    _ms(lat),
                    "p99 ≤ 5 ms",
                    lat["p99"] <= 5,
                )
            )
            fl = ctl.get("status_floor")
            if fl:
                out.append(
                    Row(
                        "2 control",
                        f"floor: do-nothing asyncio server sending the same reply ({fl['reply_bytes']} B), interleaved",
                        _ms(fl["floor_ms"])
                        + f"; agent in the same loop p99 {fl['agent_ms']['p99']:.2f} ms",
                    )
                )
                out.append(
                    Row(
                        "2 control",
                        f"`status` ÷ floor, {label} (p99; median {fl['ratio_median']:.2f}×)",
                        f"{fl['ratio_p99']:.2f}×",
                    )
                )
            if "status_hung" in ctl:
                out.append(
                    Row(
                        "2 control",
                        f"`status` round trip, {label}, one worker hung",
                        _ms(ctl["status_hung"]["latency_ms"]),
                    )
                )
            fc = ctl.get("farmctl")
            if fc:
                out.append(
                    Row(
                        "2 control",
                        "`farmctl status` process (byte-code cached)",
                        _ms(fc["farmctl"]),
                    )
                )
                out.append(
                    Row(
                        "2 control", "`python -c pass` (same interpreter)", _ms(fc["python_c_pass"])
                    )
                )
                rt = fc["ratio_farmctl_to_python"]
                out.append(
                    Row(
                        "2 control",
                        f"farmctl ÷ python -c pass (medians, n={fc['farmctl']['n']})",
                        f"{rt:.2f}×",
                        "≤ 3×",
                        rt <= 3,
                    )
                )
                if "ratio_farmctl_old_to_python" in fc:
                    out.append(
                        Row(
                            "2 control",
                            f"`farmctl status` OLD ({base}), same loop",
                            _ms(fc["farmctl_old"])
                            + f"; ÷ python -c pass {fc['ratio_farmctl_old_to_python']:.2f}×",
                        )
                    )
                if "python_c_import_click" in fc:
                    out.append(
                        Row(
                            "2 control",
                            "floor: `python -c 'import click'` ÷ python -c pass",
                            f"{fc['ratio_import_click_to_python']:.2f}× "
                            f"({fc['python_c_import_click']['median']:.1f} vs "
                            f"{fc['python_c_pass']['median']:.1f} ms)",
                        )
                    )
                    out.append(
                        Row(
                            "2 control",
                            "floor: `python -I -c 'import click'` ÷ `python -I -c pass`",
                            f"{fc['ratio_I_import_click_to_I_pass']:.2f}× "
                            f"({fc['python_I_c_import_click']['median']:.1f} vs "
                            f"{fc['python_I_c_pass']['median']:.1f} ms)",
                        )
                    )
                    fl = fc["python_c_import_click"]["median"]
                    out.append(
                        Row(
                            "2 control",
                            "farmctl beyond the click floor (medians)",
                            f"{fc['farmctl']['median'] - fl:.1f} ms",
                        )
                    )
            fn = ctl.get("farmctl_no_bytecode")
            if fn:
                out.append(
                    Row(
                        "2 control",
                        "farmctl ÷ python -c pass, no byte-code cache",
                        f"{fn['ratio_farmctl_to_python']:.2f}× ({fn['farmctl']['median']:.0f} vs {fn['python_c_pass']['median']:.0f} ms)",
                    )
                )
            for ik, il in (("importtime_old", f" OLD ({base})"), ("importtime", "")):
                it = ctl.get(ik)
                if it:
                    top = ", ".join(f"{t['package']} {t['ms']:.1f}" for t in it["top"][:5])
                    out.append(
                        Row(
                            "2 control",
                            f"farmctl imports{il} (ms, cumulative)",
                            f"total {it['total_import_ms']:.1f}: {top}",
                        )
                    )
        st = f.get("startup")
        if st:
            o = st["overhead_s"]
            tgt, met = ("≤ 1 s", o <= 1) if key == "farm8" else ("", None)
            out.append(
                Row(
                    "4 start-up",
                    f"ready − (canary + waves' own load), {label}, poll {st['poll_interval_s']:g} s",
                    f"{o:.2f} s (ready {st['first_launch_to_done_s']:.2f} s, own loads {st['own_load_s']:.2f} s)",
                    tgt,
                    met,
                )
            )
            out.append(
                Row(
                    "4 start-up",
                    f"agent start → first launch, {label}",
                    f"{st['agent_start_to_first_launch_s']:.2f} s",
                )
            )
        fp = f.get("footprint")
        if fp:
            cpu = fp["cpu_pct_of_one_core"]
            lim = 1.0 if key == "farm8" else 5.0
            out.append(
                Row(
                    "5 footprint",
                    f"idle CPU, {label}, {fp['window_s']:.0f} s, default intervals",
                    f"{cpu:.2f} % of one core",
                    f"≤ {lim:g} %",
                    cpu <= lim,
                )
            )
            rss = fp["rss_mib"]["max"]
            out.append(
                Row(
                    "5 footprint",
                    f"agent RSS, {label} (max over the window)",
                    f"{rss:.1f} MiB ({fp['threads']} threads)",
                    "≤ 60 MiB",
                    rss <= 60,
                )
            )
    re_ = r.get("reaction")
    if re_ and "error" in re_:
        out.append(Row("3 reaction", "benchmark failed", re_["error"]))
    elif re_:
        c = re_.get("crash")
        if c:
            out.append(
                Row(
                    "3 reaction",
                    "crash (SIGKILL) → agent recorded it",
                    _s(c["kill_to_recorded_s"]),
                    "≤ 1 s",
                    c["kill_to_recorded_s"]["max"] <= 1,
                )
            )
            out.append(
                Row(
                    "3 reaction",
                    f"crash → ready again − sim load ({c['sim_load_s']:.2f} s)",
                    _s(c["ready_minus_sim_load_s"]),
                )
            )
            out.append(
                Row(
                    "3 reaction",
                    f"  … and − back-off ({c['backoff_initial_s']:g} s)",
                    _s(c["ready_minus_sim_load_minus_backoff_s"]),
                )
            )
        h = re_.get("hang")
        if h:
            out.append(
                Row(
                    "3 reaction",
                    f"hang (SIGSTOP) → restart issued; threshold × period = {h['threshold_x_period_s']:g} s",
                    _s(h["stop_to_restart_issued_s"]),
                    f"≤ {h['target_s']:g} s",
                    h["stop_to_restart_issued_s"]["max"] <= h["target_s"],
                )
            )
        st = re_.get("startup")
        if st:
            out.append(
                Row(
                    "4 start-up",
                    f"ready − (canary + waves' own load), 8 workers, poll {st['poll_interval_s']:g} s",
                    f"{st['overhead_s']:.2f} s (ready {st['first_launch_to_done_s']:.2f} s, own loads {st['own_load_s']:.2f} s)",
                )
            )
    out += _systemd_rows(r.get("reaction_systemd"))
    out += _frontdoor_rows(r.get("frontdoor"))
    return out


def _systemd_rows(sd: dict[str, Any] | None) -> list[Row]:
    """Reaction times under systemd (bench/sdreaction.py), or why they were not measured."""
    if not sd:
        return []
    if "error" in sd:
        return [Row("3 reaction", "under systemd: benchmark failed", sd["error"])]
    if "not_measured" in sd:
        return [Row("3 reaction", "under systemd", f"not measured: {sd['not_measured']}")]
    out: list[Row] = []
    n = sd["workers"]
    out.append(
        Row(
            "3 reaction",
            f"systemd ({n} `sglang@N` units in the container): simulator alone, spawn → /health 200",
            _s(sd["sim_load"]["spawn_to_health_s"]),
        )
    )
    c = sd.get("crash")
    if c:
        out.append(
            Row(
                "3 reaction",
                "systemd: crash (SIGKILL of MainPID) → agent recorded it",
                _s(c["kill_to_recorded_s"]),
                "≤ 1 s",
                c["kill_to_recorded_s"]["max"] <= 1,
            )
        )
        out.append(
            Row(
                "3 reaction",
                "systemd:   … of which kill → systemd's “Main process exited” record",
                _s(c["kill_to_systemd_exit_record_s"]),
            )
        )
        out.append(
            Row(
                "3 reaction",
                f"systemd: crash → ready again − sim load ({c['sim_load_s']:.2f} s)",
                _s(c["ready_minus_sim_load_s"]),
            )
        )
        out.append(
            Row(
                "3 reaction",
                f"systemd:   … and − back-off ({c['backoff_initial_s']:g} s)",
                _s(c["ready_minus_sim_load_minus_backoff_s"]),
            )
        )
        out.append(
            Row(
                "3 reaction",
                "systemd:   … of which relaunch → ready − sim load (unit start, readiness gate)",
                _s(c["launch_to_ready_minus_sim_load_s"]),
            )
        )
    h = sd.get("hang")
    if h:
        out.append(
            Row(
                "3 reaction",
                f"systemd: hang (SIGSTOP of the unit's cgroup) → restart issued; threshold × period = {h['threshold_x_period_s']:g} s",
                _s(h["stop_to_restart_issued_s"]),
                f"≤ {h['target_s']:g} s",
                h["stop_to_restart_issued_s"]["max"] <= h["target_s"],
            )
        )
    return out


def _failed(d: dict[str, Any]) -> str:
    why = "; ".join(f"{k}: {v}" for k, v in d["reasons"].items())
    retried = (
        f"; smg retried {d['gateway_retries']} on another worker" if "gateway_retries" in d else ""
    )
    return f"{d['failed']} of {d['requests']}" + (f" ({why})" if why else "") + retried


def _frontdoor_rows(fd: dict[str, Any] | None) -> list[Row]:
    """The front door under load (bench/frontdoor.py): failed requests, crash routing, latency."""
    if not fd:
        return []
    if "error" in fd:
        return [Row("6 front door", "benchmark failed", fd["error"])]
    out: list[Row] = []
    need = fd["config"]["min_requests"]
    for key, label, target in (
        ("restart_drain", "`farmctl restart all`, drain on", True),
        ("restart_no_drain", "`farmctl restart all --no-drain`", False),
        ("reload", "`farmctl reload` of a flag change for every worker (drain on)", True),
    ):
        d = fd.get(key)
        if not d:
            continue
        if "error" in d:
            out.append(Row("6 front door", f"{label}: failed", d["error"]))
            continue
        enough = d["requests"] >= need
        out.append(
            Row(
                "6 front door",
                f"{label}: failed requests ({d['rounds']} round(s), {sum(d['round_s']):.0f} s)",
                _failed(d),
                f"0 of ≥ {need}" if target else "",
                (d["failed"] == 0 and enough) if target else None,
            )
        )
        out.append(
            Row(
                "6 front door",
                f"{label}: fewest workers ready in the gateway / latency",
                f"{d['min_ready_in_gateway']} of {d['workers']} (parallel {d['parallel']}); "
                + _ms(d["latency_ms"]),
                f"≥ {d['workers'] - d['parallel']}",
                d["min_ready_in_gateway"] is not None
                and d["min_ready_in_gateway"] >= d["workers"] - d["parallel"],
            )
        )
    k = fd.get("kill")
    if k and "error" in k:
        out.append(Row("6 front door", "kill -9 of a worker: failed", k["error"]))
    elif k:
        n = len(k["kills"])
        out.append(
            Row(
                "6 front door",
                f"kill -9 of a worker's main process ({n}×): failed requests",
                _failed(k),
            )
        )
        out.append(
            Row(
                "6 front door",
                "  kill → farm recorded the crash (`worker_exited`)",
                _s(k["kill_to_recorded_s"]),
            )
        )
        out.append(
            Row(
                "6 front door",
                "  crash recorded → gateway no longer lists it ready (GET /workers)",
                _s(k["recorded_to_not_ready_in_gateway_s"]),
                "≤ 1 s",
                k["recorded_to_not_ready_in_gateway_s"].get("max", 99) <= 1,
            )
        )
        lr = k["recorded_to_last_routed_s"]
        out.append(
            Row(
                "6 front door",
                "  crash recorded → last request smg routed to it (`smg_worker_requests_total`)",
                _s(lr) if lr.get("n") else "none routed after the kill",
                "≤ 1 s",
                lr.get("max", -1) <= 1,
            )
        )
    lat = fd.get("latency")
    if lat and "error" in lat:
        out.append(Row("6 front door", "gateway latency: failed", lat["error"]))
    elif lat:
        for key, label in (
            ("gateway", "light load (2 clients), through the gateway"),
            ("direct", "light load, straight to worker 0"),
            ("direct_nodelay", "light load, straight to a simulator with Nagle off"),
        ):
            out.append(Row("6 front door", label, _ms(lat[key]["latency_ms"])))
        for key, label in (("direct", "worker 0"), ("direct_nodelay", "Nagle-off simulator")):
            out.append(
                Row(
                    "6 front door",
                    f"gateway ÷ direct to {label} (p50; p99 {lat[f'ratio_p99_{key}']:.2f}×)",
                    f"{lat[f'ratio_p50_{key}']:.2f}×",
                )
            )
    return out


def markdown(rs: list[Row]) -> str:
    lines = ["| # | figure | measured | target | met |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.bench} | {r.figure} | {r.measured} | {r.target} | {r.verdict} |" for r in rs]
    return "\n".join(lines)
