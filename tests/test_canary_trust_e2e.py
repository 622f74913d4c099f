"""The canary's verdict against another local user and behind external gateways, end to
end (issue 30 #1, #2): the agent, simulator workers, real smg gateways, users' load.

- `nobody` (setpriv) sends streams straight to a worker's port on 127.0.0.1 and hangs up
  after the first event, over and over (a client that hangs up is an abort in SGLang):
  on the canary's port while a harmless change is judged, it must not be rolled back;
  on the baseline workers' ports (and then on the canary's) while a change answering
  10 % of requests 500 (`SGLANG_SIM_ERROR_RATE=0.1`) is judged, it must not be promoted.
  Before issue 30 the aborts were the canary's "errors" (the harmless change was rolled
  back) and the baseline's (the bad one was promoted).
- Behind two external smg (`[gateway] mode = "external"`, `urls`), a change answering
  20 % of requests 500 must be rolled back or held, never promoted (it was promoted with
  "canary errors 0.0 %": nothing counted a 500); and with workers that count no HTTP
  responses (SGLang before 0.5.20, `SGLANG_SIM_NO_HTTP_METRICS`) the change is held,
  the verdict saying that its errors were not judged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import signal
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import asuser
from farmproc import Farm, farm_config, free_port_block, marked_pids, new_marker
from farmtoml import rewritten
from smgproc import Smg, key_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]

MODEL = "sim/Qwen3.6-27B"
WORKERS = 4
CLIENTS = 8
VERDICTS = ("canary_rolled_back", "canary_promoted", "canary_held")

# The attacker, as nobody, with the standard library only: streams to the given ports,
# each dropped after its first event; prints how many it dropped when told to stop.
ABORTER = r"""
import http.client, json, signal, sys, threading, time
ports = [int(p) for p in sys.argv[1].split(",")]
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
body = json.dumps({"model": sys.argv[2], "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 400, "stream": True})
dropped = [0]
lock = threading.Lock()
def run(port):
    while not stop.is_set():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status == 200 and r.readline():
                with lock:
                    dropped[0] += 1
            else:
                time.sleep(0.05)
            c.close()
        except OSError:
            time.sleep(0.05)
threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in ports for _ in range(3)]
for t in threads:
    t.start()
while not stop.is_set():
    time.sleep(0.1)
print(dropped[0], flush=True)
"""


@contextlib.contextmanager
def aborting(ports: list[int]) -> Iterator[list[int]]:
    """nobody dropping streams on `ports` for the block; yields a list that holds, after
    it, the number of streams dropped."""
    proc = asuser.popen_as_nobody(
        [sys.executable, "-I", "-c", ABORTER, ",".join(map(str, ports)), MODEL]
    )
    dropped: list[int] = []
    try:
        yield dropped
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        dropped.append(int(out.split()[-1]))


@contextlib.contextmanager
def load(urls: list[str]) -> Iterator[list[str]]:
    """CLIENTS clients per gateway sending chat completions without pause, each its own
    prompts (so a cache-aware gateway spreads them); yields the statuses that were not 200."""
    stop = threading.Event()
    failures: list[str] = []
    counter = itertools.count()

    def client(url: str) -> None:
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
            while not stop.is_set():
                n = next(counter)
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"{n * 7919 % 100_003} count"}],
                    "max_tokens": 8,
                }
                try:
                    r = c.post("/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        failures.append(f"{r.status_code}")
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                    time.sleep(0.05)

    threads = [
        threading.Thread(target=client, args=(u,), daemon=True)
        for u in urls
        for _ in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    try:
        yield failures
    finally:
        stop.set()
        for t in threads:
            t.join(40)


def worker_ports(config: Path) -> list[int]:
    base = int(tomllib.loads(config.read_text())["workers"]["base_port"])
    return [base + i for i in range(WORKERS)]


def reload_with(farm: Farm, good: str, env: dict[str, str]) -> tuple[int, str, list[int]]:
    """Reload `good` with `env` added to [farm] env; farmctl's exit status and output, and
    the workers launched meanwhile, once the verdict's event is in."""
    n = len(farm.snapshot())
    base = dict(tomllib.loads(good)["farm"]["env"])
    farm.config.write_text(rewritten(good, farm={"env": {**base, **env}}))
    out = farm.farmctl("reload", timeout=240)
    farm.wait_for(lambda e: e.get("event") in VERDICTS, after=n, timeout=60)
    launched = [e["worker"] for e in farm.snapshot()[n:] if e.get("event") == "worker_launching"]
    return out.returncode, out.stdout + out.stderr, launched


def managed(port: int) -> str:
    return (
        "[gateway]\n"
        'mode = "managed"\n'
        f'listen = "127.0.0.1:{port}"\n'
        'policy = "cache_aware"\n'
        f'metrics_listen = "127.0.0.1:{port + 1}"\n'
        'drain_timeout = "30s"\n'
    )


def external(urls: list[str], key: Path) -> str:
    listed = ", ".join(f'"{u}"' for u in urls)
    return (
        f'[gateway]\nmode = "external"\nurls = [{listed}]\nadmin_key_file = "{key}"\n'
        'drain_timeout = "20s"\n'
    )


def _config(tmp: Path, marker: str, gateway: str) -> Path:
    return farm_config(
        tmp,
        workers=WORKERS,
        parallel=2,
        load_seconds=0.5,
        marker=marker,
        extra=gateway,
        rollout={"analysis_window": "10s", "min_requests": 20, "max_extensions": 1},
        # A loaded CI machine may miss a probe or two; a canary judged unhealthy there
        # would be a false rollback, not the change's doing.
        health={"period": "1s", "timeout": "5s", "failure_threshold": 5},
    )


def _cleanup(farm: Farm, marker: str) -> None:
    with contextlib.suppress(Exception):
        farm.stop(timeout=60)
    for pid in marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_nobodys_aborted_streams_neither_veto_a_harmless_change_nor_promote_a_bad_one(
    short_tmp: Path,
) -> None:
    asuser.require()
    marker, port = new_marker(), free_port_block(2)
    cfg = _config(short_tmp, marker, managed(port))
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=120)
        ports = worker_ports(cfg)
        with load([f"http://127.0.0.1:{port}"]):
            # A harmless change, nobody dropping streams on the canary (worker 0): promoted.
            with aborting(ports[:1]) as dropped:
                code, out, _ = reload_with(farm, cfg.read_text(), {"NOTE": "1"})
            assert dropped[0] >= 20, dropped  # the attack ran
            assert code == 0 and "promoted" in out, out
            # 10 % of requests answered 500, nobody dropping streams on the baseline's
            # workers (as the audit did: it made the baseline's "errors" 59.3 %).
            good = cfg.read_text()
            with aborting(ports[1:]) as dropped:
                code, out, launched = reload_with(farm, good, {"SGLANG_SIM_ERROR_RATE": "0.1"})
            assert dropped[0] >= 20, dropped
            assert code in (5, 6), out  # rolled back or held, never promoted
            assert set(launched) == {0}, launched  # no other worker ran it
            # The same 10 % (another seed: another change), dropped streams on the canary.
            with aborting(ports[:1]) as dropped:
                code, out, launched = reload_with(
                    farm, good, {"SGLANG_SIM_ERROR_RATE": "0.1", "SGLANG_SIM_SEED": "5"}
                )
            assert dropped[0] >= 20, dropped
            assert code in (5, 6), out
            assert set(launched) == {0}, launched
    finally:
        _cleanup(farm, marker)


def test_behind_external_gateways_a_change_failing_20_percent_is_never_promoted(
    short_tmp: Path,
) -> None:
    key = key_file(short_tmp)
    ports = free_port_block(4)
    with Smg(short_tmp, key, ports) as g1, Smg(short_tmp, key, ports + 2) as g2:
        marker = new_marker()
        cfg = _config(short_tmp, marker, external([g1.url, g2.url], key))
        farm = Farm(cfg, marker)
        try:
            farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=120)
            every = {f"http://127.0.0.1:{p}" for p in worker_ports(cfg)}
            end = time.monotonic() + 60
            while not g1.routed() == g2.routed() == every:
                assert time.monotonic() < end, "the gateways never routed to every worker"
                time.sleep(0.2)
            good = cfg.read_text()
            with load([g1.url, g2.url]):
                # Workers that count no HTTP responses (SGLang before 0.5.20) behind
                # gateways the farm does not scrape: no error source. Held, and said so.
                code, out, launched = reload_with(
                    farm,
                    good,
                    {"SGLANG_SIM_ERROR_RATE": "0.2", "SGLANG_SIM_NO_HTTP_METRICS": "1"},
                )
                assert code == 6, out
                assert "errors are not judged" in out, out
                assert set(launched) == {0}, launched
                # Workers with SGLang's own response counter: the 500s are seen.
                code, out, launched = reload_with(farm, good, {"SGLANG_SIM_ERROR_RATE": "0.2"})
                assert code in (5, 6), out  # rolled back or held, never promoted
                assert "canary errors" in out, out
                assert 0 in launched and not set(launched) - {0}, launched
        finally:
            _cleanup(farm, marker)
