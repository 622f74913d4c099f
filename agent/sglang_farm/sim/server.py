"""I/O: the simulator's launcher process, shaped like `python -m sglang.launch_server`.

It parses the flags, logs `server_args=...`, spawns the scheduler(s) and the
detokenizer in its own process group, waits for every scheduler's ready message
(the HTTP port stays unbound meanwhile), binds, warms up and serves. Exits, as
SGLang's (docs/reference/sglang.md §13): 0 after a SIGTERM drain; -9 (it SIGKILLs its
children, then itself) when a child reports a failure by SIGQUIT or dies while
serving; 1 when a scheduler vanishes during init or a pre-spawn check fails;
2 for argparse errors; 3 when the port cannot be bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType

from sglang_farm.sim import texts
from sglang_farm.sim.engine import Engine
from sglang_farm.sim.exposition import MetricContext
from sglang_farm.sim.log import SimLog
from sglang_farm.sim.options import WEIGHTS_GB, ServerOptions, parse_options
from sglang_farm.sim.scheduler import CHILD_ENV, GRAPH_GB, ChildConfig
from sglang_farm.sim.settings import FailMode, SettingsError, SimSettings, load_settings
from sglang_farm.sim.web import ServerState, SimHTTPServer, Status, bind

_PUBLISH_PERIOD_S = 0.1  # how often the simulated scheduler refreshes /v1/loads and its gauges
_DRAIN_LOG_PERIOD_S = 5.0  # SGLang's sigterm_watchdog logs the remaining count every 5 s
_WATCHDOG_PERIOD_S = 0.5  # SGLang's SubprocessWatchdog polls every 1 s; faster keeps tests short


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    ready_fd: int  # read end of its ready pipe; -1 for the detokenizer


class Launcher:
    """One simulated SGLang server, from argv to exit status."""

    def __init__(
        self, opts: ServerOptions, settings: SimSettings, log: SimLog, argv: list[str]
    ) -> None:
        self.opts = opts
        self.settings = settings
        self.log = log
        self.argv = argv
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self.serving = False
        self.shutting_down = False
        self.t0 = time.monotonic()

    # -- signals ---------------------------------------------------------------------------

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        self.stop_signal = signum

    def _on_sigquit(self, _signum: int, _frame: FrameType | None) -> None:
        self.log.info(
            texts.SCHEDULER_SIGQUIT_RUNNING if self.serving else texts.SCHEDULER_SIGQUIT_AT_LAUNCH
        )
        self._kill_children(wait=False)
        # kill_process_tree(getpid()) ends with the caller itself: Python sees returncode -9.
        os.kill(os.getpid(), signal.SIGKILL)

    def _install_signals(self) -> None:
        if self.settings.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGQUIT, self._on_sigquit)

    # -- children --------------------------------------------------------------------------

    def _child_config(self, role: str, rank: int, ready_fd: int) -> ChildConfig:
        o, s = self.opts, self.settings
        return ChildConfig(
            role=role,
            rank=rank,
            parent_pid=os.getpid(),
            ready_fd=ready_fd,
            tp_size=o.tp_size,
            load_seconds=s.load_seconds,
            fail=s.fail.value if s.fail else None,
            fail_after=s.fail_after,
            gpu_mem_gib=s.gpu_mem_gib,
            mem_fraction_static=o.mem_fraction_static,
            max_total_tokens=o.max_total_tokens,
            kv_cache_gb=round(o.kv_cache_gb, 2),
            max_running_requests=o.max_running_requests,
            context_len=o.context_length,
            chunked_prefill_size=o.chunked_prefill_size,
        )

    def _spawn(self, role: str, rank: int) -> Child:
        read_fd, write_fd = os.pipe() if role == "scheduler" else (-1, -1)
        cfg = self._child_config(role, rank, write_fd)
        env = dict(os.environ)
        env[CHILD_ENV] = cfg.to_json()
        # argv[0] is the title `ps` shows (`sglang::scheduler`), which hides the venv from
        # Python's prefix search, so hand the child our import path explicitly.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen(
            [cfg.title, "-m", "sglang_farm.sim.scheduler"],
            executable=sys.executable or "python3",
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,) if write_fd >= 0 else (),
            env=env,
        )
        if write_fd >= 0:
            os.close(write_fd)
        return Child(cfg.title.removeprefix("sglang::"), proc, read_fd)

    def _kill_children(self, *, wait: bool) -> None:
        for child in self.children:
            with contextlib.suppress(OSError):
                child.proc.kill()
        if wait:
            for child in self.children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=5)

    def _wait_ready(self) -> int | None:
        """Block until every scheduler is ready; an exit status when startup ended otherwise."""
        import select  # only the launcher needs it

        pending = {c.ready_fd: c for c in self.children if c.ready_fd >= 0}
        while pending:
            if self.stop_signal is not None:
                return self._shutdown()
            readable, _, _ = select.select(list(pending), [], [], 0.2)
            for fd in readable:
                data = os.read(fd, 64)
                if b"ready" in data:
                    del pending[fd]
                    os.close(fd)
                elif not data:
                    child = pending.pop(fd)
                    try:
                        code = child.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = -1
                    rank = int(child.name.rpartition("TP")[2] or 0) if "TP" in child.name else 0
                    self.log.raw(texts.host_oom_main(rank, code))
                    self._kill_children(wait=True)
                    return 1
        return None

    def _watchdog(self) -> None:
        """SGLang's SubprocessWatchdog: a child that dies while serving takes the server down."""
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if self.shutting_down:
                return
            for child in self.children:
                code = child.proc.poll()
                if code is not None and not self.shutting_down:
                    self.log.info(
                        f"Subprocess {child.name} (pid={child.proc.pid}) crashed with exit code "
                        f"{code}. Triggering SIGQUIT for cleanup..."
                    )
                    os.kill(os.getpid(), signal.SIGQUIT)
                    return

    def _tell_children(self, message: bytes) -> None:
        for child in self.children:
            try:
                if child.proc.stdin is not None:
                    child.proc.stdin.write(message)
                    child.proc.stdin.flush()
            except OSError:
                pass

    # -- serving ---------------------------------------------------------------------------

    def _warmup(self, state: ServerState) -> None:
        t = time.monotonic()
        if not self.opts.skip_server_warmup:
            # SGLang's warmup: POST /generate "The capital city of France is", max_new_tokens=8.
            state.engine.generate(6, 8)
            time.sleep(max(0.0, self.settings.warmup_seconds - (time.monotonic() - t)))
        state.status = Status.UP
        self.serving = True
        self.log.info(texts.READY)
        self._tell_children(b"serving\n")
        for after, fault in (
            (self.settings.hang_after, state.engine.hang),
            (self.settings.wedge_after, state.engine.wedge),
        ):
            if after is not None:
                timer = threading.Timer(after, fault)
                timer.daemon = True  # a SIGTERM before the fault must not wait for it
                timer.start()

    def _publisher(self, state: ServerState) -> None:
        while not self.shutting_down:
            state.engine.publish()
            time.sleep(_PUBLISH_PERIOD_S)

    def _shutdown(
        self, state: ServerState | None = None, server: SimHTTPServer | None = None
    ) -> int:
        signum = self.stop_signal or signal.SIGTERM
        self.log.info(texts.STOP_DRAIN.format(name=signal.Signals(signum).name, num=int(signum)))
        if state is not None:
            state.exiting.set()
            self._drain(state)
        self.shutting_down = True
        self._kill_children(wait=True)
        if server is not None:
            self.log.uvicorn("INFO", "Shutting down")
            server.shutdown()
            server.server_close()
            self.log.uvicorn("INFO", "Waiting for application shutdown.")
            self.log.uvicorn("INFO", "Application shutdown complete.")
            self.log.uvicorn("INFO", f"Finished server process [{os.getpid()}]")
        return 0

    def _drain(self, state: ServerState) -> None:
        """Wait for in-flight generations, as `TokenizerManager.sigterm_watchdog` does.

        SGLang waits with no bound (SGLANG_SIM_DRAIN_SECONDS adds one), logging the
        remaining count every 5 s, and keeps admitting new requests meanwhile; it skips
        the drain when a health check has failed or SGL_FORCE_SHUTDOWN is set.
        Unlike SGLang, which looks every 5 s, the simulator exits as soon as it is idle.
        """
        if state.unhealthy:
            self.log.info(texts.FORCE_EXIT_UNHEALTHY)
            return
        if self.settings.force_shutdown:
            self.log.info(texts.FORCE_EXIT_FLAG)
            return
        bound = self.settings.drain_seconds
        deadline = None if bound is None else time.monotonic() + bound
        while True:
            remaining = state.generation_in_flight()
            self.log.info(texts.DRAIN_REMAINING.format(num=remaining))
            if remaining == 0:
                return
            wait = _DRAIN_LOG_PERIOD_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            if state.wait_idle(wait):
                return

    def run(self) -> int:
        o, s = self.opts, self.settings
        self._install_signals()
        self.log.info(f"server_args={o.server_args_repr()}")
        # Pre-spawn failures: an uncaught exception in the main process, exit status 1.
        if ":" in o.served_model_name:
            self.log.raw(texts.served_model_name_colon(o.served_model_name))
            return 1
        if s.fail is FailMode.SGL_KERNEL:
            self.log.raw(texts.sgl_kernel_import_error())
            return 1
        for rank in range(o.tp_size):
            self.children.append(self._spawn("scheduler", rank))
        self.children.append(self._spawn("detokenizer", 0))
        code = self._wait_ready()
        if code is not None:
            return code
        startup = time.monotonic() - self.t0
        self.log.info(
            f"Engine startup timings (s): load_weight={s.load_seconds * 0.6:.2f}, "
            f"kv_cache_allocation={s.load_seconds * 0.1:.2f}, scheduler_e2e={startup:.2f}"
        )
        engine = Engine(
            max_running=o.max_running_requests,
            max_queued=o.max_queued_requests,
            max_total_tokens=o.max_total_tokens,
            token_seconds=s.token_seconds,
            prefill_token_seconds=s.prefill_token_seconds,
            prefix_cache_tokens=0
            if o.disable_radix_cache
            else (
                s.prefix_cache_tokens if s.prefix_cache_tokens is not None else o.max_total_tokens
            ),
        )
        ctx = MetricContext(
            model_name=o.served_model_name,
            extra_labels=o.extra_metric_labels,
            context_len=o.context_length,
            page_size=o.page_size,
            weight_gb=WEIGHTS_GB,
            kv_cache_gb=round(o.kv_cache_gb, 2),
            graph_gb=GRAPH_GB,
        )
        launch = shlex.join([sys.executable, "-m", "sglang_farm.sim", *self.argv])
        if o.api_key:
            launch = launch.replace(o.api_key, "<redacted>")
        state = ServerState(
            opts=o,
            settings=s,
            engine=engine,
            ctx=ctx,
            log=self.log,
            launch_command=launch,
            startup_time=round(startup, 3),
        )
        self.log.uvicorn("INFO", f"Started server process [{os.getpid()}]")
        self.log.uvicorn("INFO", "Waiting for application startup.")
        self.log.uvicorn("INFO", "Application startup complete.")
        try:
            if s.fail is FailMode.PORT_IN_USE:
                raise OSError(errno.EADDRINUSE, "address already in use")
            server = bind(o.host, o.port, state)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            self.log.uvicorn(
                "ERROR",
                f"[Errno {exc.errno}] error while attempting to bind on address "
                f"({o.host!r}, {o.port}): {reason}",
            )
            self.log.uvicorn("INFO", "Waiting for application shutdown.")
            self.log.uvicorn("INFO", "Application shutdown complete.")
            self.shutting_down = True
            self._kill_children(wait=True)
            return 3  # uvicorn's STARTUP_FAILURE
        threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True).start()
        shown_host = f"[{o.host}]" if ":" in o.host else o.host
        self.log.uvicorn(
            "INFO", f"Uvicorn running on http://{shown_host}:{o.port} (Press CTRL+C to quit)"
        )
        threading.Thread(target=self._publisher, args=(state,), daemon=True).start()
        threading.Thread(target=self._watchdog, daemon=True).start()
        threading.Thread(target=self._warmup, args=(state,), daemon=True).start()
        while self.stop_signal is None:
            time.sleep(0.1)
        return self._shutdown(state, server)


def main(argv: list[str] | None = None) -> int:
    """`python -m sglang_farm.sim [SGLang flags...]`; returns the exit status (module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    log = SimLog()
    try:
        settings = load_settings(os.environ)
    except SettingsError as exc:
        log.raw(f"sglang-farm sim: {exc}\n")
        return 2
    if settings.fail is FailMode.BAD_FLAG:
        args += texts.BAD_FLAG_ARGV
    try:
        opts, _ignored = parse_options(args)
    except SystemExit as exc:  # argparse has printed its usage and error
        return exc.code if isinstance(exc.code, int) else 2
    return Launcher(opts, settings, log, args).run()
