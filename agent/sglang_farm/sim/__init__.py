"""I/O: a stand-in for an SGLang 0.5.23 server, seen from the outside (`sglang-farm sim`).

`python -m sglang_farm.sim [SGLang flags...]` accepts the argv the farm renders
(`--model-path M --host H --port P --nccl-port N [--tp-size K] ...`), models the
flags in `options.py` and ignores any other. It behaves like `sglang.launch_server`
(docs/reference/sglang.md §6, §12, §13): a launcher that spawns `sglang::scheduler` (one per TP
rank) and `sglang::detokenizer` children in its process group; the HTTP port is
bound only once the simulated load is over; `/health` is 503 during warm-up, then
200 after about 1 s; SGLang-format log lines on stderr, ending with "The server is
fired up and ready to roll!"; `/metrics` (with `--enable-metrics`) with SGLang's
metric names, types and labels; `/generate`, `/v1/chat/completions` and
`/v1/completions` that take time per token, with requests beyond
`--max-running-requests` queued, and `"stream": true` answered with server-sent
events as SGLang sends them (`replies.py`). docs/simulator.md is the user's guide.

Its environment controls (SGLANG_SIM_*, part of the product) and failure modes are
listed by `--help` (usage.py; a test checks that it names every variable the code reads)
and in docs/simulator.md.

Without SGLANG_SIM_FAIL, SGLang's exit statuses come from real causes: a flag SGLang removed
(`--mamba-scheduler-strategy`) or an ambiguous one (`--cuda-graph-max-bs`) exits 2, a
served model name with `:` exits 1, a taken port exits 3, a scheduler killed by
someone exits 1 while loading and -9 while serving. SIGTERM (or SIGINT) logs
"SIGTERM received. ... Draining requests and shutting down...", turns `/health` 503,
keeps serving (new requests are admitted, as in SGLang), waits until no generation is
in flight (no bound unless SGLANG_SIM_DRAIN_SECONDS; none at all after a failed
health check or with SGL_FORCE_SHUTDOWN), kills the children and exits 0; only then
is the port closed.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the simulator with SGLang's argv; returns the process exit status.

    Imports the server lazily, so that the children (`python -m sglang_farm.sim.scheduler`)
    start fast.
    """
    from sglang_farm.sim.server import main as run

    return run(argv)
