"""I/O: issue 33's batch figures (docs/benchmarks.md, "Batch jobs"), simulator figures only.

    python -m bench.batch                       # all three parts, 20,000 requests
    python -m bench.batch --only throughput --requests 5000
    python -m bench.batch --only memory --million

- **throughput**: the demo's farm (8 simulator workers behind the managed smg, the batch
  service run by the agent with its SQLite store), one batch of N requests (the demo's
  example, `scripts/batch_example.py`), then the same N bodies sent by a plain asyncio
  client of the `openai` package straight to the front door at the batch's own mean
  concurrency (what it kept in flight). Requests/s and tokens/s of each, and their ratio.
- **floor**: the batch service alone against a do-nothing server (a fixed chat answer at
  once, Starlette on uvicorn) at a fixed concurrency: the service's CPU seconds per
  request (its /proc utime + stime over the run) and the requests/s it sustains.
- **memory**: the service's RSS (VmRSS, sampled every 0.2 s) at rest, then for a batch of
  10,000 and one of 1,000,000 requests (`--million`) against the do-nothing server, from
  the upload through validation and the first requests; the larger one is cancelled after
  `--memory-run-s` of running (its RSS is then flat or not).

The simulator is not SGLang and these are not SGLang's figures; on a shared machine every
figure is as noisy as the machine (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.farmrun import ROOT, free_port_block

KEY = "bench-batch-key"
MODEL = "sim/Qwen3.6-27B"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "batch_example", ROOT / "scripts/batch_example.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_input(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for line in _example().requests(n, MODEL):
            f.write(line + "\n")
    return path


def proc_cpu_s(pid: int) -> float:
    """utime + stime of `pid`, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load_avg() -> float:
    return os.getloadavg()[0]


class Api:
    """The batch service's HTTP API, as any client sees it."""

    def __init__(self, url: str, key: str = KEY) -> None:
        self.url = url
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600, trust_env=False
        )

    def up(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return self.http.get("/v1/batches", timeout=2).status_code == 200
        return False

    def submit(self, path: Path) -> str:
        with open(path, "rb") as f:
            r = self.http.post(
                "/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}
            )
        r.raise_for_status()
        b = self.http.post(
            "/v1/batches",
            json={
                "input_file_id": r.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        b.raise_for_status()
        return str(b.json()["id"])

    def batch(self, bid: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/batches/{bid}")
        r.raise_for_status()
        return dict(r.json())

    def cancel(self, bid: str) -> None:
        self.http.post(f"/v1/batches/{bid}/cancel")

    def metric(self, name: str) -> float | None:
        from sglang_farm.cli.batchview import metric_sum

        with contextlib.suppress(httpx.HTTPError):
            return metric_sum(self.http.get("/metrics", timeout=5).text, name)
        return None

    def output_tokens(self, bid: str) -> tuple[int, int, int]:
        """(lines, prompt tokens, completion tokens) of the batch's output file."""
        fid = self.batch(bid)["output_file_id"]
        lines = prompt = completion = 0
        with self.http.stream("GET", f"/v1/files/{fid}/content") as r:
            for raw in r.iter_lines():
                if not raw.strip():
                    continue
                usage = json.loads(raw)["response"]["body"].get("usage") or {}
                lines += 1
                prompt += int(usage.get("prompt_tokens") or 0)
                completion += int(usage.get("completion_tokens") or 0)
        return lines, prompt, completion


@dataclass(frozen=True, slots=True)
class Run:
    """One way of sending the N requests, timed."""

    what: str
    requests: int
    seconds: float
    completion_tokens: int
    concurrency: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds


def run_batch(api: Api, path: Path, n: int, poll: float = 0.2) -> tuple[Run, str]:
    """Submit, then time it from the first poll that sees it in progress to the first that
    sees it finished; the in-flight count sampled meanwhile is its concurrency."""
    bid = api.submit(path)
    started: float | None = None
    in_flight: list[float] = []
    while True:
        b = api.batch(bid)
        now = time.monotonic()
        if b["status"] == "in_progress":
            if started is None:
                started = now
            f = api.metric("sglang_farm_batch_in_flight")
            if f is not None and f > 0:
                in_flight.append(f)
        elif b["status"] in ("finalizing", "completed", "failed", "expired", "cancelled"):
            if started is None:
                started = now
            break
        time.sleep(poll)
    while b["status"] == "finalizing":
        time.sleep(poll)
        b = api.batch(bid)
    if b["status"] != "completed" or b["request_counts"]["completed"] != n:
        raise RuntimeError(f"batch {bid} ended {b['status']}: {b['request_counts']}")
    lines, _, completion = api.output_tokens(bid)
    assert lines == n, (lines, n)
    conc = sum(in_flight) / len(in_flight) if in_flight else 0.0
    return Run("batch service", n, now - started, completion, conc), bid


async def _plain(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, int]:
    import openai

    # The client's own HTTP pool (up to 1,000 connections): the semaphore is the bound.
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(body: dict[str, Any]) -> None:
        nonlocal tokens
        async with sem:
            r = await client.chat.completions.create(**body)
            tokens += r.usage.completion_tokens if r.usage else 0

    t0 = time.monotonic()
    await asyncio.gather(*(one(b) for b in bodies))
    seconds = time.monotonic() - t0
    await client.close()
    return seconds, tokens


def run_plain(front_door: str, path: Path, concurrency: int) -> Run:
    bodies = [json.loads(ln)["body"] for ln in path.read_text().splitlines()]
    seconds, tokens = asyncio.run(_plain(front_door, bodies, concurrency))
    return Run("plain openai client", len(bodies), seconds, tokens, float(concurrency))


# --- throughput: the demo's farm --------------------------------------------------------


def throughput(n: int, token_s: float) -> dict[str, Any]:
    from bench.frontfarm import running

    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-batch-"))
    port = free_port_block(1)

    def adjust(doc: dict[str, Any]) -> None:
        (tmp / "batch-api.key").write_text(KEY + "\n")
        os.chmod(tmp / "batch-api.key", 0o600)
        doc["batch"] = {
            "enabled": True,
            "listen": f"127.0.0.1:{port}",
            "api_key_file": str(tmp / "batch-api.key"),
            "state_dir": str(tmp / "batch"),
        }

    path = write_input(tmp / "in.jsonl", n)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        ff = stack.enter_context(running(token_s, adjust))
        ff.wait_all_in(300)
        api = Api(f"http://127.0.0.1:{port}")
        end = time.monotonic() + 120
        while not api.up():
            if time.monotonic() > end:
                raise RuntimeError("the batch service never answered")
            time.sleep(0.5)
        svc = service_pid(ff.config)
        runs: list[dict[str, Any]] = []
        conc = 0
        # Batch, plain, batch: a machine whose load moves shows as two batch figures apart.
        for what in ("batch", "plain", "batch"):
            load = load_avg()
            if what == "batch":
                cpu0 = proc_cpu_s(svc)
                run, _ = run_batch(api, path, n)
                cpu = proc_cpu_s(svc) - cpu0
                conc = conc or max(1, round(run.concurrency))
            else:
                own0 = resource.getrusage(resource.RUSAGE_SELF)
                run = run_plain(ff.gateway_url, path, conc)
                own1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
            runs.append(
                {
                    **asdict(run),
                    "rps": run.requests_per_s,
                    "tps": run.tokens_per_s,
                    "client_cpu_s": cpu,  # the batch service's, or the plain client's
                    "load_avg_before": load,
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    plain_rps = runs[1]["rps"]
    return {
        "requests": n,
        "token_s": token_s,
        "runs": runs,
        "ratio_rps": [r["rps"] / plain_rps for r in (runs[0], runs[2])],
        "ratio_tps": [r["tps"] / runs[1]["tps"] for r in (runs[0], runs[2])],
    }


def service_pid(config: Path) -> int:
    """The batch service the agent runs on `config` (its child: `-m sglang_farm.batch`)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                    if b"sglang_farm.batch" in argv and os.fsencode(str(config)) in argv:
                        return int(entry)
        time.sleep(0.5)
    raise RuntimeError(f"no batch service runs on {config}")


# --- a do-nothing server and the service alone -----------------------------------------

NOOP_SERVER = r"""
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
BODY = (b'{"id":"x","object":"chat.completion","created":0,"model":"noop","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}')
async def chat(request):
    await request.body()
    return Response(BODY, media_type="application/json")
app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/health", lambda r: Response(b"ok"))])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


@contextlib.contextmanager
def process(argv: list[str], log: Path, **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True, **kw)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def service_on_noop(tmp: Path, concurrency: int) -> Iterator[tuple[Api, int, int]]:
    """The do-nothing server and a batch service sending to it: (api, service pid, server pid)."""
    noop_port, svc_port = free_port_block(1), free_port_block(1)
    (tmp / "key").write_text(KEY + "\n")
    os.chmod(tmp / "key", 0o600)
    config = tmp / "farm.toml"
    config.write_text(
        f"""[farm]
name = "bench-batch"
python = "@agent"
module = "sglang_farm.sim"
state_dir = "{tmp}/state"
user = "root"
group = "root"

[workers]
gpus = [0]
host = "127.0.0.1"
base_port = {free_port_block(2)}

[control]
socket = "{tmp}/control.sock"

[metrics]
listen = "127.0.0.1:0"
gpu_source = "fake"

[gateway]
mode = "external"
url = "http://127.0.0.1:{noop_port}"

[sglang]
model_path = "{MODEL}"
# The runner's slots without an agent to ask: the config's (one worker's
# max_running_requests); without it, 32 (capacity.DEFAULT_MAX_RUNNING) capped `concurrency`.
max_running_requests = {concurrency}

[batch]
enabled = true
listen = "127.0.0.1:{svc_port}"
api_key_file = "{tmp}/key"
state_dir = "{tmp}/batch"
concurrency = {concurrency}
"""
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (
        process([sys.executable, "-c", NOOP_SERVER, str(noop_port)], tmp / "noop.log") as noop,
        process(
            [sys.executable, "-m", "sglang_farm.batch", "--config", str(config)],
            tmp / "batch.log",
            env=env,
        ) as svc,
    ):
        api = Api(f"http://127.0.0.1:{svc_port}")
        end = time.monotonic() + 60
        while not api.up():
            if svc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"batch service: {(tmp / 'batch.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield api, svc.pid, noop.pid


def floor(n: int, concurrency: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-batch-"))
    path = write_input(tmp / "in.jsonl", n)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        api, pid, noop_pid = stack.enter_context(service_on_noop(tmp, concurrency))
        load0 = load_avg()
        cpu0, noop0 = proc_cpu_s(pid), proc_cpu_s(noop_pid)
        run, _ = run_batch(api, path, n)
        cpu = proc_cpu_s(pid) - cpu0
        noop_cpu = proc_cpu_s(noop_pid) - noop0
    return {
        "requests": n,
        "concurrency": concurrency,
        "seconds": run.seconds,
        "rps": run.requests_per_s,
        "service_cpu_s": cpu,
        "cpu_ms_per_request": 1000 * cpu / n,
        "noop_server_cpu_s": noop_cpu,
        "mean_in_flight": run.concurrency,
        "load_avg": [load0, load_avg()],
    }


class RssSampler:
    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.every = pid, every
        self.peak = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, proc_rss_mb(self.pid))
            self._stop.wait(self.every)

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.peak


def memory(sizes: list[int], run_s: float, concurrency: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-batch-"))
    out: dict[str, Any] = {"concurrency": concurrency, "run_s": run_s, "sizes": {}}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        api, pid, _ = stack.enter_context(service_on_noop(tmp, concurrency))
        time.sleep(2)
        out["rest_mb"] = proc_rss_mb(pid)
        for n in sizes:
            path = write_input(tmp / f"in-{n}.jsonl", n)
            sampler = RssSampler(pid)
            t0 = time.monotonic()
            bid = api.submit(path)
            ran_from: float | None = None
            while True:
                b = api.batch(bid)
                now = time.monotonic()
                if b["status"] == "in_progress" and ran_from is None:
                    ran_from = now
                if b["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
                if ran_from is not None and now - ran_from >= run_s:
                    api.cancel(bid)
                    ran_from = float("inf")
                time.sleep(0.5)
            peak = sampler.stop()
            out["sizes"][str(n)] = {
                "peak_mb": peak,
                "after_mb": proc_rss_mb(pid),
                "status": b["status"],
                "done": b["request_counts"],
                "seconds": time.monotonic() - t0,
                "input_mb": path.stat().st_size / 2**20,
            }
            path.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["throughput", "floor", "memory"], action="append")
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--token-s", type=float, default=0.01, help="simulator seconds per token")
    p.add_argument("--floor-concurrency", type=int, default=256)
    p.add_argument("--million", action="store_true", help="memory: also 1,000,000 requests")
    p.add_argument("--memory-run-s", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    parts = args.only or ["throughput", "floor", "memory"]
    result: dict[str, Any] = {"cpus": os.cpu_count(), "started": time.time()}
    if "throughput" in parts:
        result["throughput"] = throughput(args.requests, args.token_s)
        print(json.dumps({"throughput": result["throughput"]}, indent=2), flush=True)
    if "floor" in parts:
        result["floor"] = floor(args.requests, args.floor_concurrency)
        print(json.dumps({"floor": result["floor"]}, indent=2), flush=True)
    if "memory" in parts:
        sizes = [10_000, 1_000_000] if args.million else [10_000]
        result["memory"] = memory(sizes, args.memory_run_s, args.floor_concurrency)
        print(json.dumps({"memory": result["memory"]}, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
