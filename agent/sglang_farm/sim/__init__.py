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

Environment (part of the product):

| variable | default | effect |
| --- | --- | --- |
| `SGLANG_SIM_LOAD_SECONDS` | 2 | simulated model load (weights 60 %, KV 10 %, CUDA graphs 30 %) |
| `SGLANG_SIM_WARMUP_SECONDS` | 0.5 | warm-up after the bind, while `/health` answers 503 |
| `SGLANG_SIM_HEALTH_DELAY` | 1.0 | how long a healthy `/health` takes |
| `SGLANG_HEALTH_CHECK_TIMEOUT` | 20 | SGLang's own: how long `/health` waits on a hung scheduler before 503 |
| `SGLANG_SIM_TOKEN_SECONDS` | 0.01 | time per generated token |
| `SGLANG_SIM_DRAIN_SECONDS` | unset | the most a SIGTERM drain waits for in-flight requests; unset: no bound, as SGLang |
| `SGL_FORCE_SHUTDOWN` | unset | SGLang's own: `1`/`true` makes SIGTERM skip the drain |
| `SGLANG_SIM_FAIL` | unset | fail while starting, in one of the modes below |
| `SGLANG_SIM_FAIL_AFTER` | unset | T: T s after "fired up", the scheduler dies of a CUDA OOM (exit -9) |
| `SGLANG_SIM_HANG_AFTER` | unset | T: T s after "fired up", the scheduler hangs: `/health` and `/server_info` stop answering, `/metrics` and `/v1/loads` answer frozen values, `/ready` stays 200 |
| `SGLANG_SIM_IGNORE_SIGTERM` | unset | `1`: ignore SIGTERM (test a supervisor's SIGKILL deadline) |
| `SGLANG_SIM_GPU_MEM_GIB` | unset | N: each scheduler really holds N GiB on its CUDA device (torch with CUDA needed; otherwise a warning) |

`SGLANG_SIM_FAIL` modes, each printing SGLang's verbatim text (docs/reference/sglang.md §11) and exiting as SGLang does (§13):

| mode | where | text | exit |
| --- | --- | --- | --- |
| `cuda_oom` | weight load | `Scheduler hit an exception: Traceback ...` + `torch.OutOfMemoryError: CUDA out of memory. ...` | -9 |
| `real_cuda_oom` | weight load | the same, but torch's own message from really allocating until OOM (GPU machine) | -9 |
| `not_enough_memory` | KV sizing | `RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. ...` | -9 |
| `weights_leave_no_memory` | KV sizing | `ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=...` | -9 |
| `attention_backend` | backend init | `AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. ...` | -9 |
| `cuda_graph` | graph capture | `Capture cuda graph failed: ...` + `Possible solutions: ...` | -9 |
| `deep_gemm` | scheduler import | traceback ending in `assert cuda_home is not None` / `AssertionError` | -9 |
| `sgl_kernel` | launcher import | `ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library! ...` | 1 |
| `host_oom` | weight load | the scheduler is SIGKILLed; launcher: `Rank 0 scheduler died during initialization (exit code: -9) ...` | 1 |
| `bad_flag` | argv parsing | `sglang serve: error: unrecognized arguments: --mamba-scheduler-strategy extra_buffer` | 2 |
| `port_in_use` | bind | `ERROR:    [Errno 98] error while attempting to bind on address (...): address already in use` | 3 |

Without SGLANG_SIM_FAIL the same exits happen for real causes: a flag SGLang removed
(`--mamba-scheduler-strategy`) or an ambiguous one (`--cuda-graph-max-bs`) exits 2, a
served model name with `:` exits 1, a taken port exits 3, a scheduler killed by
someone exits 1 while loading and -9 while serving. SIGTERM (or SIGINT) logs
"SIGTERM received. ... Draining requests and shutting down...", turns `/health` 503,
keeps serving (new requests are admitted, as in SGLang), waits until no generation is
in flight (no bound unless SGLANG_SIM_DRAIN_SECONDS; none at all after a failed
health check or with SGL_FORCE_SHUTDOWN), kills the children and exits 0; only then
is the port closed.
"""

# ruff: noqa: E501 - the Markdown tables of env variables and failure modes

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the simulator with SGLang's argv; returns the process exit status.

    Imports the server lazily, so that the children (`python -m sglang_farm.sim.scheduler`) start fast.
    """
    from sglang_farm.sim.server import main as run

    return run(argv)
