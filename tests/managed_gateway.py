"""A managed smg's [gateway] section, and the workers it routes read with its admin key:
the gateway trust and squat tests share them.
"""

from __future__ import annotations

import httpx


def members(gw: str, key: str) -> list[dict[str, object]]:
    r = httpx.get(f"{gw}/workers", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    r.raise_for_status()
    out: list[dict[str, object]] = r.json()["workers"]
    return out


def routed(gw: str, key: str) -> set[str]:
    return {str(w["url"]) for w in members(gw, key) if w.get("status", "ready") == "ready"}


def managed_section(port: int) -> str:
    # No admin_key_file, no api_key_file: the demo's and the sample's set-up.
    return (
        '[gateway]\nmode = "managed"\n'
        f'listen = "127.0.0.1:{port}"\nmetrics_listen = "127.0.0.1:{port + 1}"\n'
        'policy = "round_robin"\ndrain_timeout = "5s"\n'
    )
