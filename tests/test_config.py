"""config: TOML text to FarmSpec, and every problem at once with its line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from configtext import MINIMAL, load, only_problem, problems
from sglang_farm.config import (
    check_spec,
    check_spec_file,
    load_spec,
    load_spec_file,
    parse_duration,
)
from sglang_farm.errors import ConfigError
from sglang_farm.sglang import flags as sglang_flags
from sglang_farm.sglang.argv import build_command
from sglang_farm.sglang.ready_route import readiness_routes
from sglang_farm.spec import (
    ControlSpec,
    FarmSection,
    HealthPolicy,
    MetricsSpec,
    OomAdjust,
    RestartPolicy,
    StartupPolicy,
)

ETC = Path(__file__).resolve().parent.parent / "etc" / "sglang-farm"


# --- the shipped files ----------------------------------------------------------------


def test_shipped_farm_toml_reproduces_the_seed_host() -> None:
    spec = load_spec((ETC / "farm.toml").read_text(), source="farm.toml", gpu_count=8)
    assert spec.farm == FarmSection()  # every [farm] value is the spelled-out default
    assert spec.startup == StartupPolicy()
    assert spec.health == HealthPolicy()
    assert spec.restart == RestartPolicy()
    assert spec.metrics == MetricsSpec()
    assert spec.control == ControlSpec()
    assert spec.worker_ids == tuple(range(8))
    for w in spec.workers:
        assert w.gpus == (w.id,)
        assert (w.host, w.port, w.nccl_port) == ("0.0.0.0", 30000 + w.id, 31000 + w.id)
    assert dict(spec.workers[0].flags) == {
        "model_path": "/dev/shm/Qwen3.6-27B",
        "reasoning_parser": "qwen3",
        "attention_backend": "flashinfer",
        "mem_fraction_static": 0.88,
        "max_running_requests": 64,
        "context_length": 8192,
        "trust_remote_code": True,
        "chunked_prefill_size": 4096,
        "mamba_radix_cache_strategy": "extra_buffer",
        "mamba_ssm_dtype": "bfloat16",
        "enable_metrics": True,
        "uvicorn_access_log_exclude_prefixes": (
            "/health",
            "/ready",
            "/metrics",
            "/v1/loads",
            "/loads",
        ),
    }
    assert spec.oom.enabled and spec.oom.scope == "worker"
    assert [(s.name, s.adjust) for s in spec.oom.steps] == [
        (
            "mamba_no_buffer",
            (
                OomAdjust("mamba_radix_cache_strategy", set="no_buffer"),
                OomAdjust("disable_overlap_schedule", set=True),
            ),
        ),
        ("less_static_memory", (OomAdjust("mem_fraction_static", add=-0.02, min=0.70),)),
        ("fewer_requests", (OomAdjust("max_running_requests", multiply=0.5, min=8.0),)),
    ]
    # The seed's command line, with 0.5.23's flag name and the farm's own flags.
    argv = build_command(spec.farm, spec.workers[3]).argv
    assert "--mamba-radix-cache-strategy" in argv and "--mamba-scheduler-strategy" not in argv
    assert argv[-6:] == ("--host", "0.0.0.0", "--port", "30003", "--nccl-port", "31003")


def test_shipped_farm_toml_documents_every_key_with_a_comment() -> None:
    lines = (ETC / "farm.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+ = ", line):
            # The nearest line above that is not a key or a table header is a comment.
            j = i - 1
            while re.match(r"^([a-z_]+ = |\[)", lines[j]):
                j -= 1
            assert lines[j].startswith("#"), f"farm.toml:{i + 1}: {line!r} has no comment"


def test_shipped_demo_toml_runs_eight_simulated_workers() -> None:
    spec = load_spec_file(ETC / "demo.toml")  # "@agent" -> this interpreter
    assert spec.farm.python == sys.executable
    assert spec.farm.module == "sglang_farm.sim"
    assert spec.farm.state_dir.startswith("/tmp/")
    assert dict(spec.farm.env) == {"SGLANG_SIM_LOAD_SECONDS": "3"}
    assert [w.gpus for w in spec.workers] == [(g,) for g in range(8)]
    assert [w.port for w in spec.workers] == list(range(30000, 30008))
    assert all(w.env["SGLANG_SIM_LOAD_SECONDS"] == "3" for w in spec.workers)
    assert dict(spec.workers[0].flags) == {
        "model_path": "sim/Qwen3.6-27B",
        "enable_metrics": True,
        "uvicorn_access_log_exclude_prefixes": (
            "/health",
            "/ready",
            "/metrics",
            "/v1/loads",
            "/loads",
        ),
    }
    assert (spec.startup.canary, spec.startup.parallel) == (0, 4)
    assert (spec.health.period, spec.health.timeout, spec.health.failure_threshold) == (2, 5, 3)
    assert (spec.restart.backoff_initial, spec.restart.backoff_max) == (1, 30)
    assert str(spec.metrics.listen) == "127.0.0.1:9840" and spec.metrics.gpu_source == "fake"
    assert spec.control.socket.startswith("/tmp/")


@pytest.mark.parametrize("name", ["demo.toml", "farm.toml"])
def test_shipped_configs_keep_the_polls_out_of_the_workers_access_log(name: str) -> None:
    """`farmctl logs 3` was mostly the farm's /health and /metrics and the gateway's /v1/loads;
    then smg 1.13's `GET /loads?model=… 404` (it asks for both; SGLang 0.5.23 serves only
    /v1/loads: issue 31)."""
    text = (ETC / name).read_text()
    spec = load_spec(text, source=name, gpu_count=8, agent_python=sys.executable)
    # the prober (readiness, liveness), sglang.stats, smg (both its load polls)
    routes = readiness_routes(spec.health.ready_path, spec.health.path)
    polled = (*routes, "/metrics", "/v1/loads", "/loads")
    for w in spec.workers:
        excluded = w.flags.get("uvicorn_access_log_exclude_prefixes")
        assert isinstance(excluded, tuple), f"worker {w.id}: no access-log exclusions"
        for path in polled:
            assert any(path.startswith(str(p)) for p in excluded), f"worker {w.id} logs {path}"


def test_demo_without_agent_python_says_what_at_agent_means() -> None:
    text = (ETC / "demo.toml").read_text()
    with pytest.raises(ConfigError) as info:
        load_spec(text, source="demo.toml")
    (problem,) = info.value.problems
    assert problem.startswith("demo.toml:18: farm.python: '@agent' means the interpreter")


# --- resolution -----------------------------------------------------------------------


def test_minimal_config_takes_the_dataclass_defaults() -> None:
    spec = load(MINIMAL)
    assert spec.farm == FarmSection()
    assert spec.startup == StartupPolicy()
    w1 = spec.workers[1]
    assert (w1.gpus, w1.host, w1.port, w1.nccl_port) == ((1,), "127.0.0.1", 30001, 31001)


def test_gpus_all_uses_the_counted_gpus_in_order() -> None:
    spec = load(MINIMAL.replace("[0, 1]", '"all"'), gpu_count=3)
    assert [w.gpus for w in spec.workers] == [(0,), (1,), (2,)]


def test_listed_gpus_give_worker_ids_in_list_order() -> None:
    spec = load(MINIMAL.replace("[0, 1]", "[6, 2]"))
    assert [(w.id, w.gpus) for w in spec.workers] == [(0, (6,)), (1, (2,))]


def test_tensor_parallel_workers_get_consecutive_gpus() -> None:
    spec = load(
        """\
        [workers]
        gpus = "all"
        gpus_per_worker = 2
        [sglang]
        model_path = "/m"
    """,
        gpu_count=8,
    )
    workers = spec.workers
    assert [w.gpus for w in workers] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [w.port for w in workers] == [30000, 30001, 30002, 30003]
    argv = build_command(spec.farm, workers[1]).argv
    assert argv[-2:] == ("--tp-size", "2")
    assert dict(build_command(spec.farm, workers[1]).env)["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_overrides_merge_flags_env_and_ports_over_the_farm_ones() -> None:
    spec = load("""\
        [farm]
        env = { A = "farm", B = "farm" }
        [workers]
        gpus = [0, 1, 2]
        base_port = 40000
        [workers.overrides.1]
        port = 45000
        nccl_port = 46000
        host = "10.0.0.1"
        env = { B = "one", C = "one" }
        sglang = { mem_fraction_static = 0.8, trust_remote_code = false, tool_call_parser = "qwen" }
        [sglang]
        model_path = "/m"
        mem_fraction_static = 0.9
        trust_remote_code = true
    """)
    w0, w1, w2 = spec.workers
    assert (w0.port, w0.nccl_port, w0.host) == (40000, 31000, "127.0.0.1")
    assert (w1.port, w1.nccl_port, w1.host) == (45000, 46000, "10.0.0.1")
    assert (w2.port, w2.nccl_port) == (40002, 31002)
    assert dict(w0.env) == {"A": "farm", "B": "farm"}
    assert dict(w1.env) == {"A": "farm", "B": "one", "C": "one"}
    assert dict(w0.flags) == {
        "model_path": "/m",
        "mem_fraction_static": 0.9,
        "trust_remote_code": True,
    }
    assert dict(w1.flags) == {
        "model_path": "/m",
        "mem_fraction_static": 0.8,
        "trust_remote_code": False,
        "tool_call_parser": "qwen",
    }
    assert "--trust-remote-code" not in build_command(spec.farm, w1).argv


def test_override_can_move_a_worker_to_a_free_gpu() -> None:
    spec = load("""\
        [workers]
        gpus = [0, 1]
        [workers.overrides.1]
        gpus = [5]
        [sglang]
        model_path = "/m"
    """)
    assert [w.gpus for w in spec.workers] == [(0,), (5,)]


def test_canary_false_means_no_canary() -> None:
    spec = load(MINIMAL + "[startup]\ncanary = false\n")
    assert spec.startup.canary is None


def test_model_path_is_optional_for_another_module() -> None:
    spec = load('[farm]\nmodule = "sglang_farm.sim"\n[workers]\ngpus = [0]\n')
    assert dict(spec.workers[0].flags) == {}


def test_sglang_values_keep_their_types_and_lists_become_tuples() -> None:
    spec = load(MINIMAL + 'context_length = "32k"\ncuda_graph_bs_decode = [1, 2, 4]\n')
    flags = spec.workers[0].flags
    assert flags["context_length"] == "32k" and flags["cuda_graph_bs_decode"] == (1, 2, 4)


# --- durations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30, 30.0),
        (2.5, 2.5),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("1h", 3600.0),
        ("2m30s", 150.0),
    ],
)
def test_durations_parse_numbers_and_unit_strings(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "ten", "5 m", "30", "1x", "s", "1h 30m", True, [1]])
def test_durations_reject_what_does_not_parse(value: object) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(value)


def test_durations_in_the_file_resolve_to_seconds() -> None:
    spec = load(
        MINIMAL + '[health]\nperiod = "1m30s"\ntimeout = 7\n[restart]\nbackoff_initial = 0\n'
    )
    assert (spec.health.period, spec.health.timeout) == (90.0, 7.0)
    assert spec.restart.backoff_initial == 0.0


def test_bad_and_non_positive_durations_are_problems() -> None:
    found = problems(
        MINIMAL + '[health]\nperiod = "often"\ntimeout = 0\n[restart]\nreset_after = -5\n'
    )
    assert found == [
        "farm.toml:7: health.period: expected a duration (seconds as a number, or a string like "
        "'500ms', '30s', '5m', '1h30m'), got 'often'",
        "farm.toml:8: health.timeout: expected a duration > 0 (seconds as a number, or a string "
        "like '500ms', '30s', '5m', '1h30m'), got 0",
        "farm.toml:10: restart.reset_after: expected a duration > 0 (seconds as a number, or a "
        "string like '500ms', '30s', '5m', '1h30m'), got -5",
    ]


def test_short_health_timeout_is_allowed() -> None:
    spec = load(MINIMAL + "[health]\ntimeout = 2\n")
    assert spec.health.timeout == 2.0


# --- each class of problem ------------------------------------------------------------


def test_syntax_error_names_the_line() -> None:
    problem = only_problem(MINIMAL + "[health\nperiod = 3\n")
    assert problem.startswith("farm.toml:6: TOML syntax: ")


def test_unknown_keys_suggest_the_close_one() -> None:
    found = problems(MINIMAL + "[startup]\nparalel = 2\n[metrcs]\nlisten = '127.0.0.1:1'\n")
    assert found[0].startswith(
        "farm.toml:7: startup.paralel: unknown key (did you mean "
        "'parallel'?); [startup] accepts: canary, parallel,"
    )
    assert found[1].startswith("farm.toml:8: metrcs: unknown key (did you mean 'metrics'?)")


def test_workers_env_points_to_farm_env() -> None:
    problem = only_problem(MINIMAL.replace("gpus = [0, 1]", "gpus = [0, 1]\nenv = {A = '1'}"))
    assert problem.startswith(
        "farm.toml:3: workers.env: unknown key (the farm-wide environment goes in [farm] env"
    )


def test_wrong_types_say_what_is_accepted() -> None:
    found = problems(MINIMAL + "[startup]\nparallel = '4'\ncanary = true\n[oom]\nenabled = 1\n")
    assert found == [
        "farm.toml:7: startup.parallel: expected an integer >= 1, got '4'",
        "farm.toml:8: startup.canary: expected a worker id (an integer) or false for no canary, "
        "got True",
        "farm.toml:10: oom.enabled: expected true or false, got 1",
    ]


def test_env_values_must_be_strings_and_cuda_visible_devices_is_the_farms() -> None:
    found = problems(MINIMAL + '[farm]\nenv = { N = 3, CUDA_VISIBLE_DEVICES = "1" }\n')
    assert found == [
        'farm.toml:7: farm.env.N: expected a string (quote it: N = "3"), got 3',
        "farm.toml:7: farm.env.CUDA_VISIBLE_DEVICES: the farm sets CUDA_VISIBLE_DEVICES from "
        "workers.gpus (one worker: workers.overrides.N.gpus); remove it here",
    ]


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1", '"0.9"'])
def test_mem_fraction_outside_zero_one_is_a_problem(value: str) -> None:
    problem = only_problem(MINIMAL + f"mem_fraction_static = {value}\n")
    assert problem.startswith(
        "farm.toml:6: sglang.mem_fraction_static: expected a number in (0, 1)"
    )


def test_chunked_prefill_size_must_be_a_plain_int() -> None:
    problem = only_problem(MINIMAL + 'chunked_prefill_size = "8k"\n')
    assert problem == (
        "farm.toml:6: sglang.chunked_prefill_size: expected an integer > 0, or -1 "
        "to disable (SGLang rejects '8k'), got '8k'"
    )


def test_gpu_used_twice_names_both_workers() -> None:
    problem = only_problem("""\
        [workers]
        gpus = [0, 1, 2, 3]
        [workers.overrides.2]
        gpus = [3]
        [sglang]
        model_path = "/m"
    """)
    assert problem == (
        "farm.toml:4: workers.overrides.2.gpus: GPU 3 is already used by worker 3; "
        "each GPU belongs to one worker"
    )


def test_gpu_listed_twice_or_missing_from_the_host() -> None:
    found = problems(MINIMAL.replace("[0, 1]", "[0, 1, 1, 9]"), gpu_count=8)
    assert found == [
        "farm.toml:2: workers.gpus: GPU 1 is listed twice; each GPU belongs to one worker",
        "farm.toml:2: workers.gpus: GPU 9 does not exist; this host has 8 GPU(s), 0..7",
    ]


def test_gpus_all_without_a_count_asks_for_a_list() -> None:
    problem = only_problem(MINIMAL.replace("[0, 1]", '"all"'))
    assert problem.startswith('farm.toml:2: workers.gpus: gpus = "all" needs NVML to count GPUs')
    assert "list them instead" in problem


def test_gpus_that_do_not_split_into_tp_workers() -> None:
    problem = only_problem(MINIMAL.replace("[0, 1]", "[0, 1, 2]\ngpus_per_worker = 2"))
    assert problem == (
        "farm.toml:3: workers.gpus_per_worker: 3 GPU(s) do not split into workers "
        "of 2; list a multiple of 2 GPUs in workers.gpus"
    )


def test_http_and_nccl_ports_share_one_namespace() -> None:
    found = problems("""\
        [workers]
        gpus = [0, 1, 2]
        base_port = 30000
        nccl_base_port = 30001
        [sglang]
        model_path = "/m"
    """)
    assert found == [
        "farm.toml:4: workers.nccl_base_port: port 30001 for worker 0 (NCCL) is already used by "
        "worker 1 (HTTP); every HTTP, NCCL and metrics port must be distinct",
        "farm.toml:4: workers.nccl_base_port: port 30002 for worker 1 (NCCL) is already used by "
        "worker 2 (HTTP); every HTTP, NCCL and metrics port must be distinct",
    ]


def test_override_port_clash_is_reported_on_the_override() -> None:
    problem = only_problem(MINIMAL + "[workers.overrides.1]\nport = 30000\n")
    assert problem.startswith(
        "farm.toml:7: workers.overrides.1.port: port 30000 for worker 1 "
        "(HTTP) is already used by worker 0 (HTTP)"
    )


def test_worker_port_clashing_with_metrics_listener() -> None:
    problem = only_problem(MINIMAL + '[metrics]\nlisten = "0.0.0.0:30001"\n')
    assert "port 30001 for worker 1 (HTTP) is already used by the metrics listener" in problem


def test_ports_out_of_range() -> None:
    found = problems(
        MINIMAL.replace("gpus = [0, 1]", "gpus = [0, 1]\nbase_port = 65535\nnccl_base_port = 0")
    )
    assert found == [
        "farm.toml:3: workers.base_port: 65535 + 1 (the last worker) exceeds 65535; choose a "
        "base port <= 65534",
        "farm.toml:4: workers.nccl_base_port: expected an integer in 1..65535, got 0",
    ]


def test_override_for_a_worker_that_does_not_exist() -> None:
    found = problems(MINIMAL + "[workers.overrides.2]\nport = 40000\n[workers.overrides.x]\n")
    assert found == [
        "farm.toml:6: workers.overrides.2: no worker 2; workers are 0..1 (2 GPU(s), 1 per worker)",
        "farm.toml:8: workers.overrides.x: expected a worker id (an integer 0..1), got 'x'",
    ]


def test_canary_that_is_not_a_worker() -> None:
    problem = only_problem(MINIMAL + "[startup]\ncanary = 2\n")
    assert problem == (
        "farm.toml:7: startup.canary: no worker 2; workers are 0..1 (or write "
        "canary = false for none)"
    )


def test_parallel_and_failure_threshold_below_one() -> None:
    found = problems(MINIMAL + "[startup]\nparallel = 0\n[health]\nfailure_threshold = 0\n")
    assert found == [
        "farm.toml:7: startup.parallel: expected an integer >= 1, got 0",
        "farm.toml:9: health.failure_threshold: expected an integer >= 1, got 0",
    ]


def test_sglang_keys_must_be_snake_case() -> None:
    problem = only_problem(MINIMAL + "mem-fraction-static = 0.8\n")
    assert problem == (
        "farm.toml:6: sglang.mem-fraction-static: SGLang flags are written in "
        "snake_case (mem_fraction_static for --mem-fraction-static), got "
        "'mem-fraction-static'; write 'mem_fraction_static'"
    )


@pytest.mark.parametrize(
    ("key", "where"),
    [
        ("host", "workers.host"),
        ("port", "workers.base_port"),
        ("nccl_port", "workers.nccl_base_port"),
        ("tp_size", "workers.gpus_per_worker"),
        ("tensor_parallel_size", "workers.gpus_per_worker"),
        ("base_gpu_id", "workers.gpus"),
    ],
)
def test_farm_owned_flags_in_sglang_name_where_to_set_them(key: str, where: str) -> None:
    problem = only_problem(MINIMAL + f"{key} = 1\n")
    assert problem.startswith(f"farm.toml:6: sglang.{key}: not allowed here: ")
    assert where in problem


def test_farm_owned_flags_are_refused_in_overrides_too() -> None:
    problem = only_problem(MINIMAL + "[workers.overrides.0.sglang]\nport = 1\n")
    assert problem.startswith("farm.toml:7: workers.overrides.0.sglang.port: not allowed here")


def test_model_path_is_required_for_sglang() -> None:
    problem = only_problem("[workers]\ngpus = [0]\n[sglang]\nlog_level = 'info'\n")
    assert problem == (
        "farm.toml:3: sglang.model_path: missing: SGLang requires --model-path; "
        "set model_path = '/path/to/model' in [sglang]"
    )


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (
            "mamba_scheduler_strategy = 'extra_buffer'",
            "SGLang 0.5.23 renamed --mamba-scheduler-strategy to --mamba-radix-cache-strategy "
            "(sgl-project/sglang#27418); keep it for SGLang <= 0.5.22, write "
            "mamba_radix_cache_strategy for SGLang >= 0.5.23",
        ),
        (
            "cuda_graph_max_bs = 8",
            "SGLang 0.5.23 split --cuda-graph-max-bs into --cuda-graph-max-bs-decode and "
            "--cuda-graph-max-bs-prefill (split per CUDA graph runner); keep it for SGLang "
            "<= 0.5.22, "
            "write cuda_graph_max_bs_decode and/or cuda_graph_max_bs_prefill for SGLang >= 0.5.23",
        ),
        (
            "disable_cuda_graph = true",
            "SGLang 0.5.23 deprecated --disable-cuda-graph (sglang/srt/server_args.py); it still "
            "works, and for SGLang >= 0.5.23 you may write cuda_graph_backend_decode = 'disabled' "
            "and cuda_graph_backend_prefill = 'disabled'",
        ),
    ],
)
def test_older_sglang_spellings_load_with_a_warning_naming_both_versions(
    key: str, says: str
) -> None:
    # Without SGLang at hand, a flag some SGLang version accepts is never refused.
    result = check_spec(MINIMAL + key + "\n", source="farm.toml")
    name = key.split(" ")[0]
    assert name in result.spec.workers[0].flags
    assert result.warnings == (f"farm.toml:6: sglang.{name}: {says}",)


def test_current_spellings_load_without_warnings() -> None:
    text = MINIMAL + "mamba_radix_cache_strategy = 'extra_buffer'\ncuda_graph_max_bs_decode = 8\n"
    assert check_spec(text, source="farm.toml").warnings == ()


def test_load_spec_file_and_check_spec_file_agree(tmp_path: Path) -> None:
    path = tmp_path / "farm.toml"
    path.write_text(MINIMAL + "mamba_scheduler_strategy = 'extra_buffer'\n")
    result = check_spec_file(path)
    assert result.spec == load_spec_file(path)
    assert len(result.warnings) == 1 and result.warnings[0].startswith(f"{path}:6: ")


def test_the_sglang_model_alias_is_refused_for_model_path() -> None:
    problem = only_problem(MINIMAL + "model = '/models/m'\n")
    assert problem == (
        "farm.toml:6: sglang.model: write model_path (the farm reads it for "
        "preflight; --model is only its alias)"
    )


@pytest.mark.parametrize("key", ["mamba_radix_cache_strategy", "mamba_scheduler_strategy"])
def test_no_buffer_needs_overlap_schedule_disabled(key: str) -> None:
    problem = only_problem(MINIMAL + f"{key} = 'no_buffer'\n")
    assert problem.startswith(
        f"farm.toml:6: sglang.{key}: 'no_buffer' makes "
        "SGLang 0.5.23 assert --disable-overlap-schedule"
    )
    load(MINIMAL + f"{key} = 'no_buffer'\ndisable_overlap_schedule = true\n")


@pytest.mark.parametrize("key", ["mamba_radix_cache_strategy", "mamba_scheduler_strategy"])
def test_mamba_strategy_values_are_checked_under_either_spelling(key: str) -> None:
    problem = only_problem(MINIMAL + f"{key} = 'extra'\n")
    assert problem == (
        f"farm.toml:6: sglang.{key}: expected one of 'auto', 'no_buffer', "
        "'extra_buffer', 'extra_buffer_lazy', got 'extra'"
    )


def test_sglang_values_that_cannot_become_argv() -> None:
    found = problems(MINIMAL + "cuda_graph_config = { decode = 1 }\nwarmups = []\n")
    assert found[0].startswith("farm.toml:6: sglang.cuda_graph_config: expected a flag value")
    assert "JSON flags take a string" in found[0]
    assert found[1].startswith("farm.toml:7: sglang.warmups: expected at least one item")


def test_metrics_listen_and_control_socket_shapes() -> None:
    found = problems(
        MINIMAL + '[metrics]\nlisten = "9840"\ngpu_source = "dcgm"\n'
        f'[control]\nsocket = "/{"x" * 120}"\n'
    )
    assert found[0].startswith("farm.toml:7: metrics.listen: expected 'host:port'")
    assert found[1] == (
        "farm.toml:8: metrics.gpu_source: expected one of 'nvml', 'fake', 'none', got 'dcgm'"
    )
    assert found[2].startswith(
        "farm.toml:10: control.socket: a Unix socket path must be at most 107 bytes"
    )


# --- the OOM ladder's shape -----------------------------------------------------------


def test_oom_step_needs_a_name_and_a_change() -> None:
    found = problems(MINIMAL + "[[oom.steps]]\nmin = { max_running_requests = 8 }\n")
    assert found == [
        "farm.toml:6: oom.steps[0].name: missing: each step needs a name (shown in status and "
        "metrics), e.g. name = 'no_buffer'",
        "farm.toml:6: oom.steps[0]: a step needs at least one of set, add, multiply (e.g. set = "
        "{ mamba_radix_cache_strategy = 'no_buffer' })",
        "farm.toml:7: oom.steps[0].min.max_running_requests: min bounds a flag this step adds to "
        "or multiplies; 'max_running_requests' is in neither add nor multiply of this step",
    ]


def test_oom_flag_changed_two_ways_in_one_step() -> None:
    problem = only_problem(
        MINIMAL + "max_running_requests = 64\n[[oom.steps]]\nname = 'a'\n"
        "set = { max_running_requests = 8 }\n"
        "multiply = { max_running_requests = 0.5 }\n"
    )
    assert problem == (
        "farm.toml:10: oom.steps[0].multiply.max_running_requests: flag is also in "
        "set of this step; a step changes a flag one way (set, add or multiply)"
    )


def test_oom_adjust_needs_a_configured_number_and_a_unique_name() -> None:
    found = problems(
        MINIMAL + "[[oom.steps]]\nname = 'a'\nadd = { mem_fraction_static = -0.02 }\n"
        "[[oom.steps]]\nname = 'a'\nset = { log_level = 'debug' }\n"
        "[[oom.steps]]\nname = 'b'\n"
        "set = { mamba_scheduler_strategy = 'no_buffer' }\n"
    )
    # The older spelling is not a problem (a warning); its no_buffer rule still applies.
    assert found == [
        "farm.toml:8: oom.steps[0].add.mem_fraction_static: add changes the configured value, but "
        "mem_fraction_static is not set to a number in [sglang]; set it there, e.g. "
        "mem_fraction_static = <number>",
        "farm.toml:10: oom.steps[1].name: step name 'a' is already used by oom.steps[0]; each step "
        "needs its own name",
        "farm.toml:14: oom.steps[2].set.mamba_scheduler_strategy: 'no_buffer' makes SGLang "
        "0.5.23 assert --disable-overlap-schedule; add disable_overlap_schedule = true to this "
        "step's set",
    ]


def test_oom_min_above_max_and_non_positive_factor() -> None:
    found = problems(
        MINIMAL + "max_running_requests = 64\n[[oom.steps]]\nname = 'a'\n"
        "multiply = { max_running_requests = 0 }\n[[oom.steps]]\nname = 'b'\n"
        "add = { max_running_requests = -8 }\nmin = { max_running_requests = 16 }\n"
        "max = { max_running_requests = 8 }\n"
    )
    assert found == [
        "farm.toml:9: oom.steps[0].multiply.max_running_requests: expected a factor > 0, got 0",
        "farm.toml:14: oom.steps[1].max.max_running_requests: max 8 is below min 16",
    ]


def test_oom_no_buffer_step_needs_overlap_schedule_disabled() -> None:
    problem = only_problem(
        MINIMAL + "[[oom.steps]]\nname = 'nb'\nset = { mamba_radix_cache_strategy = 'no_buffer' }\n"
    )
    assert problem.startswith(
        "farm.toml:8: oom.steps[0].set.mamba_radix_cache_strategy: "
        "'no_buffer' makes SGLang 0.5.23 assert --disable-overlap-schedule"
    )


# --- all at once ----------------------------------------------------------------------

SEVERAL_MISTAKES = """\
[farm]
python = "python3"

[workers]
gpus = [0, 1, 2, 3]

[workers.overrides.2]
gpus = [3]

[startup]
canary = 7

[health]
period = "ten seconds"

[sglang]
model_path = "/m"
mamba_scheduler_strategy = "extra_buffer"
mem_fraction_static = 1.2
"""


def test_several_mistakes_are_reported_together_with_their_lines() -> None:
    with pytest.raises(ConfigError) as info:
        load_spec(SEVERAL_MISTAKES, source="/etc/sglang-farm/farm.toml")
    found = [p.split(": ", 2)[:2] for p in info.value.problems]
    assert found == [
        ["/etc/sglang-farm/farm.toml:2", "farm.python"],
        ["/etc/sglang-farm/farm.toml:8", "workers.overrides.2.gpus"],
        ["/etc/sglang-farm/farm.toml:11", "startup.canary"],
        ["/etc/sglang-farm/farm.toml:14", "health.period"],
        ["/etc/sglang-farm/farm.toml:19", "sglang.mem_fraction_static"],
    ]
    # mamba_scheduler_strategy (line 18) is SGLang 0.5.12's spelling: not a problem.
    assert str(info.value).startswith("/etc/sglang-farm/farm.toml: 5 problems\n  /etc/sglang-farm/")


def test_lines_are_found_for_dotted_keys_quoted_keys_and_multiline_values() -> None:
    found = problems("""\
        [workers]
        gpus = [
            0, 1,
        ]
        overrides."1".port = 0
        [sglang]
        model_path = '''
        not = a key
        '''
        "mem_fraction_static" = 2
    """)
    assert found == [
        "farm.toml:5: workers.overrides.1.port: expected an integer in 1..65535, got 0",
        # A multi-line string holds newlines, which no rendered value may.
        "farm.toml:7: sglang.model_path: contains a newline, a control character: every value "
        "must be one line of printable text (it goes into unit files, command lines and "
        "environments); remove it (a JSON value fits on one line)",
        "farm.toml:10: sglang.mem_fraction_static: expected a number in (0, 1), the fraction of "
        "GPU memory, got 2",
    ]


# --- the file shell -------------------------------------------------------------------


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_spec_file(path)
    assert info.value.problems == (
        f"{path}: no such file; write one (the package ships /etc/sglang-farm/farm.toml) or pass "
        "--config PATH",
    )


def test_unreadable_and_non_utf8_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec_file(tmp_path)  # a directory
    latin = tmp_path / "latin1.toml"
    latin.write_bytes(b"[farm]\nname = 'caf\xe9'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_spec_file(latin)


def test_file_problems_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "farm.toml"
    path.write_text(MINIMAL + "[startup]\ncanary = 9\n")
    with pytest.raises(ConfigError) as info:
        load_spec_file(path)
    assert info.value.problems[0].startswith(f"{path}:7: startup.canary: no worker 9")


# --- sglang_flags: the rename table, both directions -------------------------------------


@pytest.mark.parametrize(
    ("key", "version", "spelling"),
    [
        ("mamba_scheduler_strategy", (0, 5, 12), "mamba_scheduler_strategy"),
        ("mamba_scheduler_strategy", (0, 5, 22), "mamba_scheduler_strategy"),
        ("mamba_scheduler_strategy", (0, 5, 23), "mamba_radix_cache_strategy"),
        ("mamba_radix_cache_strategy", (0, 5, 12), "mamba_scheduler_strategy"),
        ("mamba_radix_cache_strategy", (0, 5, 23), "mamba_radix_cache_strategy"),
        ("cuda_graph_max_bs", (0, 5, 12), "cuda_graph_max_bs"),
        ("cuda_graph_max_bs", (0, 5, 23), None),  # split in two: no single spelling
        ("cuda_graph_max_bs_prefill", (0, 5, 12), "cuda_graph_max_bs"),
        ("disable_cuda_graph", (0, 5, 23), "disable_cuda_graph"),  # deprecated, still accepted
        ("cuda_graph_backend_decode", (0, 5, 12), None),  # values do not carry over
        ("mem_fraction_static", (0, 5, 12), "mem_fraction_static"),  # not renamed
    ],
)
def test_spelling_for_answers_in_both_directions(
    key: str, version: tuple[int, ...], spelling: str | None
) -> None:
    assert sglang_flags.spelling_for(key, version) == spelling


def test_sglang_versions_parse_with_suffixes() -> None:
    assert sglang_flags.parse_version("0.5.12") == (0, 5, 12)
    assert sglang_flags.parse_version("0.5.23.post1+cu130") == (0, 5, 23)
    assert sglang_flags.parse_version(None) is None
    assert sglang_flags.parse_version("unknown") is None


# --- values that would inject or break unit directives (issue 15, items 3 and 16) ------------


def test_a_user_with_a_newline_cannot_inject_a_unit_directive() -> None:
    problem = only_problem(MINIMAL + '[farm]\nuser = "root\\nExecStartPre=+/bin/sh"\n')
    assert problem.startswith("farm.toml:7: farm.user: ")
    assert "newline" in problem and "one line" in problem


@pytest.mark.parametrize("key", ["user", "group"])
@pytest.mark.parametrize(
    "value", ["-sglang", "sg lang", "sg:lang", "0day", "a/b", "x" * 33, "sglang%i", "root\\r"]
)
def test_user_and_group_follow_the_posix_name_rules(key: str, value: str) -> None:
    problem = only_problem(MINIMAL + f'[farm]\n{key} = "{value}"\n')
    assert problem.startswith(f"farm.toml:7: farm.{key}: ")
    assert "a letter or '_'" in problem or "control character" in problem


@pytest.mark.parametrize("name", ["sglang", "_svc", "ai-workers", "john.doe", "x" * 32])
def test_ordinary_user_and_group_names_load(name: str) -> None:
    spec = load(MINIMAL + f'[farm]\nuser = "{name}"\ngroup = "{name}"\n')
    assert (spec.farm.user, spec.farm.group) == (name, name)


def test_the_control_socket_group_follows_the_same_rules() -> None:
    problem = only_problem(MINIMAL + '[control]\ngroup = "farm ops"\n')
    assert problem.startswith("farm.toml:7: control.group: expected a group name")


@pytest.mark.parametrize(
    "value",
    [
        '"--x 1\\nExecStartPre=+/bin/sh"',
        "'''\nmulti\n'''",
        '["a", "b\\nc"]',
        '"nul\\u0000"',
        '"tab\\there"',
        '"del\\u007f"',
    ],
)
def test_a_flag_value_with_a_control_character_is_refused(value: str) -> None:
    problem = only_problem(MINIMAL + f"served_model_name = {value}\n")
    assert problem.startswith("farm.toml:6: sglang.served_model_name: ")
    assert "control character" in problem and "one line" in problem


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0 ", "bad host", "127.0.0.1\\nExecStartPre=+/bin/sh", "host;rm", "", "[::1", "--help"],
)
def test_a_worker_host_that_is_not_a_name_or_address_is_refused(host: str) -> None:
    problem = only_problem(
        MINIMAL + f'host = "{host}"\n'.replace("host", "[workers.overrides.0]\nhost", 1)
    )
    assert problem.startswith("farm.toml:7: workers.overrides.0.host: ")
    problem = only_problem(MINIMAL.replace("gpus = [0, 1]", f'gpus = [0, 1]\nhost = "{host}"'))
    assert problem.startswith("farm.toml:3: workers.host: ")


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.0.0.5", "10.0.0.5"),
        ("gpu-host-1.example", "gpu-host-1.example"),
        ("::", "::"),
        ("[::1]", "::1"),
        ("0.0.0.0", "0.0.0.0"),
    ],
)
def test_worker_hosts_that_are_names_or_addresses_load(host: str, expected: str) -> None:
    spec = load(MINIMAL.replace("gpus = [0, 1]", f'gpus = [0, 1]\nhost = "{host}"'))
    assert spec.workers[0].host == expected


def test_control_characters_are_refused_in_every_value_a_unit_carries() -> None:
    found = problems("""\
        [farm]
        python = "/opt/sglang/bin/python3\\n"
        state_dir = "/var/lib/x\\ny"
        env = { HF_TOKEN = "abc\\u0000def" }
        [workers]
        gpus = [0, 1]
        [workers.overrides.1]
        env = { X = "a\\rb" }
        sglang = { tool_call_parser = "q\\u001bwen" }
        [control]
        socket = "/run/x\\n.sock"
        [gateway]
        extra_args = ["--x", "y\\nz"]
        [[oom.steps]]
        name = "s"
        set = { served_model_name = "m\\n" }
        [sglang]
        model_path = "/models/\\u0000m"
        uvicorn_access_log_exclude_prefixes = ["/health", "/met\\nrics"]
    """)
    where = [p.split(": ")[1] for p in found]
    assert where == [
        "farm.python",
        "farm.state_dir",
        "farm.env.HF_TOKEN",
        "workers.overrides.1.env.X",
        "workers.overrides.1.sglang.tool_call_parser",
        "control.socket",
        "gateway.extra_args",
        "oom.steps[0].set.served_model_name",
        "sglang.model_path",
        "sglang.uvicorn_access_log_exclude_prefixes",
    ], found  # each once: no second problem for the same value
    assert all("control character" in p for p in found), found
    assert "NUL" in found[2] and "(item 2)" in found[6] and "(item 2)" in found[-1]


@pytest.mark.parametrize(
    "python",
    [
        '/opt/a\\"b/python3',
        "/opt/$HOME/python3",
        "/opt/a\\\\b/python3",
        "/opt/my env/python3",
        "/opt/it's/python3",
        "/opt/x\\n/python3",
    ],
)
def test_a_python_path_systemd_cannot_run_is_refused(python: str) -> None:
    problem = only_problem(MINIMAL + f'[farm]\npython = "{python}"\n')
    assert problem.startswith("farm.toml:7: farm.python: ")
    assert "symlink" in problem or "control character" in problem


@pytest.mark.parametrize("value", ["nan", "inf", "+inf", "-inf", '"9' + "9" * 400 + 's"'])
@pytest.mark.parametrize(
    "key",
    [
        "startup.load_timeout",
        "restart.stop_timeout",
        "restart.backoff_initial",
        "gateway.drain_timeout",
    ],
)
def test_nan_and_infinite_durations_are_refused(key: str, value: str) -> None:
    section, name = key.split(".")
    problem = only_problem(MINIMAL + f"[{section}]\n{name} = {value}\n")
    assert problem.startswith(f"farm.toml:7: {key}: expected a duration")
    assert "finite" in problem


def test_durations_longer_than_systemd_can_hold_are_refused() -> None:
    problem = only_problem(MINIMAL + "[startup]\nload_timeout = 1e20\n")
    assert problem.startswith("farm.toml:7: startup.load_timeout: expected a duration of at most")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_and_infinite_numbers_are_refused_in_flags_and_oom_steps(value: str) -> None:
    found = problems(
        MINIMAL + f"context_length = {value}\nmax_running_requests = 8\n"
        f"[[oom.steps]]\nname = 'a'\nmultiply = {{ max_running_requests = {value} }}\n"
        f"[[oom.steps]]\nname = 'b'\nadd = {{ max_running_requests = -1 }}\n"
        f"min = {{ max_running_requests = {value} }}\n"
    )
    where = [p.split(": ")[1] for p in found]
    assert where == [
        "sglang.context_length",
        "oom.steps[0].multiply.max_running_requests",
        "oom.steps[1].min.max_running_requests",
    ], found
    assert all("finite" in p for p in found), found


# --- workers reachable without a key (issue 15, item 5) ---------------------------------------


def test_workers_on_a_public_address_without_api_key_are_a_warning() -> None:
    text = MINIMAL.replace("gpus = [0, 1]", 'gpus = [0, 1, 2]\nhost = "0.0.0.0"')
    text += '[workers.overrides.2]\nhost = "127.0.0.1"\n'
    result = check_spec(text, source="farm.toml")
    (warning,) = result.warnings
    assert warning.startswith(
        "farm.toml:3: workers.host: workers 0-1 listen on '0.0.0.0' (not loopback) without api_key"
    )
    assert 'host = "127.0.0.1"' in warning and "gateway" in warning and "api_key" in warning
    assert "docs/config.md" in warning


def test_a_managed_gateway_off_loopback_needs_no_key_file_and_warns_of_keyless_users() -> None:
    """The worker API of a managed gateway always has a key now (generated when no
    admin_key_file is set): off loopback only users' requests are open, a warning."""
    text = MINIMAL + '[gateway]\nmode = "managed"\nlisten = "0.0.0.0:8000"\n'
    (warning,) = check_spec(text, source="farm.toml").warnings
    assert warning.startswith("farm.toml:8: gateway.listen: the gateway listens on '0.0.0.0'")
    assert "api_key_file" in warning and "anyone who reaches it can send requests" in warning
    keyed = text + 'api_key_file = "/etc/sglang-farm/users.key"\n'
    assert check_spec(keyed, source="farm.toml").warnings == ()


def test_an_override_host_off_loopback_is_warned_about_on_the_override() -> None:
    text = MINIMAL + '[workers.overrides.1]\nhost = "10.0.0.5"\n'
    (warning,) = check_spec(text, source="farm.toml").warnings
    assert warning.startswith(
        "farm.toml:7: workers.overrides.1.host: worker 1 listens on "
        "'10.0.0.5' (not loopback) without api_key"
    )


@pytest.mark.parametrize(
    "extra",
    ['host = "0.0.0.0"\n[sglang]\napi_key = "k"\n', 'host = "localhost"\n', 'host = "::1"\n', ""],
)
def test_loopback_or_keyed_workers_are_not_warned_about(extra: str) -> None:
    text = "[workers]\ngpus = [0, 1]\n" + extra
    if "[sglang]" not in text:
        text += "[sglang]\n"
    text += 'model_path = "/models/m"\n'
    assert check_spec(text, source="farm.toml").warnings == ()


# --- the GPU count for review and CI (issue 15, item 25) ---------------------------------------


def test_check_config_takes_the_gpu_count_for_the_shipped_farm_toml() -> None:
    from click.testing import CliRunner

    from sglang_farm.cli.main import cli

    config = ETC / "farm.toml"
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config), "--gpus", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{config}: OK, 8 workers (ports 30000-30007)\n"
    # The seed binds 0.0.0.0 with no api_key: a warning, not a failure.
    assert "workers 0-7 listen on '0.0.0.0' (not loopback) without api_key" in result.stderr


def test_check_config_without_a_gpu_count_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from click.testing import CliRunner

    from sglang_farm.cli import main

    monkeypatch.setattr(main, "gpu_count_for_config", lambda path: None)  # as without NVML
    config = ETC / "farm.toml"
    result = CliRunner().invoke(main.cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 1
    assert 'workers.gpus: gpus = "all" needs' in result.stderr
    assert "--gpus N" in result.stderr


def test_render_takes_the_gpu_count_for_the_shipped_farm_toml(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sglang_farm.cli.main import cli

    args = ["render", "--config", str(ETC / "farm.toml"), "--gpus", "2", "--out", str(tmp_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    dropins = sorted(p.parent.name for p in tmp_path.glob("sglang@*.service.d/*.conf"))
    assert dropins == ["sglang@0.service.d", "sglang@1.service.d"]


@pytest.mark.parametrize("command", ["check-config", "render", "doctor"])
def test_the_gpu_count_must_be_positive(command: str) -> None:
    from click.testing import CliRunner

    from sglang_farm.cli.main import cli

    result = CliRunner().invoke(cli, [command, "--config", str(ETC / "farm.toml"), "--gpus", "0"])
    assert result.exit_code == 2
    assert "Invalid value for '--gpus': 0 is not in the range x>=1" in result.stderr


@pytest.mark.parametrize("path", ["/etc/sglang-farm/admin.key ", "/etc/sglang-farm/admin.key\\\\"])
def test_a_key_file_path_systemd_would_misread_is_refused(path: str) -> None:
    problem = only_problem(MINIMAL + f'[gateway]\nadmin_key_file = "{path}"\n')
    assert problem.startswith("farm.toml:7: gateway.admin_key_file: ")
    assert "blank" in problem and "backslash" in problem


def test_check_config_passes_a_0644_file_with_a_secret_in_a_folder_only_root_enters(
    tmp_path: Path,
) -> None:
    """A file every user could read fails the check (tests/test_keyfiles.py, as nobody);
    pytest's tmp_path lies under a 0700 folder, as Ansible's `validate:` copy does: no
    other user reaches it, whatever its mode."""
    from click.testing import CliRunner

    from sglang_farm.cli.main import cli

    config = tmp_path / "farm.toml"
    config.write_text('[farm]\nenv = { HF_TOKEN = "hf_secret" }\n' + MINIMAL)
    config.chmod(0o644)
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "every local user" not in result.stderr and "hf_secret" not in result.output


def test_check_config_is_quiet_about_a_world_readable_file_whose_env_holds_no_credential(
    tmp_path: Path,
) -> None:
    """The README's OOM walkthrough (a 0644 copy of the demo with SGLANG_SIM_FAIL_AFTER)
    drew a warning that it was world-readable: that value is no secret. Nor is
    TOKENIZERS_PARALLELISM's (whole words of the name count, not letters in it)."""
    import shutil
    import tempfile

    from click.testing import CliRunner

    from sglang_farm.cli.main import cli

    open_folder = Path(tempfile.mkdtemp(prefix="sf-config-", dir="/var/tmp"))
    try:
        open_folder.chmod(0o755)  # every user can reach the file (unlike tmp_path)
        config = open_folder / "farm.toml"
        env = '{ SGLANG_SIM_FAIL_AFTER = "15", TOKENIZERS_PARALLELISM = "false" }'
        config.write_text(f"[farm]\nenv = {env}\n" + MINIMAL)
        config.chmod(0o644)
        result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
        assert result.exit_code == 0, result.output
        assert "every local user" not in result.stderr
        config.write_text('[farm]\nenv = { HF_TOKEN = "x" }\n' + MINIMAL)  # the rule is on
        result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
        assert result.exit_code == 1 and "every local user" in result.stderr, result.output
    finally:
        shutil.rmtree(open_folder, ignore_errors=True)


def test_a_managed_gateway_refuses_power_of_two_which_smg_cannot_start_with_no_worker() -> None:
    """smg 1.13 exits at start with "Power-of-two policy requires at least 2 workers"
    (tried: `smg launch --policy power_of_two` with no --worker-urls), and the managed
    gateway always starts with none (workers join as they become ready): the config is
    refused at load, not a gateway that never starts. An external gateway's own policy is
    its operator's; `policy` is then unused."""
    text = MINIMAL + '[gateway]\nmode = "managed"\npolicy = "power_of_two"\n'
    assert only_problem(text) == (
        "farm.toml:8: gateway.policy: smg 1.13 refuses to start 'power_of_two' with fewer "
        "than 2 workers, and the managed gateway starts with none (each worker joins when "
        "ready): choose 'least_load' (also picks the less loaded worker) or another policy"
    )
    assert load(MINIMAL + '[gateway]\nmode = "managed"\npolicy = "least_load"\n')
