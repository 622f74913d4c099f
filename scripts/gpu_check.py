#!/usr/bin/env python3
# ruff: noqa: E501 -- the report's lines are printed as they are, long ones included
"""The farm on real GPUs, in one run (CI never has a GPU; this records what only a GPU machine shows).

Run from the repo root on a machine with NVIDIA GPUs, nvidia-smi, torch with CUDA and
the farm's Python dependencies (PYTHONPATH=agent):

    PYTHONPATH=agent python3 scripts/gpu_check.py [--out DIR]

It runs the agent with the process runtime and real NVML over one simulator worker per
GPU, each really holding a distinct amount of GPU memory through torch (the simulator's
scheduler child holds it, as SGLang's scheduler does), and prints:

1. every worker ready, canary first, in waves;
2. per GPU: sglang_farm_gpu_memory_used_bytes and the worker's attributed memory against
   `nvidia-smi --query-compute-apps` on the same index and UUID;
3. a restart of one worker through the control socket: NVML shows no compute process on
   its GPU between the old and the new process, and the other GPUs' processes are untouched;
4. exporter scrape p50/p99 with real NVML, the NVML snapshot cost per GPU, and the same
   fields through `nvidia-smi --query-gpu`, all in this run;
5. a worker driven into a real CUDA OOM (torch's own OutOfMemoryError): classified
   `cuda_oom_load`, the OOM ladder steps, the worker restarts with the new flags, and
   sglang_farm_worker_oom_events_total{kind="cuda"} counts each.

The figures are the simulator's on a real GPU, never SGLang's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "agent")]

import pynvml  # noqa: E402 -- after the sys.path setup above

from farmproc import Farm, free_port_block, marked_pids, new_marker, tmpdir  # noqa: E402 -- ditto
from sglang_farm.control.client import Client  # noqa: E402 -- ditto
from sglang_farm.gpus.nvml import NvmlPoller, read_ppid_map  # noqa: E402 -- ditto
from sglang_farm.gpus.snapshot import process_tree  # noqa: E402 -- ditto

report: dict[str, Any] = {}


def say(*a: object) -> None:
    print(*a, flush=True)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def config(
    tmp: Path,
    n: int,
    marker: str,
    *,
    worker_env: dict[int, dict[str, str]],
    oom: bool = False,
    parallel: int = 4,
) -> Path:
    base = free_port_block(n * 2)
    env = {
        "SGLANG_SIM_LOAD_SECONDS": "2",
        "SGLANG_SIM_HEALTH_DELAY": "0.2",
        "SGLANG_FARM_TEST_MARKER": marker,
    }
    overrides = "".join(
        f"\n[workers.overrides.{w}]\nenv = {{ "
        + ", ".join(f'{k} = "{v}"' for k, v in e.items())
        + " }\n"
        for w, e in worker_env.items()
    )
    ladder = ""
    if oom:
        ladder = """
[oom]
enabled = true
[[oom.steps]]
name = "less static memory"
add = { mem_fraction_static = -0.02 }
min = { mem_fraction_static = 0.5 }
[[oom.steps]]
name = "halve running requests"
multiply = { max_running_requests = 0.5 }
min = { max_running_requests = 8 }
"""
    text = f"""
[farm]
name = "gpu-check"
python = "{sys.executable}"
module = "sglang_farm.sim"
user = "root"
group = "root"
state_dir = "{tmp}/state"
env = {{ {", ".join(f'{k} = "{v}"' for k, v in env.items())} }}

[workers]
gpus = {list(range(n))}
host = "127.0.0.1"
base_port = {base}
nccl_base_port = {base + n}
{overrides}
[startup]
canary = 0
parallel = {parallel}
load_timeout = "120s"
poll_interval = "0.2s"

[health]
period = "1s"
timeout = "5s"
failure_threshold = 3

[restart]
backoff_initial = "0.5s"
backoff_max = "5s"
max_failures = 5
stop_timeout = "10s"
{ladder}
[metrics]
listen = "127.0.0.1:0"
gpu_source = "nvml"
gpu_poll_interval = "0.5s"
worker_poll_interval = "1s"

[control]
socket = "{tmp}/control.sock"
group = "root"

[sglang]
model_path = "sim/Qwen3.6-27B"
enable_metrics = true
mem_fraction_static = 0.88
max_running_requests = 64
"""
    path = tmp / "farm.toml"
    path.write_text(text)
    return path


def metrics_url(farm: Farm) -> str:
    ev = farm.wait_for(lambda e: e.get("event") == "metrics_listening", timeout=30)
    return f"http://{ev['address']}/metrics"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict[Any, float], name: str, **labels: str) -> float | None:
    for (n, lab), v in m.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            return v
    return None


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    flag = "--query-gpu" if kind == "gpu" else "--query-compute-apps"
    out = subprocess.run(
        ["nvidia-smi", f"{flag}={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line]


def gpu_procs(handles: list[Any]) -> dict[int, set[int]]:
    return {
        i: {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        for i, h in enumerate(handles)
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    uuids = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
    uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
    say(f"== {n} GPU(s):", ", ".join(f"{i}={u}" for i, u in enumerate(uuids)))
    report["gpus"] = uuids

    # ---- 1-3: the farm over real GPUs ----------------------------------------------------
    tmp, marker = tmpdir(), new_marker()
    gib = {w: 2 + 2 * w for w in range(n)}  # distinct per GPU: 2, 4, 6 ... GiB
    cfg = config(
        tmp,
        n,
        marker,
        worker_env={w: {"SGLANG_SIM_GPU_MEM_GIB": str(g)} for w, g in gib.items()},
        parallel=max(1, n // 2),
    )
    farm = Farm(cfg, marker)
    try:
        url = metrics_url(farm)
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=240)
        ready = {e["worker"]: e["timestamp"] for e in farm.named("worker_ready")}
        launching = {e["worker"]: e["timestamp"] for e in farm.named("worker_launching")}
        say("== rollout: launch/ready order (ISO UTC)")
        for w in sorted(launching):
            say(f"   worker {w}: launched {launching[w]}  ready {ready.get(w)}")
        canary_first = all(launching[w] > ready[0] for w in launching if w != 0)
        say(f"   canary ready before any other launch: {canary_first}")
        report["canary_first"] = canary_first
        time.sleep(2.0)  # two GPU polls
        m = scrape(url)
        apps = smi("pid,gpu_uuid,used_memory", kind="apps")
        gq = smi("index,uuid,memory.used")
        ppids = read_ppid_map()
        say("== per GPU: exporter vs nvidia-smi (MiB)")
        rows = []
        for w in range(n):
            pid = farm.named("worker_launched", worker=w)[-1]["pid"]
            tree = process_tree(pid, ppids)
            smi_used = next(float(r[2]) for r in gq if int(r[0]) == w)
            smi_uuid = next(r[1] for r in gq if int(r[0]) == w)
            app_mib = sum(float(a[2]) for a in apps if a[1] == smi_uuid and int(a[0]) in tree)
            used = sample(m, "sglang_farm_gpu_memory_used_bytes", gpu=str(w)) or 0
            attributed = sample(m, "sglang_farm_worker_gpu_memory_bytes", worker=str(w)) or 0
            row = {
                "gpu": w,
                "uuid": smi_uuid,
                "held_gib": gib[w],
                "exporter_used_mib": used / 2**20,
                "smi_used_mib": smi_used,
                "exporter_worker_mib": attributed / 2**20,
                "smi_compute_apps_mib": app_mib,
                "uuid_label": next(
                    (
                        dict(lab).get("uuid")
                        for (nm, lab) in m
                        if nm == "sglang_farm_gpu_info" and dict(lab).get("gpu") == str(w)
                    ),
                    None,
                ),
            }
            rows.append(row)
            say(
                f"   gpu {w} {smi_uuid}: holds {gib[w]} GiB | used exporter {row['exporter_used_mib']:.0f}"
                f" smi {smi_used:.0f} | worker {w} exporter {row['exporter_worker_mib']:.0f}"
                f" smi-apps {app_mib:.0f} | uuid label {row['uuid_label']}"
            )
        report["memory"] = rows

        # 3. restart one worker: its GPU empties in between; the others are untouched.
        target = n - 1 if n > 1 else 0
        before = gpu_procs(handles)
        client = Client(str(tmp / "control.sock"))
        t0 = time.time()
        client.call("restart", {"worker": target})
        empty_seen, samples_ = False, []
        deadline = time.time() + 120
        old = before[target]
        while time.time() < deadline:
            now = gpu_procs(handles)
            samples_.append((round(time.time() - t0, 3), sorted(now[target])))
            if not now[target]:
                empty_seen = True
            if now[target] and not (now[target] & old) and empty_seen:
                break
            time.sleep(0.05)
        after = gpu_procs(handles)
        others_same = all(after[g] == before[g] for g in range(n) if g != target)
        say(
            f"== restart worker {target}: GPU {target} had no compute process in between: {empty_seen};"
            f" new pids {sorted(after[target])} vs old {sorted(old)}; other GPUs untouched: {others_same}"
        )
        report["restart"] = {
            "worker": target,
            "empty_between": empty_seen,
            "others_untouched": others_same,
            "timeline": samples_[::5],
        }
        farm.wait_for(
            lambda e: e.get("event") == "worker_ready" and e.get("worker") == target,
            after=0,
            timeout=120,
        )

        # 4. costs, in this run.
        lat = []
        for _ in range(300):
            t = time.perf_counter()
            urllib.request.urlopen(url, timeout=10).read()
            lat.append((time.perf_counter() - t) * 1000)
        poller = NvmlPoller()
        snap = []
        for _ in range(200):
            t = time.perf_counter()
            poller.snapshot()
            snap.append((time.perf_counter() - t) * 1e6 / n)
        poller.close()
        fields = "index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw,clocks.sm"
        smi_t = []
        for _ in range(20):
            t = time.perf_counter()
            smi(fields)
            smi_t.append((time.perf_counter() - t) * 1000)
        costs = {
            "scrape_ms_p50": statistics.median(lat),
            "scrape_ms_p99": pct(lat, 99),
            "nvml_snapshot_us_per_gpu_median": statistics.median(snap),
            "nvml_snapshot_us_per_gpu_p99": pct(snap, 99),
            "nvml_snapshot_ms_all_gpus_median": statistics.median(snap) * n / 1000,
            "nvidia_smi_query_gpu_ms_median_all_gpus": statistics.median(smi_t),
            "ratio_smi_to_nvml_all_gpus": statistics.median(smi_t)
            / (statistics.median(snap) * n / 1000),
        }
        report["costs"] = costs
        say("== costs (this run):", json.dumps(costs, indent=1))
    finally:
        code = farm.stop()
        time.sleep(1)
        say(f"== farm stopped (exit {code}); processes left: {marked_pids(marker)}")
        report["left_after_stop"] = marked_pids(marker)

    # ---- 5: a real CUDA OOM steps the ladder -----------------------------------------------
    tmp2, marker2 = tmpdir(), new_marker()
    cfg2 = config(tmp2, 1, marker2, worker_env={0: {"SGLANG_SIM_FAIL": "real_cuda_oom"}}, oom=True)
    farm2 = Farm(cfg2, marker2)
    try:
        url2 = metrics_url(farm2)
        farm2.wait_for(
            lambda e: e.get("event") in ("rollout_halted", "worker_gave_up"), timeout=240
        )
        time.sleep(1.5)
        m2 = scrape(url2)
        fails = [(e.get("kind"), e.get("summary", "")[:160]) for e in farm2.named("worker_failed")]
        argvs = [
            " ".join(
                a
                for a in e["argv"]
                if a.startswith("--mem") or a.startswith("--max-run") or a[0].isdigit()
            )
            for e in farm2.named("worker_launching")
        ]
        flag_logs = [
            (e.get("flag"), e.get("old"), e.get("new"), e.get("step"))
            for e in farm2.named("oom_ladder_flag")
        ]
        oom_cuda = sample(m2, "sglang_farm_worker_oom_events_total", worker="0", kind="cuda")
        step = sample(m2, "sglang_farm_worker_oom_ladder_step", worker="0")
        say("== real CUDA OOM:")
        for k, s in fails:
            say(f"   failure: {k}: {s}")
        for fl in flag_logs:
            say(f"   ladder: {fl}")
        for a in argvs:
            say(f"   launched with: {a}")
        say(
            f"   sglang_farm_worker_oom_events_total{{kind=cuda}} = {oom_cuda}; ladder step = {step}"
        )
        why = subprocess.run(
            [sys.executable, "-m", "sglang_farm.cli.farmctl", "--config", str(cfg2), "why", "0"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT / "agent")},
        )
        say("   farmctl why 0:\n" + "\n".join("     " + ln for ln in why.stdout.splitlines()[:25]))
        report["oom"] = {
            "failures": fails,
            "ladder": flag_logs,
            "argv": argvs,
            "oom_events_cuda": oom_cuda,
            "ladder_step": step,
            "why": why.stdout,
        }
    finally:
        farm2.stop()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
