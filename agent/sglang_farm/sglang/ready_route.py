"""Pure: which route says a starting worker is ready, and when to fall back to another.

SGLang 0.5.20 and newer serve `/ready`: 200 once the server is Up (which it becomes only
after its own warm-up generation passed), not paused and not shutting down, with no
generation of its own, so it answers at once, never queued behind a batch. Older SGLang
(the seed host's 0.5.12) has no such route and answers 404; readiness then comes from
`/health`, the 1-token generation, as before. So `[health] ready_path = "auto"` (the
default) asks `/ready` first and moves to `[health] path` on a 404: the installed
version decides, as observed on the worker itself, with no version table to keep.

Liveness stays on `[health] path` (`/health`): `/ready` reports a status that a hung
scheduler does not change until a `/health` times out, so only the generating check
catches a wedged engine (docs/reference/sglang.md, "Readiness and liveness").
"""

from __future__ import annotations

READY_ROUTE = "/ready"
AUTO = "auto"
NOT_FOUND = 404


def readiness_routes(ready_path: str, health_path: str) -> tuple[str, ...]:
    """The routes a starting worker's readiness is asked on, in order of preference:
    `auto` -> `/ready`, then the liveness route; any other value -> that route alone."""
    if ready_path != AUTO:
        return (ready_path,)
    if health_path == READY_ROUTE:
        return (READY_ROUTE,)
    return (READY_ROUTE, health_path)


def next_route(routes: tuple[str, ...], at: int, status: int | None) -> int:
    """The index of the route to ask next, after route `at` answered `status` (None: no
    HTTP answer). One further on a 404, the answer of a SGLang without that route, while
    there is a further one; otherwise the same route."""
    if status == NOT_FOUND and at + 1 < len(routes):
        return at + 1
    return at
