"""I/O: the simulator's children: `sglang::scheduler` (one per TP rank) and `sglang::detokenizer`.

Like SGLang's, they run in the launcher's process group, die with it
(`PR_SET_PDEATHSIG`, plus EOF on stdin), ignore SIGTERM (the launcher drains and
then kills them), and report a failure by logging it and sending SIGQUIT to the
launcher, which then SIGKILLs the whole tree and itself. The scheduler does the
simulated model load and, when asked, really holds GPU memory, since in SGLang
it is the scheduler that owns the CUDA context.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from sglang_farm.sim.log import SimLog
from sglang_farm.sim.options import GPU_TOTAL_GB, WEIGHTS_GB
from sglang_farm.sim.texts import load_failure, runtime_cuda_oom

CHILD_ENV = "_SGLANG_SIM_CHILD"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
GRAPH_GB = 0.52
# A failing child waits this long for the launcher's SIGKILL before giving up on it.
_KILL_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class ChildConfig:
    """What the launcher hands a child (through the environment, as JSON)."""

    role: str  # "scheduler" or "detokenizer"
    rank: int
    parent_pid: int
    ready_fd: int
    tp_size: int
    load_seconds: float
    fail: str | None
    fail_after: float | None
    gpu_mem_gib: float | None
    mem_fraction_static: float
    max_total_tokens: int
    kv_cache_gb: float
    max_running_requests: int
    context_len: int
    chunked_prefill_size: int

    @property
    def title(self) -> str:
        if self.role == "scheduler" and self.tp_size > 1:
            return f"sglang::scheduler_TP{self.rank}"
        return f"sglang::{self.role}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildConfig:
        return cls(**json.loads(text))


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the stdin EOF watch below still ends the child


def _watch_parent(serving: threading.Event) -> None:
    """Read the launcher's messages on stdin; EOF means the launcher is gone."""
    for line in sys.stdin:
        if line.strip() == "serving":
            serving.set()
    os._exit(0)


def _report_failure(cfg: ChildConfig, log: SimLog, text: str) -> None:
    """Log the exception and SIGQUIT the launcher, as `run_scheduler_process` does.

    Never returns: the launcher SIGKILLs this process.
    """
    log.info(text)
    try:
        os.kill(cfg.parent_pid, signal.SIGQUIT)
    except ProcessLookupError:
        os._exit(1)
    time.sleep(_KILL_WAIT_S)
    os._exit(1)


def _torch(log: SimLog, why: str) -> Any:
    """torch if it imports and sees a CUDA device, else None with a warning logged."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        log.info(f"WARNING: {why}, but torch is not importable ({exc}); holding no GPU memory")
        return None
    if not torch.cuda.is_available():
        log.info(f"WARNING: {why}, but torch sees no CUDA device; holding no GPU memory")
        return None
    return torch


def _hold_gpu_memory(cfg: ChildConfig, log: SimLog, gib: float) -> Any:
    torch = _torch(log, f"SGLANG_SIM_GPU_MEM_GIB={gib:g} was asked")
    if torch is None:
        return None
    index = cfg.rank % torch.cuda.device_count()
    try:
        block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=f"cuda:{index}")
    except torch.OutOfMemoryError:
        _report_failure(cfg, log, "Scheduler hit an exception: " + traceback.format_exc().rstrip())
    log.info(
        f"SGLANG_SIM_GPU_MEM_GIB: holding {gib:.2f} GiB of GPU memory on cuda:{index} "
        f"({torch.cuda.get_device_name(index)}, CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    )
    return block


def _real_cuda_oom(cfg: ChildConfig, log: SimLog, held: list[Any]) -> None:
    """Allocate on the rank's device until torch raises OutOfMemoryError; fail with its text."""
    torch = _torch(log, "SGLANG_SIM_FAIL=real_cuda_oom was asked")
    if torch is None:
        _report_failure(
            cfg, log, load_failure("cuda_oom", gpu=cfg.rank, mfs=cfg.mem_fraction_static)
        )
        return
    index = cfg.rank % torch.cuda.device_count()
    chunk = 4 * 2**30
    try:
        while True:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{index}"))
            except torch.OutOfMemoryError:
                if chunk <= 2**28:
                    raise
                chunk //= 4
    except torch.OutOfMemoryError:
        _report_failure(cfg, log, "Scheduler hit an exception: " + traceback.format_exc().rstrip())


def _fail_later(cfg: ChildConfig, log: SimLog, serving: threading.Event, after: float) -> None:
    serving.wait()
    time.sleep(after)
    _report_failure(cfg, log, runtime_cuda_oom(cfg.rank))


def run_scheduler(cfg: ChildConfig, log: SimLog, serving: threading.Event) -> None:
    """The simulated load, its failure points, then report ready and idle."""
    held: list[Any] = []
    fail = cfg.fail if cfg.rank == 0 else None
    mfs = cfg.mem_fraction_static
    t_weights, t_kv, t_graph = (cfg.load_seconds * f for f in (0.6, 0.1, 0.3))
    avail = GPU_TOTAL_GB - 0.51

    def fail_now(mode: str) -> None:
        _report_failure(cfg, log, load_failure(mode, gpu=cfg.rank, mfs=mfs))

    if fail == "deep_gemm":  # raised when model_runner is imported, before any weight moves
        fail_now("deep_gemm")
    log.info(f"Load weight begin. avail mem={avail:.2f} GB")
    if cfg.gpu_mem_gib:
        held.append(_hold_gpu_memory(cfg, log, cfg.gpu_mem_gib))
    if fail == "real_cuda_oom":
        _real_cuda_oom(cfg, log, held)
    if fail in ("cuda_oom", "host_oom"):
        time.sleep(t_weights / 2)
        if fail == "host_oom":  # the kernel's OOM killer: no Python cleanup, no SIGQUIT
            os.kill(os.getpid(), signal.SIGKILL)
        fail_now("cuda_oom")
    time.sleep(t_weights)
    avail -= WEIGHTS_GB
    log.info(
        f"Load weight end. elapsed={t_weights:.2f} s, type=LlamaForCausalLM, "
        f"avail mem={avail:.2f} GB, mem usage={WEIGHTS_GB:.2f} GB."
    )
    if fail in ("not_enough_memory", "weights_leave_no_memory"):
        fail_now(fail)
    half = cfg.kv_cache_gb / 2
    log.info(
        f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {cfg.max_total_tokens}, "
        f"K size: {half:.2f} GB, V size: {half:.2f} GB"
    )
    avail -= cfg.kv_cache_gb
    log.info(f"Memory pool end. avail mem={avail:.2f} GB")
    if fail == "attention_backend":
        fail_now("attention_backend")
    time.sleep(t_kv)
    log.info(
        f"Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
        f"avail mem={avail:.2f} GB"
    )
    if fail == "cuda_graph":
        time.sleep(t_graph / 2)
        fail_now("cuda_graph")
    time.sleep(t_graph)
    log.info(
        f"Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 24, 32], "
        f"elapsed={t_graph:.2f} s, mem usage={GRAPH_GB:.2f} GB, "
        f"avail mem={avail - GRAPH_GB:.2f} GB."
    )
    log.info(
        f"max_total_num_tokens={cfg.max_total_tokens}, "
        f"chunked_prefill_size={cfg.chunked_prefill_size}, "
        f"max_prefill_tokens=16384, max_running_requests={cfg.max_running_requests}, "
        f"context_len={cfg.context_len}, available_gpu_mem={avail - GRAPH_GB:.2f} GB"
    )
    os.write(cfg.ready_fd, b"ready\n")
    os.close(cfg.ready_fd)
    if cfg.fail_after is not None and cfg.rank == 0:
        threading.Thread(
            target=_fail_later, args=(cfg, log, serving, cfg.fail_after), daemon=True
        ).start()


def child_main() -> None:
    """Entry point of `python -m sglang_farm.sim.scheduler` (started by the launcher only)."""
    cfg = ChildConfig.from_json(os.environ.pop(CHILD_ENV))
    # Die with the launcher, as SGLang's `kill_itself_when_parent_died` arranges.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg.parent_pid:
        os._exit(0)  # the launcher died before prctl took effect
    _prctl(_PR_SET_NAME, cfg.title.encode()[:15])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.executable:
        # argv[0] is the process title, so Python could not work out its own path.
        sys.executable = os.path.realpath("/proc/self/exe")
    serving = threading.Event()
    threading.Thread(target=_watch_parent, args=(serving,), daemon=True).start()
    if cfg.role == "scheduler":
        log = SimLog(f" TP{cfg.rank}" if cfg.tp_size > 1 else "")
        run_scheduler(cfg, log, serving)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    child_main()
