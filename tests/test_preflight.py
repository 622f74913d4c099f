"""The preflight doctor against fake SGLang environments (fake_sglang_env.py), on a fake
SM 12.0 host: a `torch`, an `sgl_kernel`, a `deep_gemm` and a `sglang` put on the probe's
PYTHONPATH (that module says what each fakes). The probe runs for real, with this
interpreter, as the doctor runs it on a host.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner
from structlog.testing import capture_logs

from fake_sglang_env import (
    GIB,
    REPO,
    SEED_TOML,
    FakeEnv,
    Sm120Poller,
    _by_id,
    _demo_with_gateway,
    _fails,
    _free_base,
    _with_worker_flags,
    fake_runner,
    make_fake_env,
    seed_spec,
)
from sglang_farm.cli.doctor import doctor
from sglang_farm.cli.main import cli
from sglang_farm.config import load_spec
from sglang_farm.doctor import (
    Check,
    CheckId,
    DoctorReport,
    Observations,
    Status,
    arch_covers,
    backend_verdict,
    evaluate,
    format_report,
    make_probe_runner,
    preflight_blocking,
    run_doctor,
)
from sglang_farm.doctor.checks import ProbeOutcome
from sglang_farm.gpus import nvml as gpu
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.sglang.commands import resolve_attention_backend, resolve_flags
from sglang_farm.spec import FarmSpec

# --- the fake environment --------------------------------------------------------------


def make_fixed_env(root: Path, *, sglang_version: str = "0.5.23") -> FakeEnv:
    """The seed host repaired: torch with sm_120, sglang-kernel 0.4.10 (sm_120a in sm100/),
    flashinfer installed. deep_gemm still needs CUDA_HOME: `fixed_farm_env`."""
    return make_fake_env(
        root,
        torch_archs=("sm_80", "sm_90", "sm_100", "sm_120"),
        sm100_archs=("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100f", "sm_120a"),
        kernel_version="0.4.10",
        flashinfer=True,
        sglang_version=sglang_version,
    )


def fixed_farm_env(env: FakeEnv) -> str:
    return f'{{ CUDA_HOME = "{env.nvcc_home}" }}'


# --- the seed's three launch failures, end to end ---------------------------------------


def test_doctor_fails_the_seed_config_with_the_seed_reasons_and_fixes(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env")
    spec = seed_spec(tmp_path, attention="fa3")
    report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
    fails = _fails(report)
    assert not report.ok
    # 1. deep_gemm asserted: CUDA_HOME unset, no toolkit.
    gemm = fails[CheckId.DEEP_GEMM]
    assert "AssertionError" in gemm.message and "cuda_home is not None" in gemm.message
    assert "CUDA_HOME=/usr/local/cuda-12.x" in gemm.fix
    assert "SGLANG_ENABLE_JIT_DEEPGEMM=0" in gemm.fix and "[farm].env" in gemm.fix
    # 2. sgl_kernel 0.4.2.post2 ships sm90/ and sm100/ without SM 12.0: the import fails.
    kernel = fails[CheckId.SGL_KERNEL]
    assert "[sgl_kernel] CRITICAL: Could not load any common_ops library!" in kernel.message
    assert "SM 12.0" in kernel.message and "sm90/, sm100/" in kernel.message
    assert "0.4.2.post2" in kernel.message and "pip install --upgrade sglang-kernel" in kernel.fix
    # 3. A backend SM 12.0 cannot run.
    att = fails[CheckId.ATTENTION_BACKEND]
    assert "attention_backend = fa3" in att.message and "SM 12.0" in att.message
    assert 'attention_backend = "flashinfer"' in att.fix
    # torch cu130 here lacks sm_120 in its arch list.
    assert "sm_120" in fails[CheckId.TORCH].message
    # Every worker is blocked, and each failure shows once for all eight.
    for check in (gemm, kernel, att):
        assert check.workers == tuple(range(8))
    for w in range(8):
        assert {c.id for c in report.blocking(w)} >= {
            CheckId.DEEP_GEMM,
            CheckId.SGL_KERNEL,
            CheckId.ATTENTION_BACKEND,
        }
    text = format_report(report)
    assert "FAIL" in text and "0-7" in text and "fix: set CUDA_HOME" in text
    assert "NOT OK" in text


def test_doctor_passes_the_seed_config_once_fixed(tmp_path: Path) -> None:
    env = make_fixed_env(tmp_path / "env")
    spec = seed_spec(tmp_path, env=fixed_farm_env(env))
    report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
    assert report.ok, format_report(report)
    assert report.blocking(0) == []
    statuses = {c.id: c.status for c in report.checks}
    for cid in (
        CheckId.DEEP_GEMM,
        CheckId.SGL_KERNEL,
        CheckId.ATTENTION_BACKEND,
        CheckId.FLAGS,
        CheckId.TORCH,
        CheckId.FLASHINFER,
        CheckId.MODEL_PATH,
        CheckId.PORT_HTTP,
        CheckId.PORT_NCCL,
        CheckId.GPU,
    ):
        assert statuses[cid] is Status.PASS, cid
    gemm = _by_id(report, CheckId.DEEP_GEMM)[0]
    assert str(env.nvcc_home) in gemm.message and "CUDA_HOME" in gemm.message
    assert dict(report.attention) == dict.fromkeys(range(8), "flashinfer")
    assert "sglang-kernel 0.4.10 imports" in _by_id(report, CheckId.SGL_KERNEL)[0].message


def test_deep_gemm_disabled_in_farm_env_passes_without_a_toolkit(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env")
    spec = seed_spec(tmp_path, env='{ SGLANG_ENABLE_JIT_DEEPGEMM = "0" }')
    report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
    (gemm,) = _by_id(report, CheckId.DEEP_GEMM)
    assert gemm.status is Status.PASS
    assert "SGLANG_ENABLE_JIT_DEEPGEMM=0" in gemm.message


def test_flags_are_checked_against_the_installed_parser(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    # mem_frac: an abbreviation argparse accepts; cuda_graph_max_bs: removed, ambiguous;
    # context_length "8k": a value the parser rejects.
    spec = seed_spec(tmp_path, gpus=1, extra_sglang="mem_frac = 0.8\nmax_running = 3\n")
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    flags = _by_id(report, CheckId.FLAGS)
    prefix = [c for c in flags if c.status is Status.WARN]
    assert any(
        c.message.startswith("--mem-frac is not")
        and "--mem-fraction-static" in c.message
        and "mem_fraction_static" in c.fix
        for c in prefix
    ), flags
    assert any(
        "--max-running" in c.message and "--max-running-requests" in c.message for c in prefix
    )
    assert not [c for c in flags if c.status is Status.FAIL]


def test_renamed_and_unknown_flags_fail_with_the_precise_message(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(
        tmp_path,
        extra_sglang="enable_metric_labels = true\ncuda_graph_max_bs = 8\n",
        mamba_key="mamba_scheduler_strategy",
    )
    report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
    msgs = {c.message: c for c in _by_id(report, CheckId.FLAGS) if c.status is Status.FAIL}
    (renamed,) = [c for m, c in msgs.items() if m.startswith("--mamba-scheduler-strategy")]
    assert renamed.message == (
        "--mamba-scheduler-strategy is not a flag of SGLang 0.5.23 (argparse: unrecognized "
        "arguments, exit 2): SGLang 0.5.23 calls it --mamba-radix-cache-strategy"
    )
    assert renamed.fix == (
        "write mamba_radix_cache_strategy instead of mamba_scheduler_strategy "
        "in [sglang] (same values)"
    )
    # Split in two: argparse finds the old name ambiguous; the message names the new ones.
    (split,) = [c for m, c in msgs.items() if m.startswith("--cuda-graph-max-bs")]
    assert "ambiguous" in split.message
    assert "replaced by --cuda-graph-max-bs-decode" in split.message
    assert "cuda_graph_max_bs_decode and/or cuda_graph_max_bs_prefill" in split.fix
    assert any("--enable-metric-labels is not a flag" in m for m in msgs)


# --- flags are judged by the installed SGLang (0.5.12 on the seed host, 0.5.23) ---------------

# (installed SGLang, the key it accepts, the key it refuses, the spelling the refusal names)
_SPELLINGS = [
    (
        "0.5.12",
        "mamba_scheduler_strategy",
        "mamba_radix_cache_strategy",
        "--mamba-scheduler-strategy",
    ),
    (
        "0.5.23",
        "mamba_radix_cache_strategy",
        "mamba_scheduler_strategy",
        "--mamba-radix-cache-strategy",
    ),
]


@pytest.mark.parametrize(("version", "accepted", "refused", "names"), _SPELLINGS)
def test_the_doctor_accepts_the_installed_sglangs_spelling_of_a_renamed_flag(
    tmp_path: Path, version: str, accepted: str, refused: str, names: str
) -> None:
    env = make_fixed_env(tmp_path / "env", sglang_version=version)
    spec = seed_spec(
        tmp_path, env=fixed_farm_env(env), gpus=1, mamba_key=accepted, oom_mamba_key=accepted
    )
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    assert report.ok, format_report(report)
    (flags,) = _by_id(report, CheckId.FLAGS)
    assert flags.status is Status.PASS, flags
    assert _by_id(report, CheckId.SGLANG)[0].message == f"sglang {version} installed"


@pytest.mark.parametrize(("version", "accepted", "refused", "names"), _SPELLINGS)
def test_the_doctor_refuses_the_other_spelling_naming_the_installed_one(
    tmp_path: Path, version: str, accepted: str, refused: str, names: str
) -> None:
    env = make_fixed_env(tmp_path / "env", sglang_version=version)
    spec = seed_spec(
        tmp_path, env=fixed_farm_env(env), gpus=1, mamba_key=refused, oom_mamba_key=accepted
    )
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    assert not report.ok
    (fail,) = report.blocking(0)
    assert fail.id is CheckId.FLAGS
    assert fail.message.endswith(f"SGLang {version} calls it {names}")
    flag = "--" + refused.replace("_", "-")
    assert fail.message.startswith(f"{flag} is not a flag of SGLang {version}")
    assert fail.fix == f"write {accepted} instead of {refused} in [sglang] (same values)"


def test_an_oom_step_with_the_other_spelling_is_a_warning_naming_the_installed_one(
    tmp_path: Path,
) -> None:
    # The shipped farm.toml's ladder sets mamba_radix_cache_strategy; the seed runs 0.5.12.
    env = make_fixed_env(tmp_path / "env", sglang_version="0.5.12")
    spec = seed_spec(
        tmp_path, env=fixed_farm_env(env), gpus=1, mamba_key="mamba_scheduler_strategy"
    )
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    assert report.ok, format_report(report)
    (warn,) = [c for c in _by_id(report, CheckId.FLAGS) if c.status is Status.WARN]
    assert warn.message == (
        "OOM step 'mamba_no_buffer' changes --mamba-radix-cache-strategy, which SGLang 0.5.12 "
        "does not have: SGLang 0.5.12 calls it --mamba-scheduler-strategy"
    )
    assert "in that [[oom.steps]] table" in warn.fix


def test_check_config_accepts_either_spelling_and_warns_about_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # check-config has no SGLang at hand: it never refuses a flag that some SGLang
    # accepts (the doctor's parser decides), and names both versions for an old one.
    from sglang_farm.doctor import accounts

    # The seed's `sglang` accounts, which this machine may lack, are not this test's subject.
    monkeypatch.setattr(accounts, "host_account_problems", lambda spec: [])
    for key, warns in (("mamba_scheduler_strategy", True), ("mamba_radix_cache_strategy", False)):
        config = tmp_path / f"{key}.toml"
        text = (
            SEED_TOML.read_text()
            .replace('mamba_radix_cache_strategy = "extra_buffer"', f'{key} = "extra_buffer"')
            .replace('gpus = "all"', "gpus = [0, 1]")
            # Loopback: no warning about workers reachable without an API key.
            .replace('host = "0.0.0.0"', 'host = "127.0.0.1"')
        )
        config.write_text(text)
        line = text.splitlines().index(f'{key} = "extra_buffer"') + 1
        result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"{config}: OK, 2 workers")
        warning = (
            f"warning: {config}:{line}: sglang.mamba_scheduler_strategy: SGLang 0.5.23 "
            "renamed --mamba-scheduler-strategy to --mamba-radix-cache-strategy "
            "(sgl-project/sglang#27418); keep it for SGLang <= 0.5.22, write "
            "mamba_radix_cache_strategy for SGLang >= 0.5.23\n"
        )
        assert result.stderr == (warning if warns else "")


def test_without_sglang_the_doctor_warns_about_an_old_spelling(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", sglang=False)
    spec = seed_spec(tmp_path, gpus=1, mamba_key="mamba_scheduler_strategy")
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    warns = [c for c in _by_id(report, CheckId.FLAGS) if c.status is Status.WARN]
    assert [c.message.split(":")[0] for c in warns] == [
        "cannot validate flags",
        "mamba_scheduler_strategy",
    ]
    assert "keep it for SGLang <= 0.5.22" in warns[1].message


def test_a_bad_value_fails_with_argparse_error_line(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(tmp_path, gpus=1)
    spec2 = _with_worker_flags(spec, {**spec.workers[0].flags, "chunked_prefill_size": "8k"})
    report = run_doctor(spec2, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    (bad,) = [c for c in _by_id(report, CheckId.FLAGS) if c.status is Status.FAIL]
    assert "argument --chunked-prefill-size: invalid int value: '8k'" in bad.message


def test_without_sglang_the_flags_cannot_be_validated_and_it_says_so(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", sglang=False)
    spec = seed_spec(tmp_path, gpus=1)
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    (flags,) = _by_id(report, CheckId.FLAGS)
    assert flags.status is Status.WARN
    assert flags.message.startswith("cannot validate flags: sglang not importable")
    assert _fails(report)[CheckId.SGLANG].message.startswith("sglang is not installed")


def test_missing_interpreter_fails_the_environment_check(tmp_path: Path) -> None:
    spec = seed_spec(tmp_path, gpus=1)
    spec2 = replace(spec, farm=replace(spec.farm, python=str(tmp_path / "nope/python3")))
    report = run_doctor(spec2, Sm120Poller(count=1), run_probe=make_probe_runner(timeout=10))
    env_check = _fails(report)[CheckId.ENVIRONMENT]
    assert "does not exist" in env_check.message and "[farm] python" in env_check.fix


# --- ports, model, memory ----------------------------------------------------------------


def test_a_busy_port_fails_and_preflight_blocking_rechecks_it_live(tmp_path: Path) -> None:
    env = make_fixed_env(tmp_path / "env")
    spec = seed_spec(tmp_path, env=fixed_farm_env(env))
    w1 = spec.worker(1)
    listener = socket.socket()
    listener.bind((w1.host, w1.port))
    listener.listen()
    try:
        report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
        busy = [c for c in _by_id(report, CheckId.PORT_HTTP) if c.status is Status.FAIL]
        assert [c.workers for c in busy] == [(1,)]
        assert f"port {w1.port}" in busy[0].message and "base_port" in busy[0].fix
        assert [c.id for c in preflight_blocking(spec, 1, report)] == [CheckId.PORT_HTTP]
        assert preflight_blocking(spec, 0, report) == []
    finally:
        listener.close()
    # The port was freed: the stale verdict in the report no longer blocks.
    assert preflight_blocking(spec, 1, report) == []


LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "s.listen()\n"
    "print('bound', flush=True)\n"
    "time.sleep(120)\n"
)


def _listening(argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "bound", proc.stderr.read() if proc.stderr else line
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.communicate()


def test_a_port_its_own_running_worker_holds_passes_and_anyone_elses_fails(
    tmp_path: Path,
) -> None:
    """Issue 31 item 1: with the farm running, each worker's own port was reported as a
    conflict (`cannot bind: Address already in use`, 8 failed, NOT OK). The port held by
    the worker that owns it passes; held by another worker's process or another user's,
    it still fails."""
    from asuser import SETPRIV, require

    require()
    env = make_fixed_env(tmp_path / "env")
    spec = seed_spec(tmp_path, env=fixed_farm_env(env))
    w1 = spec.worker(1)
    runner = fake_runner(env, tmp_path)
    worker = _listening([sys.executable, "-I", "-c", LISTENER, str(w1.port)])
    try:
        pids = frozenset({worker.pid})

        def http(report: DoctorReport) -> Check:
            (c,) = [c for c in _by_id(report, CheckId.PORT_HTTP) if 1 in c.workers]
            return c

        own = run_doctor(spec, Sm120Poller(), run_probe=runner, worker_pids=lambda _s: {1: pids})
        assert http(own).status is Status.PASS
        assert http(own).message == f"HTTP port {w1.port} is worker 1's own (it runs)"
        assert not [c for c in own.checks if c.id is CheckId.PORT_HTTP and c.status is Status.FAIL]
        # Worker 2's process on worker 1's port, or no worker running: a conflict.
        running: list[Mapping[int, frozenset[int]]] = [{2: pids}, {}]
        for found in running:

            def seen(
                _s: FarmSpec, found: Mapping[int, frozenset[int]] = found
            ) -> Mapping[int, frozenset[int]]:
                return found

            other = run_doctor(spec, Sm120Poller(), run_probe=runner, worker_pids=seen)
            assert http(other).status is Status.FAIL
            assert "cannot bind" in http(other).message
    finally:
        _stop(worker)
    # Another user's listener, while worker 1's own processes run (not on the port).
    squatter = _listening([*SETPRIV, sys.executable, "-I", "-c", LISTENER, str(w1.port)])
    bystander = subprocess.Popen(
        [sys.executable, "-I", "-c", "import time; time.sleep(120)"], text=True
    )
    try:
        report = run_doctor(
            spec,
            Sm120Poller(),
            run_probe=runner,
            worker_pids=lambda _s: {1: frozenset({bystander.pid})},
        )
        (c,) = [c for c in _by_id(report, CheckId.PORT_HTTP) if 1 in c.workers]
        assert c.status is Status.FAIL and f"port {w1.port}" in c.message
        assert "base_port" in c.fix
    finally:
        _stop(squatter)
        _stop(bystander)


def test_model_path_missing_or_a_repo_id(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    # Without [model]: nothing stages the path, so a missing tmpfs path is the doctor's to
    # report (with [model], test_staging_doctor.py covers it).
    spec = replace(seed_spec(tmp_path, gpus=1), model=None)
    missing = _with_worker_flags(spec, {**spec.workers[0].flags, "model_path": "/dev/shm/nope-x"})
    report = run_doctor(missing, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    model = _fails(report)[CheckId.MODEL_PATH]
    assert "does not exist" in model.message and "emptied at every boot" in model.message
    repo = _with_worker_flags(spec, {**spec.workers[0].flags, "model_path": "Qwen/Qwen3-8B"})
    report = run_doctor(repo, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    (m,) = _by_id(report, CheckId.MODEL_PATH)
    assert m.status is Status.WARN and "download" in m.message


def test_weights_larger_than_the_static_budget_fail(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model-00001.safetensors", "wb") as f:
        f.truncate(46 * GIB)  # sparse: 46 GiB of "weights" > 0.88 x 48 GiB
    spec = seed_spec(tmp_path, gpus=1, model=model)
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    mem = [c for c in _by_id(report, CheckId.MEMORY) if c.status is Status.FAIL]
    assert len(mem) == 1 and "exceed mem_fraction_static 0.88" in mem[0].message


# --- pure rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cc", "picked"),
    [
        ((9, 0), "fa3"),
        ((10, 0), "trtllm_mha"),
        ((10, 3), "trtllm_mha"),
        ((12, 0), "flashinfer"),
        ((12, 1), "flashinfer"),
        ((8, 0), "flashinfer"),
        ((8, 9), "flashinfer"),
        ((7, 5), "triton"),
    ],
)
def test_auto_attention_backend_per_architecture(cc: tuple[int, int], picked: str) -> None:
    assert resolve_attention_backend(cc) == picked
    assert backend_verdict(picked, cc)[0] is not Status.FAIL or cc < (8, 0)


@pytest.mark.parametrize(
    ("backend", "cc", "status"),
    [
        ("fa3", (9, 0), Status.PASS),
        ("fa3", (8, 0), Status.WARN),
        ("fa3", (12, 0), Status.FAIL),
        ("fa3", (10, 0), Status.FAIL),
        ("fa4", (10, 0), Status.PASS),
        ("fa4", (12, 0), Status.WARN),
        ("fa4", (8, 9), Status.FAIL),
        ("trtllm_mha", (12, 0), Status.PASS),
        ("trtllm_mha", (8, 0), Status.FAIL),
        ("trtllm_mla", (9, 0), Status.FAIL),
        ("trtllm_mla", (10, 0), Status.PASS),
        ("cutedsl_mla", (12, 0), Status.FAIL),
        ("flashmla", (12, 0), Status.FAIL),
        ("flashmla", (9, 0), Status.PASS),
        ("triton", (12, 0), Status.WARN),
        ("triton", (9, 0), Status.PASS),
        ("flashinfer", (12, 0), Status.PASS),
        ("aiter", (9, 0), Status.FAIL),
    ],
)
def test_backend_rules_follow_sglang(backend: str, cc: tuple[int, int], status: Status) -> None:
    assert backend_verdict(backend, cc)[0] is status


def test_auto_in_config_is_resolved_and_reported(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(tmp_path, gpus=1, attention="auto")
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    (att,) = _by_id(report, CheckId.ATTENTION_BACKEND)
    assert att.status is Status.PASS
    assert "auto: the farm picked flashinfer for SM 12.0" in att.message
    # The parser saw the resolved value, not "auto" (which it would reject).
    assert all(c.status is Status.PASS for c in _by_id(report, CheckId.FLAGS))
    assert resolve_flags({"attention_backend": "auto", "x": 1}, (9, 0)) == {
        "attention_backend": "fa3",
        "x": 1,
    }
    assert resolve_flags({"attention_backend": "auto"}, None) == {}


def test_arch_list_coverage() -> None:
    assert not arch_covers(["sm_80", "sm_90", "sm_100"], (12, 0))
    assert arch_covers(["sm_80", "sm_120"], (12, 0))
    assert arch_covers(["sm_80"], (8, 6))  # same major, newer minor runs sm_80 cubins
    assert not arch_covers(["sm_90a"], (9, 1)) and arch_covers(["sm_90a"], (9, 0))
    assert arch_covers(["sm_100f"], (10, 3))
    assert arch_covers(["compute_90"], (12, 0))  # PTX JITs forward


def test_nccl_warning_only_for_multi_gpu_workers_on_sm12_before_cuda_12_9(tmp_path: Path) -> None:
    from sglang_farm.doctor.gpu_rules import _torch_checks

    torch = {
        "installed": True,
        "version": "2.8.0+cu128",
        "cuda": "12.8",
        "arch_list": ["sm_120"],
        "cuda_available": True,
    }
    assert not [c for c in _torch_checks(torch, (12, 0), 1) if c.id is CheckId.NCCL]
    (warn,) = [c for c in _torch_checks(torch, (12, 0), 2) if c.id is CheckId.NCCL]
    assert warn.status is Status.WARN and "12.9" in warn.message
    newer = {**torch, "cuda": "13.0"}
    assert not [c for c in _torch_checks(newer, (12, 0), 2) if c.id is CheckId.NCCL]


def test_the_demo_config_with_the_simulator_passes(tmp_path: Path) -> None:
    from sglang_farm.gpus.simulated import FakeGpuPoller

    text = (REPO / "etc" / "sglang-farm" / "demo.toml").read_text()
    spec = load_spec(text, source="demo.toml", agent_python=sys.executable)
    report = run_doctor(
        spec,
        FakeGpuPoller(),
        run_probe=make_probe_runner(timeout=30),
        port_check=lambda host, port: None,
    )
    assert report.ok, format_report(report)
    assert preflight_blocking(spec, 0, report, port_check=lambda host, port: None) == []
    ids = {c.id for c in report.checks}
    assert CheckId.SGL_KERNEL not in ids and CheckId.TORCH not in ids
    assert {c.status for c in _by_id(report, CheckId.FLAGS)} == {Status.SKIP}


# --- the command ---------------------------------------------------------------------------


def test_doctor_command_json_and_exit_status(tmp_path: Path) -> None:
    config = tmp_path / "farm.toml"
    config.write_text(
        textwrap.dedent(f"""
        [farm]
        python = "{tmp_path / "missing" / "python3"}"
        [workers]
        gpus = [0]
        base_port = {_free_base(2)}
        nccl_base_port = {_free_base(2) + 1}
        [metrics]
        gpu_source = "fake"
        [sglang]
        model_path = "{tmp_path}"
    """)
    )
    result = CliRunner().invoke(doctor, ["--config", str(config), "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["ok"] is False
    checks = {(c["check"], c["status"]) for c in data["checks"]}
    assert ("environment", "fail") in checks and ("nvml", "warn") in checks


def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML as on a machine without the NVIDIA driver (whatever machine runs the tests)."""

    def missing() -> object:
        raise ImportError("NVML Shared Library Not Found")

    monkeypatch.setattr(gpu, "_default_nvml", missing)


def test_doctor_checks_the_shipped_config_without_nvml_given_the_gpu_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_nvml(monkeypatch)
    args = ["--config", str(SEED_TOML), "--gpus", "8", "--json"]
    with capture_logs() as logs:
        result = CliRunner().invoke(doctor, args)
    assert result.exit_code == 1, result.output  # the seed's interpreter and model are absent
    data = json.loads(result.stdout)  # nothing but the report on stdout
    checks = {(c["check"], c["status"]) for c in data["checks"]}
    assert ("nvml", "warn") in checks
    # The other checks ran, for the 8 workers --gpus stands for.
    assert {"environment", "port_http", "port_nccl", "exposure"} <= {c for c, _ in checks}
    env_check = next(c for c in data["checks"] if c["check"] == "environment")
    assert env_check["workers"] == list(range(8))
    # The doctor reports NVML as a check, never with the agent's retry warning.
    assert [e for e in logs if e["event"] == "nvml_unavailable"] == []


def test_doctor_without_nvml_or_a_gpu_count_says_to_pass_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_nvml(monkeypatch)
    result = CliRunner().invoke(doctor, ["--config", str(SEED_TOML)])
    assert result.exit_code == 1
    assert 'workers.gpus: gpus = "all" needs' in result.stderr
    assert "pass --gpus N" in result.stderr


def test_the_doctors_report_has_no_nvml_log_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_nvml(monkeypatch)
    config = tmp_path / "farm.toml"
    config.write_text(SEED_TOML.read_text().replace('gpus = "all"', "gpus = [0]"))
    before = structlog.get_config()
    structlog.reset_defaults()  # structlog's own default: print to stdout
    try:
        result = CliRunner().invoke(doctor, ["--config", str(config)])
    finally:
        structlog.configure(**before)
    assert result.exit_code == 1
    assert "nvml_unavailable" not in result.output and "retry_in_s" not in result.output
    assert result.stdout.startswith("STATUS")


def test_a_missing_interpreter_is_named_once_and_its_fix_says_what_to_do(
    tmp_path: Path,
) -> None:
    spec = seed_spec(tmp_path, gpus=1)
    python = str(tmp_path / "nope" / "python3")
    spec2 = replace(spec, farm=replace(spec.farm, python=python))
    report = run_doctor(spec2, Sm120Poller(count=1), run_probe=make_probe_runner(timeout=10))
    env_check = _fails(report)[CheckId.ENVIRONMENT]
    assert env_check.message.count(python) == 1, env_check.message
    assert python not in env_check.fix
    assert "pip install sglang" in env_check.fix and "[farm] python" in env_check.fix


def test_the_missing_default_interpreter_is_not_offered_as_its_own_fix() -> None:
    spec = load_spec("[workers]\ngpus = [0]\n[sglang]\nmodel_path = '/m'\n", source="f")
    python = spec.farm.python
    assert python == "/opt/sglang/bin/python3"  # the default, and the usual example
    obs = Observations(
        fleet=FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False),
        env={0: ProbeOutcome(error=f"{python} does not exist", missing=True)},
        flags={},
        ports={},
        models={},
    )
    env_check = _fails(evaluate(spec, obs))[CheckId.ENVIRONMENT]
    assert python in env_check.message and python not in env_check.fix


@pytest.mark.parametrize(
    ("statuses", "line"),
    [
        ((Status.FAIL, Status.WARN, Status.PASS), "1 failed, 1 warning, 1 passed"),
        ((Status.WARN, Status.WARN, Status.PASS, Status.PASS), "0 failed, 2 warnings, 2 passed"),
    ],
)
def test_the_report_counts_are_pluralized(statuses: tuple[Status, ...], line: str) -> None:
    checks = tuple(Check(CheckId.GPU, s, f"check {i}") for i, s in enumerate(statuses))
    text = format_report(DoctorReport(checks))
    assert line in text.splitlines()


def test_doctor_warns_about_workers_reachable_without_an_api_key(tmp_path: Path) -> None:
    env = make_fixed_env(tmp_path / "env")
    spec = seed_spec(tmp_path, env=fixed_farm_env(env), gpus=2)  # host = "0.0.0.0"
    report = run_doctor(spec, Sm120Poller(count=2), run_probe=fake_runner(env, tmp_path))
    (exposure,) = _by_id(report, CheckId.EXPOSURE)
    assert exposure.status is Status.WARN and exposure.workers == (0, 1)
    assert exposure.message.startswith("workers listen on '0.0.0.0' (not loopback) without api_key")
    assert 'host = "127.0.0.1"' in exposure.fix and "api_key" in exposure.fix
    assert report.ok  # a warning, not a failure


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[sglang]\napi_key = "k"\n', "api_key is set"),
        ("", "listens on loopback"),
    ],
)
def test_doctor_passes_keyed_or_loopback_workers(extra: str, message: str) -> None:
    host = "0.0.0.0" if extra else "127.0.0.1"
    text = f'[workers]\ngpus = [0]\nhost = "{host}"\n' + (extra or "[sglang]\n")
    spec = load_spec(text + "model_path = '/m'\n", source="f")
    obs = Observations(
        fleet=FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False),
        env={},
        flags={},
        ports={},
        models={},
    )
    (exposure,) = _by_id(evaluate(spec, obs), CheckId.EXPOSURE)
    assert exposure.status is Status.PASS and message in exposure.message


# --- helpers -------------------------------------------------------------------------------


# --- the probe runs as the workers' account (issue 15, item 2) -------------------------------

_needs_root = pytest.mark.skipif(
    sys.platform != "linux" or __import__("os").geteuid() != 0,
    reason="switching to the workers' account needs root (CI runs as root)",
)


def _unprivileged_account() -> tuple[str, str]:
    """(user, group) of an existing non-root account: nobody, or a system user made here."""
    import grp
    import pwd
    import subprocess

    for name in ("nobody", "sf-probe-test"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_uid != 0:
            return name, grp.getgrgid(pw.pw_gid).gr_name
    subprocess.run(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            "sf-probe-test",
        ],
        check=True,
    )
    return "sf-probe-test", "sf-probe-test"


@pytest.fixture
def uid_python(request: pytest.FixtureRequest) -> Path:
    """A fake `farm.python` that prints, as the probe's JSON, who it runs as.

    In a world-readable folder under /dev/shm: pytest's tmp_path is root-only (0700), and
    /tmp is private to a transient unit (PrivateTmp=)."""
    import os
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="sf-probe-", dir="/dev/shm"))
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    folder.chmod(0o755)
    script = folder / "python3"
    script.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        [ -n "$SF_PROBE_MARK" ] && touch "$SF_PROBE_MARK"
        printf '{"uid": %s, "gid": %s, "groups": "%s", "home": "%s", "user": "%s"}\\n' \\
            "$(id -u)" "$(id -g)" "$(id -G)" "$HOME" "$USER"
        """)
    )
    script.chmod(0o755)
    assert os.access(script, os.X_OK)
    return script


def _account_spec(python: Path, user: str, group: str, module: str = "sglang_farm.sim") -> FarmSpec:
    text = textwrap.dedent(f"""
        [farm]
        python = "{python}"
        module = "{module}"
        user = "{user}"
        group = "{group}"
        [workers]
        gpus = [0]
        host = "127.0.0.1"
        [sglang]
        model_path = "/m"
        """)
    return load_spec(text, source="farm.toml")


@_needs_root
def test_doctor_run_as_root_probes_as_the_workers_user_not_as_root(uid_python: Path) -> None:
    user, group = _unprivileged_account()
    spec = _account_spec(uid_python, user, group)
    report = run_doctor(spec, Sm120Poller(count=1), port_check=lambda host, port: None)
    (probed,) = report.environments
    import pwd

    assert probed["uid"] != 0
    assert probed["uid"] == pwd.getpwnam(user).pw_uid
    assert probed["user"] == user


@_needs_root
def test_probe_child_drops_uid_gid_and_groups_and_gets_the_users_home(uid_python: Path) -> None:
    from sglang_farm.doctor.gather import worker_account

    user, group = _unprivileged_account()
    account = worker_account(user, group)
    runner = make_probe_runner(account=account, isolation="process", timeout=30)
    got = runner(str(uid_python), {"PYTHONPATH": "/nowhere"}, "env", None)
    assert (got["uid"], got["gid"]) == (account.uid, account.gid)
    assert sorted(int(g) for g in got["groups"].split()) == sorted({account.gid, *account.groups})
    assert 0 not in account.groups or account.gid == 0
    assert got["home"] == account.home and got["user"] == user


@_needs_root
def test_missing_workers_user_is_a_doctor_failure_and_nothing_runs_as_root(
    uid_python: Path, tmp_path: Path
) -> None:
    mark = tmp_path / "ran"
    spec = _account_spec(uid_python, "sf-no-such-user", "root")
    spec = replace(
        spec,
        workers=tuple(replace(w, env={**w.env, "SF_PROBE_MARK": str(mark)}) for w in spec.workers),
    )
    report = run_doctor(spec, Sm120Poller(count=1), port_check=lambda host, port: None)
    assert not mark.exists()  # the interpreter never ran
    (env_check,) = _by_id(report, CheckId.ENVIRONMENT)
    assert env_check.status is Status.FAIL
    assert "'sf-no-such-user' ([farm] user) does not exist" in env_check.message
    assert "never as root" in env_check.message
    assert "useradd" in env_check.fix and "sf-no-such-user" in env_check.fix
    assert preflight_blocking(spec, 0, report, port_check=lambda host, port: None)


def test_a_non_root_doctor_probes_as_itself() -> None:
    from sglang_farm.doctor.gather import choose_isolation, probe_account

    spec = load_spec(
        "[farm]\nuser = 'sf-no-such-user'\n[workers]\ngpus = [0]\n[sglang]\nmodel_path = '/m'\n",
        source="f",
    )
    assert probe_account(spec, euid=1000) is None  # cannot switch, nothing to hand over
    assert choose_isolation(None, "auto", systemd=True) == "self"


def test_isolation_is_a_transient_unit_under_systemd_else_a_dropping_child() -> None:
    from sglang_farm.doctor.gather import Account, choose_isolation

    acct = Account("sglang", "sglang", 999, 999, (999,), "/var/lib/sglang")
    assert choose_isolation(acct, "auto", systemd=True) == "unit"
    assert choose_isolation(acct, "auto", systemd=False) == "process"
    assert choose_isolation(acct, "process", systemd=True) == "process"


def test_transient_probe_unit_runs_as_the_account_in_the_worker_sandbox() -> None:
    from sglang_farm.doctor.gather import WORKER_SANDBOX, Account, transient_unit_argv

    acct = Account("sglang", "gpu", 999, 44, (44, 999), "/var/lib/sglang")
    argv = transient_unit_argv(
        "/opt/sglang/bin/python3",
        "print('$HOME')",
        "env",
        acct,
        "/run/sglang-farm/probe-x.env",
        240.0,
    )
    assert argv[0] == "systemd-run"
    for opt in (
        "--wait",
        "--pipe",
        "--collect",
        "--uid=sglang",
        "--gid=gpu",
        "--property=EnvironmentFile=/run/sglang-farm/probe-x.env",
        "--property=RuntimeMaxSec=240",
        "--property=NoNewPrivileges=yes",
    ):
        assert opt in argv
    assert [a for a in argv if a.startswith("--property=")][2:] == [
        f"--property={p}" for p in WORKER_SANDBOX
    ]
    assert not any(a.startswith("--setenv") for a in argv)  # secrets stay in the 0600 file
    assert argv[argv.index("--") + 1 :] == [
        "/opt/sglang/bin/python3",
        "-c",
        "print('$$HOME')",
        "env",
    ]


def test_worker_sandbox_is_the_worker_units_hardening() -> None:
    from sglang_farm.doctor.gather import WORKER_SANDBOX

    text = (REPO / "units" / "sglang@.service").read_text()
    hardening = text[text.index("# --- Hardening") :]
    lines = [ln for ln in hardening.splitlines() if ln[:1].isupper() and "=" in ln]
    assert tuple(lines) == WORKER_SANDBOX


def test_probe_environment_file_quotes_what_systemd_would_expand() -> None:
    from sglang_farm.doctor.gather import environment_file_text

    assert environment_file_text({"B": "plain", "A": 'x"y$z\\w`q'}) == (
        'A="x\\"y\\$z\\\\w\\`q"\nB="plain"\n'
    )


def test_transient_unit_probe_hands_the_environment_only_through_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake systemd-run: what it gets (argv, environment, the EnvironmentFile's mode and
    text) is what systemd would get. It runs as root, so no worker variable reaches it."""
    import importlib
    import os
    import stat

    g = importlib.import_module("sglang_farm.doctor.gather")  # the package re-exports gather()
    monkeypatch.setattr(g, "PROBE_ENV_DIRS", (str(tmp_path / "nope"), str(tmp_path)))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "systemd-run").write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, stat, sys
        envfile = next(a.split("=", 2)[2] for a in sys.argv if "EnvironmentFile=" in a)
        print(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ),
                          "mode": stat.S_IMODE(os.stat(envfile).st_mode),
                          "file": open(envfile).read(), "envfile": envfile,
                          "stdin": sys.stdin.read()}}))
        """)
    )
    (fake_bin / "systemd-run").chmod(0o755)
    acct = g.Account("sglang", "sglang", 999, 999, (999,), "/var/lib/sglang")
    runner = make_probe_runner(
        base_env={"PATH": str(fake_bin), "LANG": "C.UTF-8"},
        account=acct,
        isolation="unit",
        timeout=30,
    )
    got = runner(
        "/opt/sglang/bin/python3",
        {"LD_PRELOAD": "/home/x/evil.so", "HF_TOKEN": "s"},
        "flags",
        {"argvs": [["--port", "1"]]},
    )
    assert "LD_PRELOAD" not in got["env"] and "HF_TOKEN" not in got["env"]
    assert got["mode"] == stat.S_IMODE(0o600)
    assert 'LD_PRELOAD="/home/x/evil.so"\n' in got["file"] and 'HF_TOKEN="s"\n' in got["file"]
    assert 'HOME="/var/lib/sglang"\n' in got["file"] and 'USER="sglang"\n' in got["file"]
    assert json.loads(got["stdin"]) == {"argvs": [["--port", "1"]]}
    assert "--uid=sglang" in got["argv"] and got["argv"][-1] == "flags"
    assert not os.path.exists(got["envfile"])  # removed after the run


# ---- GPU health in the doctor (issue 14 §5) ------------------------------------------------


def _gpu_checks_for(
    *, persistence_mode: bool | None = None, remapped_rows_pending: bool | None = None
) -> list[str]:
    from sglang_farm.doctor.gpu_rules import gpu_checks
    from sglang_farm.spec import WorkerSpec

    gpu = GpuSnapshot(
        index=0,
        name="NVIDIA H200",
        compute_capability=(9, 0),
        persistence_mode=persistence_mode,
        remapped_rows_pending=remapped_rows_pending,
    )
    fleet = FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=True, gpus=(gpu,))
    worker = WorkerSpec(
        id=0, gpus=(0,), host="127.0.0.1", port=30000, nccl_port=31000, flags={}, env={}
    )
    return [f"{c.status}: {c.message} | {c.fix}" for c in gpu_checks(fleet, worker)]


def test_doctor_warns_when_persistence_mode_is_off() -> None:
    lines = _gpu_checks_for(persistence_mode=False)
    assert any(ln.startswith("warn") and "persistence mode is off" in ln for ln in lines), lines
    assert not any("persistence" in ln for ln in _gpu_checks_for(persistence_mode=True))


def test_doctor_fails_a_gpu_with_pending_row_remaps_naming_the_reset() -> None:
    lines = _gpu_checks_for(remapped_rows_pending=True)
    assert any(
        ln.startswith("fail") and "row remaps pending" in ln and "nvidia-smi -r -i 0" in ln
        for ln in lines
    ), lines


def test_doctor_warns_about_a_gpu_the_farm_has_quarantined(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env")
    seed = seed_spec(tmp_path)
    spec = dataclasses.replace(
        seed, farm=dataclasses.replace(seed.farm, state_dir=str(tmp_path / "state"))
    )
    state = Path(spec.farm.state_dir) / "state.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    quarantine = {"gpu": 5, "reason": "xid 79", "detail": "fell off the bus", "at": 1.0}
    worker = {"phase": "quarantined", "quarantine": quarantine}
    state.write_text(json.dumps({"format": 1, "workers": {"5": worker}}))
    report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
    warned = [c for c in report.checks if "quarantined" in c.message]
    assert len(warned) == 1 and warned[0].status is Status.WARN
    assert "GPU 5" in warned[0].message and "xid 79" in warned[0].message
    assert "farmctl release-gpu 5" in warned[0].fix and warned[0].workers == (5,)


def test_doctor_is_quiet_about_a_quarantine_the_agent_drops_at_start(tmp_path: Path) -> None:
    """A quarantine naming a GPU the worker no longer uses is dropped at agent start
    (supervisor.restored_quarantine): the doctor said the worker "stays stopped"."""
    env = make_fake_env(tmp_path / "env")
    seed = seed_spec(tmp_path)
    spec = dataclasses.replace(
        seed, farm=dataclasses.replace(seed.farm, state_dir=str(tmp_path / "state"))
    )
    state = Path(spec.farm.state_dir) / "state.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    moved = {"gpu": 6, "reason": "xid 79", "detail": "fell off the bus", "at": 1.0}
    workers = {"5": {"phase": "quarantined", "quarantine": moved}, "4": {"phase": "quarantined"}}
    state.write_text(json.dumps({"format": 1, "workers": workers}))
    report = run_doctor(spec, Sm120Poller(), run_probe=fake_runner(env, tmp_path))
    assert not [c for c in report.checks if "quarantined" in c.message]


def test_doctor_warns_when_a_world_readable_config_holds_secrets(tmp_path: Path) -> None:
    """The units never show a configured secret (docs/security.md); the doctor says when
    farm.toml itself does, and stays quiet once it is private."""
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(tmp_path, gpus=1, env='{ HF_TOKEN = "hf_secret" }')
    path = tmp_path / "farm.toml"
    path.write_text("# the file the spec was read from\n")
    spec = replace(spec, source=str(path))
    path.chmod(0o644)
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    warned = [c for c in _by_id(report, CheckId.EXPOSURE) if str(path) in c.message]
    assert warned and warned[0].status is Status.WARN and "chmod" in warned[0].fix
    path.chmod(0o640)
    report = run_doctor(spec, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    assert not [c for c in _by_id(report, CheckId.EXPOSURE) if str(path) in c.message]


# --- the managed gateway's smg (issue 22 item 10) ----------------------------------------------

# An interpreter without smg: the system Python (the test venv has it).
_NO_SMG_PYTHON = "/usr/bin/python3"


def test_a_managed_gateway_without_smg_fails_the_doctor_naming_the_install(
    tmp_path: Path,
) -> None:
    from sglang_farm.gpus.simulated import FakeGpuPoller

    if not Path(_NO_SMG_PYTHON).exists():
        pytest.skip("no system Python to play a host without smg")
    if subprocess.run([_NO_SMG_PYTHON, "-c", "import smg"], capture_output=True).returncode == 0:
        pytest.skip("the system Python has smg")
    spec = _demo_with_gateway()
    report = run_doctor(
        spec,
        FakeGpuPoller(),
        run_probe=make_probe_runner(timeout=30),
        port_check=lambda host, port: None,
        gateway_python=_NO_SMG_PYTHON,
    )
    [check] = _by_id(report, CheckId.GATEWAY)
    assert check.status is Status.FAIL and not report.ok
    assert "No module named 'smg'" in check.message and _NO_SMG_PYTHON in check.message
    assert f"{_NO_SMG_PYTHON} -m pip install 'smg==1.13.0'" in check.fix
    assert "sglang-farm[gateway]" in check.fix
    assert any(
        line.startswith("FAIL") and "gateway" in line for line in format_report(report).splitlines()
    )
    # The workers start all the same: the gateway is no worker's prerequisite.
    assert preflight_blocking(spec, 0, report, port_check=lambda host, port: None) == []


def test_a_managed_gateway_whose_smg_runs_passes_with_its_version() -> None:
    from sglang_farm.gpus.simulated import FakeGpuPoller

    report = run_doctor(
        _demo_with_gateway(),
        FakeGpuPoller(),
        run_probe=make_probe_runner(timeout=30),
        port_check=lambda h, p: None,
    )
    [check] = _by_id(report, CheckId.GATEWAY)
    assert check.status is Status.PASS and "smg 1.13.0" in check.message


def test_a_missing_gateway_interpreter_fails_the_doctor() -> None:
    from sglang_farm.gpus.simulated import FakeGpuPoller

    report = run_doctor(
        _demo_with_gateway(),
        FakeGpuPoller(),
        run_probe=make_probe_runner(timeout=30),
        port_check=lambda h, p: None,
        gateway_python="/nonexistent/python3",
    )
    [check] = _by_id(report, CheckId.GATEWAY)
    assert check.status is Status.FAIL and "/nonexistent/python3 does not exist" in check.message


def test_the_agent_says_once_that_its_managed_gateway_cannot_run() -> None:
    """The agent's preflight (DoctorReportCache, at start and at each refresh): one error line
    naming the fix, not one per refresh."""
    import asyncio

    from sglang_farm.doctor.cache import DoctorReportCache
    from sglang_farm.gpus.simulated import FakeGpuPoller

    spec = _demo_with_gateway()
    verdict = DoctorReportCache(FakeGpuPoller(), gateway_python="/nonexistent/python3")

    async def twice() -> None:
        await verdict.refresh(spec)
        await verdict.refresh(spec)

    with capture_logs() as logs:
        asyncio.run(twice())
    said = [e for e in logs if e["event"] == "gateway_unavailable"]
    assert len(said) == 1 and said[0]["log_level"] == "error"
    assert "pip install" in said[0]["fix"]
    assert verdict.blocking(spec, 0) == []


def test_the_agents_preflight_names_each_failed_check_where_it_counts_them() -> None:
    """The log said `{"pass": 5, "warn": 2, "fail": 4}` and started anyway; only the doctor
    said which ports were held. Each failed check is logged: check, workers, message, fix."""
    import asyncio
    import socket

    from farmproc import free_port_block
    from sglang_farm.doctor.cache import DoctorReportCache
    from sglang_farm.gpus.simulated import FakeGpuPoller

    spec = _demo_with_gateway(base_port=free_port_block(8))
    held = spec.worker(1).port
    verdict = DoctorReportCache(FakeGpuPoller(count=8))
    with socket.socket() as squatter, capture_logs() as logs:
        squatter.bind(("127.0.0.1", held))
        squatter.listen()
        asyncio.run(verdict.refresh(spec))
    (counts,) = [e for e in logs if e["event"] == "preflight_done"]
    failed = [e for e in logs if e["event"] == "preflight_failed"]
    assert counts["fail"] == len(failed) >= 1
    (port,) = [e for e in failed if str(held) in e["message"]]
    assert port["log_level"] == "error" and port["workers"] == [1]
    assert port["check"] and port["fix"]


def test_a_worker_units_cgroup_names_its_worker_and_a_users_own_unit_does_not() -> None:
    """Which processes are a running worker's, for the doctor's port check: a system
    unit's cgroup only (only root places processes under system.slice)."""
    from sglang_farm.runtime.running import unit_worker

    assert unit_worker("0::/system.slice/sglang@3.service") == 3
    assert unit_worker("0::/system.slice/sglang@3.service/payload") == 3
    assert unit_worker("1:name=systemd:/system.slice/sglang@12.service") == 12
    assert unit_worker("0::/user.slice/user-1000.slice/user@1000.service/sglang@3.service") is None
    assert unit_worker("0::/system.slice/sglang-farm.service") is None
    assert unit_worker("0::/system.slice/other@3.service") is None


def test_held_by_judges_every_listener_a_bind_would_collide_with() -> None:
    """The doctor's own-worker rule (`portowner.held_by`): for the NCCL port's wildcard
    bind, every listener on the port counts, each on its own address; no pids, nothing."""
    import os

    from sglang_farm.host.portowner import held_by

    me = frozenset({os.getpid()})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert held_by("127.0.0.1", port, me)
        assert held_by("0.0.0.0", port, me)  # a wildcard bind collides with it too
        assert not held_by("127.0.0.1", port, frozenset())
        other = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
        try:
            assert not held_by("127.0.0.1", port, frozenset({other.pid}))
            assert not held_by("0.0.0.0", port, frozenset({other.pid}))
        finally:
            other.kill()
            other.wait()
        # Another address's listener on the port is no collision for a specific bind,
        # and one for the wildcard's.
        assert not held_by("127.0.0.2", port, me)
        code = (
            "import socket, sys, time\n"
            "s = socket.socket()\n"
            "s.bind(('127.0.0.2', int(sys.argv[1])))\n"
            "s.listen()\n"
            "print('bound', flush=True)\n"
            "time.sleep(60)\n"
        )
        beside = _listening([sys.executable, "-I", "-c", code, str(port)])
        try:
            assert held_by("127.0.0.1", port, me)
            assert not held_by("0.0.0.0", port, me)
        finally:
            _stop(beside)
    assert not held_by("127.0.0.1", port, me)  # closed: nothing listens


def test_the_running_workers_are_found_by_their_unit_cgroup_or_their_record(
    tmp_path: Path,
) -> None:
    """Which processes are each running worker's, without an agent to ask: a system
    unit's cgroup (a fake /proc here), or the process runtime's records of an agent that
    still runs (this test plays the agent) with the child's tree."""
    from sglang_farm.host import procfs
    from sglang_farm.runtime.children import RECORDS_SUBDIR, ChildRecords
    from sglang_farm.runtime.running import running_worker_pids, systemd_worker_pids

    proc = tmp_path / "proc"
    for pid, line in (
        (41, "0::/system.slice/sglang@1.service"),
        (42, "0::/system.slice/sglang@1.service/payload"),
        (43, "0::/user.slice/user-1000.slice/user@1000.service/app.slice/sglang@2.service"),
        (44, "0::/system.slice/sshd.service"),
    ):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(line + "\n")
    assert systemd_worker_pids(str(proc)) == {1: {41, 42}}

    state = tmp_path / "state"
    text = SEED_TOML.read_text().replace(
        'state_dir = "/var/lib/sglang-farm"', f'state_dir = "{state}"'
    )
    spec = load_spec(text, source="farm.toml", gpu_count=8)
    assert spec.farm.state_dir == str(state)
    child = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
    try:
        st = procfs.read_stat(child.pid)
        assert st is not None
        ChildRecords(state / RECORDS_SUBDIR).record("worker 3", child.pid, st.start)
        found = running_worker_pids(spec)
        assert child.pid in found[3] and 3 in found
        assert all(w in spec.worker_ids for w in found)
    finally:
        child.kill()
        child.wait()
    assert 3 not in running_worker_pids(spec)  # gone: no longer a running worker
