"""I/O: how many Prometheus series one host adds: an 8-worker simulated farm's `/metrics`
(the agent's own series, by family) and one worker's `/metrics` (what `/sd` points at).

`python -m bench.series [--workers N]` prints JSON; docs/fleet.md quotes it and
extrapolates to a fleet from it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.farmrun import FarmSetup, metrics_url, running_farm, wait_rollout


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=8)
    print(json.dumps(measure(ap.parse_args().workers), indent=1))


if __name__ == "__main__":
    main()
