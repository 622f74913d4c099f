"""Pure: the text SGLang writes, verbatim where docs/reference/sglang.md (§10, §11) records it.

Log lines are `[%Y-%m-%d %H:%M:%S{ TPn}] message`; tracebacks are plausible
frames around the exact exception line a log classifier greps for.
"""

# ruff: noqa: E501 - verbatim SGLang/torch texts and traceback frames, kept whole to grep

from __future__ import annotations

import time

_SITE = "/opt/sglang/lib/python3.11/site-packages"

# torch's own OOM text (docs/reference/nvml.md §8), as PyTorch prints it in full, with
# figures an H200 (139.80 GiB) can show: in use and free add up to its capacity (issue 31:
# "Tried to allocate 372.53 GiB" on a 140 GiB GPU, a deliberate test's figure, read as
# nonsense in a demo). While loading: a weight shard that no longer fits.
TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU {gpu} has a total "
    "capacity of 139.80 GiB of which 611.56 MiB is free. Including non-PyTorch memory, this process has "
    "139.19 GiB memory in use. Of the allocated memory 137.90 GiB is allocated by PyTorch, and 412.37 MiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

# While serving: a forward pass's activations past what the static pool left (the figures
# of the two-GPU run's OOM, docs/reference/nvml.md §8).
TORCH_OOM_SERVING = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. GPU {gpu} has a total "
    "capacity of 139.80 GiB of which 37.12 MiB is free. Including non-PyTorch memory, this process has "
    "139.76 GiB memory in use. Of the allocated memory 135.31 GiB is allocated by PyTorch, and 2.87 GiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

NOT_ENOUGH_MEMORY = (
    "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
    "Current value: mem_fraction_static={mfs}"
)

WEIGHTS_LEAVE_NO_MEMORY = (
    "ValueError: Loaded weights leave no GPU memory for the KV cache under "
    "--mem-fraction-static={mfs}. Raise --mem-fraction-static above {above} "
    "(minimum viable = 1 - available/pre = {minimum})."
)

CUDA_GRAPH_FAILED = (
    "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {gpu} has a "
    "total capacity of 139.80 GiB of which 1.12 GiB is free.\n"
    "Possible solutions:\n"
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
    "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)\n"
    "3. disable decode CUDA graph by --cuda-graph-backend-decode=disabled. (Not recommended. Huge performance loss)\n"
    "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose "
)

FA3_ASSERT = (
    "AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. "
    "Please use --attention-backend flashinfer."
)

HOST_OOM = (
    "RuntimeError: Rank {rank} scheduler died during initialization (exit code: {code}). If exit code is -9 "
    "(SIGKILL), a common cause is the OS OOM killer. Run dmesg -T | grep -i oom to check."
)

BAD_FLAG_ARGV = ("--mamba-scheduler-strategy", "extra_buffer")

SCHEDULER_SIGQUIT_AT_LAUNCH = (
    "Received sigquit from a child process. It usually means the child failed."
)
SCHEDULER_SIGQUIT_RUNNING = (
    "SIGQUIT received. signum=3, frame=None. It usually means one child failed."
)
STOP_DRAIN = "{name} received. signum={num}, frame=None. Draining requests and shutting down..."
DRAIN_REMAINING = "Gracefully exiting... Remaining number of requests {num}."
FORCE_EXIT_UNHEALTHY = "Signal SIGTERM received while health check failed. Force exiting."
FORCE_EXIT_FLAG = "Signal SIGTERM received while force shutdown flag set. Force exiting."
READY = "The server is fired up and ready to roll!"


def stamp(when: float, prefix: str = "") -> str:
    """`[2025-01-31 12:00:00 TP0]`: SGLang's log prefix (local time, as logging.Formatter uses)."""
    return "[" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + prefix + "]"


def uvicorn(level: str, message: str) -> str:
    """uvicorn's `levelprefix` as SGLang configures it: `INFO:     Uvicorn running on ...`."""
    return f"{level}:".ljust(9) + " " + message


def _frames(*frames: tuple[str, int, str, str]) -> str:
    out = ["Traceback (most recent call last):"]
    for path, line, func, code in frames:
        prefix = "" if path.startswith(("/", "<")) else _SITE + "/"
        out.append(f'  File "{prefix}{path}", line {line}, in {func}')
        out.append(f"    {code}")
    return "\n".join(out)


# The outermost frame of `python -m sglang.launch_server`.
_RUNPY = (
    "<frozen runpy>",
    198,
    "_run_module_as_main",
    "return _run_code(code, main_globals, None,",
)
_SCHED = (
    "sglang/srt/managers/scheduler.py",
    3120,
    "run_scheduler_process",
    "scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)",
)
_SCHED_INIT = ("sglang/srt/managers/scheduler.py", 412, "__init__", "self.init_model_worker()")
_TP_WORKER = (
    "sglang/srt/managers/tp_worker.py",
    246,
    "__init__",
    "self.model_runner = ModelRunner(",
)
_RUNNER = (
    "sglang/srt/model_executor/model_runner.py",
    371,
    "__init__",
    "self.initialize(min_per_gpu_memory)",
)


def scheduler_exception(exception_text: str, *frames: tuple[str, int, str, str]) -> str:
    """`Scheduler hit an exception: Traceback ...` as `run_scheduler_process` logs it."""
    return "Scheduler hit an exception: " + _frames(*frames) + "\n" + exception_text


def _model_load_exception(exception_text: str, *frames: tuple[str, int, str, str]) -> str:
    """A scheduler exception raised while building the model runner: the shared outer
    frames (scheduler, tp_worker, `ModelRunner.__init__`), then `frames`."""
    return scheduler_exception(exception_text, _SCHED, _SCHED_INIT, _TP_WORKER, _RUNNER, *frames)


def load_failure(mode: str, *, gpu: int, mfs: float) -> str:
    """The scheduler's log text for a failure while loading (`mode` is a FailMode value)."""
    if mode in ("cuda_oom", "real_cuda_oom"):
        return _model_load_exception(
            TORCH_OOM.format(gpu=gpu),
            (
                "sglang/srt/model_executor/model_runner.py",
                912,
                "load_model",
                "self.model = self.loader.load_model(model_config=self.model_config, device_config=...)",
            ),
            ("torch/nn/modules/module.py", 1355, "to", "return self._apply(convert)"),
        )
    if mode == "not_enough_memory":
        return _model_load_exception(
            NOT_ENOUGH_MEMORY.format(mfs=mfs),
            (
                "sglang/srt/model_executor/model_runner.py",
                1402,
                "init_memory_pool",
                "config = MemoryPoolConfig(**self.pool_configurator.compute())",
            ),
            (
                "sglang/srt/model_executor/pool_configurator.py",
                88,
                "__post_init__",
                'raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static. "',
            ),
        )
    if mode == "weights_leave_no_memory":
        above = round(min(mfs + 0.12, 0.99), 2)
        return _model_load_exception(
            WEIGHTS_LEAVE_NO_MEMORY.format(mfs=mfs, above=above, minimum=round(above - 0.05, 3)),
            (
                "sglang/srt/mem_cache/kv_cache_configurator.py",
                143,
                "configure",
                "raise ValueError(",
            ),
        )
    if mode == "cuda_graph":
        return _model_load_exception(
            CUDA_GRAPH_FAILED.format(gpu=gpu),
            (
                "sglang/srt/model_executor/model_runner.py",
                1580,
                "init_device_graphs",
                "self.graph_runner = DecodeCudaGraphRunner(self)",
            ),
            (
                "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py",
                301,
                "__init__",
                'raise Exception(f"Capture cuda graph failed: {e}\\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}")',
            ),
        )
    if mode == "deep_gemm":
        return scheduler_exception(
            "AssertionError",
            _SCHED,
            (
                "sglang/srt/managers/scheduler.py",
                31,
                "<module>",
                "from sglang.srt.model_executor.model_runner import ModelRunner",
            ),
            (
                "sglang/srt/model_executor/model_runner.py",
                77,
                "<module>",
                "from sglang.srt.layers import deep_gemm_wrapper",
            ),
            (
                "sglang/srt/layers/deep_gemm_wrapper/configurer.py",
                14,
                "<module>",
                "import deep_gemm",
            ),
            (
                "deep_gemm/__init__.py",
                95,
                "<module>",
                "_C.init(os.path.dirname(os.path.abspath(__file__)), find_cuda_home())",
            ),
            ("deep_gemm/cuda_helpers.py", 32, "find_cuda_home", "assert cuda_home is not None"),
        )
    if mode == "attention_backend":
        return _model_load_exception(
            FA3_ASSERT,
            (
                "sglang/srt/model_executor/model_runner.py",
                1490,
                "init_attention_backend",
                "self.attn_backend = self._get_attention_backend()",
            ),
            (
                "sglang/srt/layers/attention/attention_registry.py",
                120,
                "create_flashattention_v3_backend",
                "assert (",
            ),
        )
    raise ValueError(f"no load-failure text for mode {mode!r}")


def runtime_cuda_oom(gpu: int) -> str:
    """A CUDA OOM raised in a forward pass while serving (SGLang does not catch it)."""
    return scheduler_exception(
        TORCH_OOM_SERVING.format(gpu=gpu),
        (
            "sglang/srt/managers/scheduler.py",
            3135,
            "run_scheduler_process",
            "scheduler.event_loop_overlap()",
        ),
        (
            "sglang/srt/managers/scheduler.py",
            1062,
            "event_loop_overlap",
            "batch_result = self.run_batch(batch)",
        ),
        (
            "sglang/srt/managers/scheduler.py",
            2210,
            "run_batch",
            "batch_result = self.model_worker.forward_batch_generation(model_worker_batch)",
        ),
        (
            "sglang/srt/model_executor/model_runner.py",
            2304,
            "forward",
            "output = self._forward_raw(forward_batch, skip_attn_backend_init, pp_proxy_tensors)",
        ),
    )


def sgl_kernel_import_error(cc: str = "9.0") -> str:
    """The uncaught ImportError the main process prints when sgl_kernel has no usable common_ops."""
    frames = _frames(
        _RUNPY,
        (
            "sglang/launch_server.py",
            7,
            "<module>",
            "from sglang.srt.entrypoints.http_server import launch_server",
        ),
        (
            "sglang/srt/entrypoints/http_server.py",
            74,
            "<module>",
            "from sglang.srt.entrypoints.engine import _launch_subprocesses",
        ),
        (
            "sglang/srt/entrypoints/engine.py",
            51,
            "<module>",
            "from sglang.srt.managers.scheduler import run_scheduler_process",
        ),
        ("sgl_kernel/__init__.py", 5, "<module>", "common_ops = _load_architecture_specific_ops()"),
        (
            "sgl_kernel/load_utils.py",
            188,
            "_load_architecture_specific_ops",
            "raise ImportError(error_msg)",
        ),
    )
    variant = "sm90" if cc == "9.0" else "sm100"
    return (
        frames + "\n"
        "ImportError: \n"
        "[sgl_kernel] CRITICAL: Could not load any common_ops library!\n\n"
        "Attempted locations:\n"
        f"1. Architecture-specific pattern: {_SITE}/sgl_kernel/{variant}/common_ops.* - found files: "
        f"['{_SITE}/sgl_kernel/{variant}/common_ops.abi3.so']\n"
        f"2. Fallback pattern: {_SITE}/sgl_kernel/common_ops.* - found files: []\n"
        "3. Standard Python import: common_ops - failed\n\n"
        "GPU Info:\n"
        f"- Compute capability: {cc.replace('.', '')}\n"
        f"- Expected variant: {variant}\n"
        "- CUDA version: 12.9\n\n"
        "Please ensure sgl_kernel is properly installed with:\n"
        "pip install --upgrade sglang-kernel\n\n"
        "Error details from previous import attempts:\n"
        f"- ImportError: {_SITE}/sgl_kernel/{variant}/common_ops.abi3.so: undefined symbol: "
        "_ZN3c104cuda9SetDeviceEab\n"
        "- ModuleNotFoundError: No module named 'common_ops'\n"
    )


def served_model_name_colon(name: str) -> str:
    """The pre-spawn validation failure for a served model name with a colon (exit 1)."""
    return (
        _frames(
            _RUNPY,
            (
                "sglang/launch_server.py",
                24,
                "<module>",
                "server_args = prepare_server_args(sys.argv[1:])",
            ),
            (
                "sglang/srt/arg_groups/validation_hook.py",
                61,
                "validate_serving",
                'assert ":" not in served_model_name, "served_model_name cannot contain a colon"',
            ),
        )
        + f"\nAssertionError: served_model_name cannot contain a colon (got {name!r})\n"
    )


def host_oom_main(rank: int, code: int) -> str:
    """What the main process prints when a scheduler vanished before reporting ready (exit 1)."""
    return (
        _frames(
            _RUNPY,
            ("sglang/launch_server.py", 32, "<module>", "launch_server(server_args)"),
            (
                "sglang/srt/entrypoints/http_server.py",
                1702,
                "launch_server",
                "tokenizer_manager, template_manager, scheduler_info, port_args = _launch_subprocesses(",
            ),
            (
                "sglang/srt/entrypoints/engine.py",
                1021,
                "_wait_for_scheduler_ready",
                "raise _scheduler_died_error(rank, proc)",
            ),
        )
        + "\n"
        + HOST_OOM.format(rank=rank, code=code)
        + "\n"
    )
