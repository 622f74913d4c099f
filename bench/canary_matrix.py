"""I/O: `python -m bench canary-matrix`: issue 23's matrix of changes, judged on live traffic.

One farm of simulators in the demo's shape (etc/sglang-farm/demo.toml through
bench/frontfarm.py: 8 workers behind the managed smg, cache-aware routing, drain) with
`[rollout] analysis_window` short (`--window`, default 30 s, the issue's done-when) and
the demo's eval gate (`[rollout] eval` = etc/sglang-farm/eval/arith.jsonl), under
`CLIENTS` concurrent streaming clients through the front door for the whole run
(bench/loadgen.py). Then a matrix of changes, each a `farmctl reload` that waits for
the verdict, each repeated `--repeat` times (the kinds interleaved, so that the
machine's drift spreads over them):

- harmless: an unrelated environment variable; a flag with no effect on the simulator
  (`[sglang] max_running_requests`); a comment-only edit of the config (not a change of
  what the workers run: nothing should restart, and no verdict is due);
- latency: every token 1.5x, 2x, 5x slower (`SGLANG_SIM_TOKEN_SECONDS` against the
  farm's own `TOKEN_S`, the simulator's default);
- errors: 2 % and 10 % of generation requests answered 500 (`SGLANG_SIM_ERROR_RATE`);
- crash: the scheduler dies `crash_after_s` (10) seconds after it fired up
  (`SGLANG_SIM_FAIL_AFTER`);
- wrong answers: 20 % of arithmetic questions answered wrong (`SGLANG_SIM_WRONG_RATE`).

Every change is made from the farm's first config (the base), and a promoted change
that is not harmless (ITL 1.5x) is followed by a reload back to the base, so that each
change is judged against workers on the base config. Every change but the comment
carries a nonce (`SF_BENCH_TRIAL`, an environment
variable of no effect), so that a repeat is a new change: a change its canary rejected
is never rolled again (docs/canary.md).

Per trial: the verdict (`farmctl reload`'s exit status: 0 promoted, 5 rolled back, 6
held; and the agent's `canary_promoted` / `canary_rolled_back` / `canary_held`
event), the time from the reload to the verdict, what failed it (the evidence), the
requests that failed on the client side (non-2xx, error event, broken stream) among
those in flight from the reload until every worker was back in the gateway, and the
workers that ever ran the change: every process of the farm is watched in /proc
(`ProcWatch`), and a worker ran the change when a process with its port carried the
trial's nonce in its environment (the agent's `worker_launching` events give the
relaunched workers, as a cross-check). Simulator figures, not SGLang's.

Prefix-heavy traffic (issue 34 §1): `prompts="same"` (every request the same long system
prompt and question) or `"system"` (9 in 10 requests share a long system prompt), with
the simulator's prefix cache costing `PREFILL_S` per uncached prompt token, so that a
freshly restarted canary's cold cache and the gateway's cache-aware routing show; and
`probes` sets `[rollout] probe_concurrency` (the farm's paired probes; 0: none), the
before and after of the canary judged like with like. Each trial records the machine's
load average at its start and end.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.farmrun import ROOT, event_time
from bench.frontfarm import MODEL, FrontFarm, running, toml_dumps
from bench.loadgen import PROMPTS, Load, LoadSpec, report, window

TOKEN_S = 0.01  # the simulator's default SGLANG_SIM_TOKEN_SECONDS: the "1x" of the matrix
MAX_TOKENS = 8
CLIENTS = 16
EVAL = ROOT / "etc" / "sglang-farm" / "eval" / "arith.jsonl"
NONCE = "SF_BENCH_TRIAL"
# Prefill per uncached prompt token under prefix-heavy traffic: a miss on the ~500-token
# system prompt then costs 0.5 s before the first token, a hit almost nothing (an
# assumption of the bench, stated with its figures; SGLANG_SIM_PREFILL_TOKEN_SECONDS).
PREFILL_S = 0.001
VERDICT_EVENTS = ("canary_promoted", "canary_rolled_back", "canary_held")
EXIT = {0: "promoted", 5: "rolled back", 6: "held"}


@dataclass(frozen=True, slots=True)
class Change:
    """One kind of change: what it adds to `[farm] env` and `[sglang]`; `bad`: the goal
    is a rollback on the canary alone; `comment`: a comment-only edit (no change)."""

    key: str
    label: str
    group: str  # "harmless", "latency", "errors", "crash", "wrong"
    bad: bool
    env: dict[str, str] = field(default_factory=dict)
    sglang: dict[str, Any] = field(default_factory=dict)
    comment: bool = False


def changes(crash_after_s: float = 10.0) -> list[Change]:
    """The matrix (issue 23, "Measure it")."""

    def tok(x: float) -> dict[str, str]:
        return {"SGLANG_SIM_TOKEN_SECONDS": f"{TOKEN_S * x:g}"}

    return [
        Change("harmless-env", "harmless: unrelated env var", "harmless", False,
               env={"SF_BENCH_UNRELATED": "on"}),
        Change("harmless-flag", "harmless: max_running_requests 1024", "harmless", False,
               sglang={"max_running_requests": 1024}),
        Change("harmless-comment", "harmless: comment-only edit", "harmless", False, comment=True),
        Change("itl-1.5x", "ITL 1.5x", "latency", False, env=tok(1.5)),
        Change("itl-2x", "ITL 2x", "latency", True, env=tok(2)),
        Change("itl-5x", "ITL 5x", "latency", True, env=tok(5)),
        Change("errors-2", "errors 2 %", "errors", True, env={"SGLANG_SIM_ERROR_RATE": "0.02"}),
        Change("errors-10", "errors 10 %", "errors", True, env={"SGLANG_SIM_ERROR_RATE": "0.1"}),
        Change(f"crash-{crash_after_s:g}s", f"crash {crash_after_s:g} s into serving", "crash",
               True, env={"SGLANG_SIM_FAIL_AFTER": f"{crash_after_s:g}"}),
        Change("wrong-20", "20 % wrong answers", "wrong", True,
               env={"SGLANG_SIM_WRONG_RATE": "0.2"}),
    ]  # fmt: skip


REDUCED = ("harmless-env", "itl-5x", "crash")


def select(all_changes: Sequence[Change], reduced: bool) -> list[Change]:
    """The full matrix, or `--reduced`'s three: harmless, ITL 5x, crash."""
    if not reduced:
        return list(all_changes)
    return [c for c in all_changes if c.key.startswith(REDUCED)]


# ---- watching every process of the farm --------------------------------------------------


def _port_of(argv: Sequence[str]) -> int | None:
    for i, a in enumerate(argv[:-1]):
        if a == "--port":
            with contextlib.suppress(ValueError):
                return int(argv[i + 1])
    return None


class ProcWatch:
    """Scans /proc on a thread for the farm's processes (the marker in their environment):
    which trial's nonce each worker's process carried. Independent of the agent's word."""

    def __init__(self, marker: str, base_port: int, every_s: float = 0.2) -> None:
        self.needle = f"SGLANG_FARM_TEST_MARKER={marker}".encode()
        self.base_port = base_port
        self.every_s = every_s
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (worker, nonce or "")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="procwatch", daemon=True)

    def __enter__(self) -> ProcWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _scan(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in self.seen:
                continue
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if self.needle not in env:
                continue
            port = _port_of(argv)
            if port is None:
                continue  # a simulator's scheduler child: its parent has the port
            nonce = next(
                (e.decode().partition("=")[2] for e in env if e.startswith(f"{NONCE}=".encode())),
                "",
            )
            with self._lock:
                self.seen[int(entry)] = (port - self.base_port, nonce)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a racing process exit; next scan
                self._scan()
            self._stop.wait(self.every_s)

    def workers_with(self, nonce: str) -> list[int]:
        self._scan()
        with self._lock:
            return sorted({w for w, n in self.seen.values() if n == nonce})


# ---- one trial -----------------------------------------------------------------------------


@dataclass(slots=True)
class Trial:
    change: str
    label: str
    group: str
    bad: bool
    repeat: int
    nonce: str
    verdict: str = ""  # promoted, rolled back, held, no change, or what happened
    exit: int | None = None
    reload_to_verdict_s: float | None = None
    window_to_verdict_s: float | None = None
    caught_by: str = ""  # eval, errors, itl, ttft, liveness (crash ...), or ""
    evidence: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    ran_change: list[int] = field(default_factory=list)  # from /proc
    relaunched: list[int] = field(default_factory=list)  # from worker_launching events
    span_s: float = 0.0
    load_avg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at start, at end
    requests: int = 0
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    farmctl_out: str = ""


def caught_by(evidence: str) -> str:
    """Pure: which check a verdict's one-line evidence names first."""
    e = evidence.lower()
    for key, words in (
        ("eval", ("eval:",)),
        ("liveness", ("crash", "oom", "hang", "wedge", "health", "exited", "failed at start")),
        ("errors", ("error",)),
        ("itl", ("itl",)),
        ("ttft", ("ttft",)),
        ("inconclusive", ("inconclusive",)),
    ):
        if any(w in e for w in words):
            return key
    return ""


def all_ready(ff: FrontFarm, gateway: bool, timeout: float) -> float:
    """Every worker ready (in the gateway, when there is one); the wall-clock time it was."""
    if gateway:
        return ff.wait_all_in(timeout)
    n = len(ff.doc["workers"]["gpus"])
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        p = ff.farm.farmctl("--json", "status", timeout=30)
        with contextlib.suppress(ValueError):
            ws = json.loads(p.stdout).get("workers", [])
            if len(ws) == n and all(w.get("state") == "ready" for w in ws):
                return time.time()
        time.sleep(0.2)
    raise AssertionError(f"not every worker ready after {timeout:g} s")


class Matrix:
    """The farm, its load and its watchers; `trial()` runs one change."""

    def __init__(
        self, ff: FrontFarm, load: Load, procs: ProcWatch, gateway: bool, say: Callable[[str], None]
    ) -> None:
        self.ff = ff
        self.load = load
        self.procs = procs
        self.gateway = gateway
        self.say = say
        self.base = copy.deepcopy(ff.doc)  # the config every change is made from
        self.accepted = copy.deepcopy(ff.doc)  # what the farm runs now (for the comment edit)
        self.n_workers = len(ff.doc["workers"]["gpus"])

    def all_ready(self, timeout: float) -> float:
        return all_ready(self.ff, self.gateway, timeout)

    def doc_for(self, c: Change, nonce: str) -> tuple[dict[str, Any], str]:
        if c.comment:
            return self.accepted, toml_dumps(self.accepted) + f"# bench: a comment ({nonce})\n"
        doc = copy.deepcopy(self.base)
        doc["farm"]["env"] = {**doc["farm"]["env"], **c.env, NONCE: nonce}
        doc["sglang"] = {**doc["sglang"], **c.sglang}
        return doc, toml_dumps(doc)

    def restore(self) -> None:
        """Every worker back on the base config (a promoted latency change would
        otherwise be the next change's baseline): a reload of the base with a fresh
        nonce, judged like any change, waited for."""
        nonce = f"restore-{int(time.time() * 1000) % 10**8}"
        doc = copy.deepcopy(self.base)
        doc["farm"]["env"] = {**doc["farm"]["env"], NONCE: nonce}
        self.say("    restoring the base config on every worker")
        self.ff.rewrite(doc)
        p = self.ff.farm.farmctl("reload", timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"restoring the base config: farmctl reload exit {p.returncode}: "
                               f"{(p.stdout + p.stderr).strip()[-300:]}")  # fmt: skip
        self.accepted = doc
        self.all_ready(240)

    def trial(self, c: Change, repeat: int, window_s: float) -> Trial:
        nonce = f"{c.key}-{repeat}-{int(time.time() * 1000) % 10**8}"
        t = Trial(c.key, c.label, c.group, c.bad, repeat, nonce)
        load0 = os.getloadavg()[0]
        self.all_ready(180)
        time.sleep(1.0)  # the gateway's view settles
        doc, text = self.doc_for(c, nonce)
        tmp = self.ff.config.with_suffix(".tmp")
        tmp.write_text(text)
        n = len(self.ff.farm.snapshot())
        t0 = time.time()
        os.replace(tmp, self.ff.config)
        self.ff.doc = doc
        p = self.ff.farm.farmctl("reload", timeout=window_s + 300)
        t.exit = p.returncode
        t.farmctl_out = (p.stdout + p.stderr).strip()[-600:]
        t_end = self.all_ready(240)
        time.sleep(0.5)
        evs = self.ff.farm.snapshot()[n:]
        verdict = next((e for e in evs if e.get("event") in VERDICT_EVENTS), None)
        started = next((e for e in evs if e.get("event") == "canary_analysis_started"), None)
        t.relaunched = sorted(
            {int(e["worker"]) for e in evs if e.get("event") == "worker_launching"}
        )
        if verdict is not None:
            t.verdict = str(verdict["event"]).removeprefix("canary_").replace("_", " ")
            t.evidence = str(verdict.get("evidence", ""))
            t.reload_to_verdict_s = event_time(verdict) - t0
            if started is not None:
                t.window_to_verdict_s = event_time(verdict) - event_time(started)
        elif p.returncode == 0 and not t.relaunched:
            t.verdict = "no change"
        else:
            t.verdict = f"exit {p.returncode}, no verdict"
        t.caught_by = caught_by(t.evidence) if t.verdict == "rolled back" else ""
        st = self.ff.farm.farmctl("--json", "status", timeout=30)
        with contextlib.suppress(ValueError, AttributeError):
            canary = json.loads(st.stdout).get("canary") or {}
            if verdict is not None:
                t.checks = list(canary.get("checks", []))
        if t.verdict == "promoted" or (c.comment and p.returncode == 0):
            self.accepted = doc
        if t.verdict == "promoted" and c.group != "harmless":
            self.restore()
        t.ran_change = [] if c.comment else self.procs.workers_with(nonce)
        outs = window(self.load.snapshot(), t0, t_end)
        r = report(outs, t_end - t0)
        t.span_s, t.requests = t_end - t0, r["requests"]
        t.failed, t.reasons = r["failed"], r["reasons"]
        t.load_avg = (load0, os.getloadavg()[0])
        return t


# ---- the run -------------------------------------------------------------------------------


def has_smg() -> bool:
    return importlib.util.find_spec("smg") is not None


def adjust(
    workers: int,
    window: str,
    gateway: bool,
    eval_gate: bool,
    min_requests: int | None = None,
    probes: int = 0,
    prefill_s: float = 0.0,
) -> Callable[[dict[str, Any]], None]:
    """The demo's config with the matrix's changes: `workers` of them, the window, the
    eval gate, `[rollout] min_requests` when given (else the default, 50), no gateway;
    `[rollout] probe_concurrency = probes`; the simulators' prefill cost per uncached
    prompt token (`[farm] env`, SGLANG_SIM_PREFILL_TOKEN_SECONDS) when above 0."""

    def go(doc: dict[str, Any]) -> None:
        doc["rollout"] = {**doc.get("rollout", {}), "probe_concurrency": probes}
        if prefill_s > 0:
            farm_env = doc["farm"].get("env", {})
            doc["farm"]["env"] = {**farm_env, "SGLANG_SIM_PREFILL_TOKEN_SECONDS": f"{prefill_s:g}"}
        doc["workers"]["gpus"] = list(range(workers))
        doc["startup"]["parallel"] = max(1, min(int(doc["startup"]["parallel"]), workers // 2))
        doc["rollout"] = {**doc.get("rollout", {}), "analysis_window": window}
        if min_requests is not None:
            doc["rollout"]["min_requests"] = min_requests
        if eval_gate:
            doc["rollout"]["eval"] = str(EVAL)
        if not gateway:
            doc["gateway"] = {"mode": "off"}

    return go


@contextlib.contextmanager
def _loads(ff: FrontFarm, gateway: bool, max_s: float, prompts: str) -> Iterator[Load]:
    url = ff.gateway_url if gateway else ff.worker_url(0)
    spec = LoadSpec(
        url, MODEL, clients=CLIENTS, max_tokens=MAX_TOKENS, max_s=max_s,
        max_requests=10**8, all_streaming=True, prompts=prompts,
    )  # fmt: skip
    with Load(spec) as load:
        yield load


def run(
    say: Callable[[str], None],
    *,
    reduced: bool = False,
    repeat: int = 3,
    window: str = "30s",
    workers: int = 8,
    crash_after_s: float = 10.0,
    eval_gate: bool = True,
    min_requests: int | None = None,
    only: Sequence[str] = (),
    prompts: str = "distinct",
    probes: int = 0,
) -> dict[str, Any]:
    """The matrix on one farm; every trial recorded, a failed one with its error.
    `prompts`: the load's prompt mode (loadgen.PROMPTS; prefix-heavy ones turn on the
    simulators' prefill cost); `probes`: `[rollout] probe_concurrency`."""
    if prompts not in PROMPTS:
        raise ValueError(f"prompts {prompts!r}: one of {', '.join(PROMPTS)}")
    prefill_s = PREFILL_S if prompts != "distinct" else 0.0
    window_s = float(window.rstrip("s"))
    gateway = has_smg()
    kinds = select(changes(crash_after_s), reduced)
    if only:
        kinds = [c for c in kinds if c.key in only]
    out: dict[str, Any] = {
        "config": {
            "workers": workers,
            "window": window,
            "repeat": repeat,
            "reduced": reduced,
            "clients": CLIENTS,
            "all_streaming": True,
            "max_tokens": MAX_TOKENS,
            "token_s": TOKEN_S,
            "eval": str(EVAL) if eval_gate else None,
            "min_requests": min_requests or 50,
            "prompts": prompts,
            "probe_concurrency": probes,
            "prefill_token_s": prefill_s,
            "load_avg_start": os.getloadavg(),
            "gateway": "smg (managed)" if gateway else "none: smg is not installed",
            "changes": [asdict(c) for c in kinds],
        },
        "trials": [],
    }
    if not gateway:
        say("smg is not installed: a process farm WITHOUT a gateway; the load goes to worker 0")
    say(f"canary matrix: {workers} workers, window {window}, {len(kinds)} changes x {repeat}")
    t_start = time.monotonic()
    setup = adjust(workers, window, gateway, eval_gate, min_requests, probes, prefill_s)
    with running(TOKEN_S, setup) as ff:
        ff.farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=180)
        all_ready(ff, gateway, 120)
        out["config"]["parallel"] = int(ff.doc["startup"]["parallel"])
        out["config"]["policy"] = ff.doc.get("gateway", {}).get("policy")
        est = len(kinds) * repeat * (window_s + 120) + 600
        with (
            ProcWatch(ff.farm.marker, ff.ports.workers) as procs,
            _loads(ff, gateway, est, prompts) as load,
        ):
            time.sleep(2.0)
            m = Matrix(ff, load, procs, gateway, say)
            for r in range(repeat):
                for c in kinds:
                    say(f"  [{r + 1}/{repeat}] {c.label}")
                    try:
                        t = m.trial(c, r, window_s)
                    except Exception as exc:  # one trial's failure must not lose the others
                        say(f"    FAILED: {exc!r}")
                        out["trials"].append(
                            {"change": c.key, "label": c.label, "group": c.group,
                             "bad": c.bad, "repeat": r, "error": repr(exc)}
                        )  # fmt: skip
                        with contextlib.suppress(Exception):
                            m.all_ready(180)
                        continue
                    say(
                        f"    {t.verdict} in {t.reload_to_verdict_s or 0:.1f} s"
                        f" ({t.caught_by or '-'}); failed {t.failed}/{t.requests};"
                        f" ran it: {t.ran_change}; {t.evidence[:140]}"
                    )
                    out["trials"].append(asdict(t))
            if load.error is not None:
                out["load_error"] = repr(load.error)
            out["load"] = report(load.snapshot())
            out["load"].pop("failure_times", None)
    out["duration_s"] = time.monotonic() - t_start
    out["config"]["load_avg_end"] = os.getloadavg()
    out["summary"] = summarize(out["trials"], kinds)
    out["goals"] = goals(out["trials"])
    return out


# ---- the figures ------------------------------------------------------------------------------


def _fmt_s(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return f"{lo:.1f}" if abs(hi - lo) < 0.05 else f"{lo:.1f}-{hi:.1f}"


def _ratio(t: dict[str, Any], name: str) -> float | None:
    for c in t.get("checks", []):
        if c.get("name") == name and c.get("ratio") is not None:
            return float(c["ratio"])
    return None


def summarize(trials: Sequence[dict[str, Any]], kinds: Sequence[Change]) -> list[dict[str, Any]]:
    """Pure: one row per kind of change, over its repeats."""
    rows = []
    for c in kinds:
        ts = [t for t in trials if t.get("change") == c.key]
        ok = [t for t in ts if "error" not in t]
        verdicts: dict[str, int] = {}
        for t in ok:
            verdicts[t["verdict"]] = verdicts.get(t["verdict"], 0) + 1
        ran = [len(t["ran_change"]) for t in ok if not c.comment]
        rows.append(
            {
                "change": c.key,
                "label": c.label,
                "bad": c.bad,
                "trials": len(ts),
                "errors": len(ts) - len(ok),
                "verdicts": verdicts,
                "caught_by": sorted({t["caught_by"] for t in ok if t["caught_by"]}),
                "reload_to_verdict_s": [
                    t["reload_to_verdict_s"] for t in ok if t["reload_to_verdict_s"] is not None
                ],
                "window_to_verdict_s": [
                    t["window_to_verdict_s"] for t in ok if t["window_to_verdict_s"] is not None
                ],
                "failed": sum(t["failed"] for t in ok),
                "requests": sum(t["requests"] for t in ok),
                "ran_change": [t["ran_change"] for t in ok],
                "ran_change_max": max(ran) if ran else None,
                "itl_p50_ratio": [r for t in ok if (r := _ratio(t, "itl_p50")) is not None],
                "error_ratio": [
                    (c2.get("canary"), c2.get("baseline"))
                    for t in ok
                    for c2 in t.get("checks", [])
                    if c2.get("name") == "errors"
                ],
            }
        )
    return rows


def goals(trials: Sequence[dict[str, Any]]) -> list[str]:
    """Pure: the issue's goals each trial missed, one plain line each ([] = all met)."""
    missed = []
    for t in trials:
        name = f"{t.get('label')} (repeat {t.get('repeat', 0) + 1})"
        if "error" in t:
            missed.append(f"{name}: the trial itself failed: {t['error']}")
            continue
        if t["bad"]:
            if t["verdict"] != "rolled back":
                missed.append(f"{name}: {t['verdict']}, not rolled back ({t['evidence']})")
            elif t["ran_change"] != [0]:
                missed.append(
                    f"{name}: workers {t['ran_change']} ran the change, not the canary alone"
                )
        elif t["group"] == "harmless" and t["verdict"] == "rolled back":
            missed.append(f"{name}: a harmless change rolled back ({t['evidence']})")
        if t["group"] in ("harmless", "latency") and t["failed"]:
            missed.append(
                f"{name}: {t['failed']} of {t['requests']} requests failed {t['reasons']}"
            )
    return missed


def table(res: dict[str, Any]) -> str:
    """Pure: the markdown table of `run`'s result, and the goals missed."""
    n_w = res["config"]["workers"]
    lines = [
        "| change | verdicts | caught by | reload → verdict (s) | window → verdict (s) "
        "| failed / requests in flight | workers that ran it | canary ÷ baseline ITL p50 |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in res["summary"]:
        v = ", ".join(f"{k} {n}" for k, n in sorted(r["verdicts"].items()))
        if r["errors"]:
            v += f", trial failed {r['errors']}"
        if r["change"] == "harmless-comment":
            ran = "none restarted"
        else:
            ran = "; ".join(
                "canary only" if x == [0] else (f"all {n_w}" if len(x) == n_w else str(x))
                for x in r["ran_change"]
            )
        itl = ", ".join(f"{x:.2f}" for x in r["itl_p50_ratio"]) or "-"
        lines.append(
            f"| {r['label']} | {v} | {', '.join(r['caught_by']) or '-'} "
            f"| {_fmt_s(r['reload_to_verdict_s'])} | {_fmt_s(r['window_to_verdict_s'])} "
            f"| {r['failed']} / {r['requests']:,} | {ran} | {itl} |"
        )
    missed = res.get("goals", [])
    lines.append("")
    lines.append("Goals missed: none." if not missed else "Goals missed:")
    lines += [f"- {m}" for m in missed]
    return "\n".join(lines)
