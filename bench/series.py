"""I/O: what one host costs a fleet's Prometheus and gateway: an 8-worker simulated farm's
`/metrics` (the agent's own series, by family), one worker's `/metrics` (what `/sd` points
at), and with `--gateway` the demo's farm behind its smg: the agent's series then, and
smg's `GET /workers` (what each farm's reconcile fetches every 10 s): bytes per member
and latency.

`python -m bench.series [--workers N] [--gateway]` prints JSON; docs/fleet.md quotes it
and extrapolates to a fleet from it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.farmrun import FarmSetup, metrics_url, running_farm, wait_rollout  # sets sys.path
from bench.frontfarm import running as running_front_farm
from bench.stats import summary
from sglang_farm.gateway.smg import parse_members


def count_series(text: str) -> Counter[str]:
    """Series (samples of one scrape) per family name."""
    per: Counter[str] = Counter()
    for fam in text_string_to_metric_families(text):
        per[fam.name] += len(fam.samples)
    return per


def measure(workers: int) -> dict[str, object]:
    with running_farm(FarmSetup(workers)) as farm:
        host, port = metrics_url(farm)
        wait_rollout(farm, 120)
        base = f"http://{host}:{port}"
        deadline = time.monotonic() + 60
        while True:  # until every worker's stats poll has answered: all its figures present
            agent = count_series(httpx.get(f"{base}/metrics", timeout=10).text)
            polled = agent["sglang_farm_worker_stats_timestamp_seconds"]
            if polled == workers or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        sd = httpx.get(f"{base}/sd", timeout=10).json()
        one = sd[0]["targets"][0]
        worker = count_series(httpx.get(f"http://{one}/metrics", timeout=10).text)
    return {
        "workers": workers,
        "agent_series": sum(agent.values()),
        "agent_families": len(agent),
        "agent_by_family": dict(agent.most_common()),
        "sd_targets": len(sd),
        "simulated_worker_series": sum(worker.values()),
    }


def parse_ms(body: dict[str, object], members: int, reps: int = 5) -> float:
    """Median ms for the farm to decode and read a GET /workers answer of `members` entries
    shaped like smg's real ones (each a copy of a real entry, its URL made unique)."""
    real = body["workers"]
    assert isinstance(real, list) and real
    entries = []
    for i in range(members):
        e = dict(real[i % len(real)])
        e["url"] = f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:30000"
        entries.append(e)
    text = json.dumps({**body, "workers": entries})
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        parse_members(json.loads(text))
        xs.append(time.perf_counter() - t0)
    return float(summary(xs, scale=1000)["median"])


def measure_gateway(reps: int = 200) -> dict[str, object]:
    """The demo's 8 workers behind its managed smg: GET /workers size and latency."""
    with running_front_farm(token_s=0.01) as ff:
        host, port = metrics_url(ff.farm)
        ff.wait_all_in(120)
        time.sleep(11)  # a reconcile after every worker joined: in_gateway confirmed
        agent = count_series(httpx.get(f"http://{host}:{port}/metrics", timeout=10).text)
        url, headers = f"{ff.gateway_url}/workers", ff.admin_headers()
        xs: list[float] = []
        size = members = 0
        with httpx.Client(timeout=10, trust_env=False) as http:
            for _ in range(reps):
                t0 = time.perf_counter()
                r = http.get(url, headers=headers)
                xs.append(time.perf_counter() - t0)
                size, members = len(r.content), len(r.json()["workers"])
    return {
        "parse_ms_by_members": {n: parse_ms(r.json(), n) for n in (8, 800, 8000)},
        "agent_series_with_gateway": sum(agent.values()),
        "gateway_families": {k: v for k, v in agent.items() if "gateway" in k},
        "get_workers_members": members,
        "get_workers_bytes": size,
        "get_workers_bytes_per_member": size / max(members, 1),
        "get_workers_ms": summary(xs, scale=1000),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--gateway", action="store_true", help="the demo's farm behind its smg")
    args = ap.parse_args()
    out = measure_gateway() if args.gateway else measure(args.workers)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
