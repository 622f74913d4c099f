"""Config rules that mutation testing found unheld (issue 27): bounds named in messages
(ports, durations, socket paths, sizes) and the cross-field rules, each at its edge."""

from __future__ import annotations

from pathlib import Path

import pytest

from configtext import MINIMAL, load, only_problem, problems
from sglang_farm.config import (
    MAX_DURATION_S,
    check_spec,
    check_spec_file,
    load_spec,
    parse_duration,
)
from sglang_farm.errors import ConfigError
from sglang_farm.spec import FarmSpec


def test_backoff_max_may_equal_but_not_undercut_backoff_initial() -> None:
    ok = load(MINIMAL + '[restart]\nbackoff_initial = "10s"\nbackoff_max = "10s"\n')
    assert ok.restart.backoff_max == 10.0
    assert (
        only_problem(MINIMAL + '[restart]\nbackoff_initial = "10s"\nbackoff_max = "9s"\n')
        == "farm.toml:8: restart.backoff_max: must be >= backoff_initial (10 s), got 9 s"
    )


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_a_listen_port_in_range_is_accepted(port: int) -> None:
    spec = load(MINIMAL + f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    assert str(spec.metrics.listen) == f"127.0.0.1:{port}"


@pytest.mark.parametrize("listen", ["127.0.0.1:65536", ":80", "127.0.0.1:x"])
def test_a_listen_port_out_of_range_is_refused(listen: str) -> None:
    assert only_problem(MINIMAL + f'[metrics]\nlisten = "{listen}"\n') == (
        "farm.toml:7: metrics.listen: expected 'host:port' (e.g. '127.0.0.1:9840', "
        f"'[::1]:9840') with a port in 0..65535, got '{listen}'"
    )


def test_a_duration_may_be_a_year_and_no_more() -> None:
    assert MAX_DURATION_S == 365 * 24 * 3600
    assert parse_duration("8760h") == MAX_DURATION_S
    assert parse_duration(float(MAX_DURATION_S)) == MAX_DURATION_S
    with pytest.raises(ValueError, match=r"at most 31536000 s \(365 days\), got '8760h1s'"):
        parse_duration("8760h1s")
    # A TOML integer past what a float holds exactly is just too long.
    with pytest.raises(ValueError, match="at most"):
        parse_duration(10**18)
    assert parse_duration(10**6) == 1e6


def test_a_control_socket_path_may_take_107_bytes() -> None:
    path = "/run/" + "s" * 102
    assert len(path) == 107
    assert load(MINIMAL + f'[control]\nsocket = "{path}"\n').control.socket == path
    assert only_problem(MINIMAL + f'[control]\nsocket = "{path}x"\n').startswith(
        "farm.toml:7: control.socket: a Unix socket path must be at most 107 bytes, got 108: "
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ('"512"', 512),
        ('"2B"', 2),
        ('"2KiB"', 2 << 10),
        ('"2MiB"', 2 << 20),
        ('"2GiB"', 2 << 30),
        ('"2TiB"', 2 << 40),
        ('"2KB"', 2 * 10**3),
        ('"2MB"', 2 * 10**6),
        ('"2GB"', 2 * 10**9),
        ('"2TB"', 2 * 10**12),
        ('"1.5 GiB"', 3 << 29),
    ],
)
def test_model_headroom_sizes_and_their_units(text: str, size: int) -> None:
    spec = load(MINIMAL + f'[model]\nsource = "/srv/models/m"\nheadroom = {text}\n')
    assert spec.model is not None and spec.model.headroom == size


def test_a_negative_headroom_is_refused() -> None:
    assert "expected a size" in only_problem(
        MINIMAL + '[model]\nsource = "/srv/models/m"\nheadroom = -1\n'
    )


def test_an_external_gateway_needs_its_url() -> None:
    assert only_problem(MINIMAL + '[gateway]\nmode = "external"\n') == (
        "farm.toml:6: gateway.url: missing: mode = 'external' needs the gateway's url "
        "(e.g. url = 'http://10.0.0.5:8000'), or urls = [...] for several gateways"
    )
    spec = load(MINIMAL + '[gateway]\nmode = "external"\nurl = "http://10.0.0.5:8000"\n')
    assert spec.gateway.url == "http://10.0.0.5:8000"


def test_a_managed_gateway_off_loopback_warns_of_keyless_users_unless_api_key_file() -> None:
    """Its worker API always has a key (generated without admin_key_file); only users'
    requests may be open, which check-config says off loopback."""
    text = MINIMAL + '[gateway]\nmode = "managed"\nlisten = "0.0.0.0:8000"\n'
    (warning,) = check_spec(text, source="farm.toml").warnings
    assert warning == (
        "farm.toml:8: gateway.listen: the gateway listens on '0.0.0.0' (not loopback) without "
        "api_key_file: anyone who reaches it can send requests; set api_key_file to require "
        "a key, or listen on 127.0.0.1"
    )
    assert load(text + 'admin_key_file = "/etc/sglang-farm/key"\n').gateway.mode == "managed"
    keyed = text + 'api_key_file = "/etc/sglang-farm/key"\n'
    assert check_spec(keyed, source="farm.toml").warnings == ()
    loopback = MINIMAL + '[gateway]\nmode = "managed"\nlisten = "127.0.0.1:8000"\n'
    assert check_spec(loopback, source="farm.toml").warnings == ()
    assert str(load(MINIMAL + '[gateway]\nmode = "managed"\n').gateway.listen) == "127.0.0.1:8000"


def test_a_managed_gateway_refuses_the_flags_the_farm_sets() -> None:
    assert only_problem(MINIMAL + '[gateway]\nmode = "managed"\nextra_args = ["--port=9"]\n') == (
        "farm.toml:8: gateway.extra_args: --port is set by the farm from [gateway] (listen, "
        "policy, metrics_listen, the key files); remove it"
    )
    spec = load(MINIMAL + '[gateway]\nmode = "managed"\nextra_args = ["--log-level=debug"]\n')
    assert spec.gateway.extra_args == ("--log-level=debug",)


@pytest.mark.parametrize(
    ("flag", "problem"),
    [
        ("chunked_prefill_size = 0", "expected an integer > 0, or -1 to disable"),
        ("chunked_prefill_size = -2", "expected an integer > 0, or -1 to disable"),
        ("max_running_requests = 0", "expected an integer >= 1, got 0"),
        ('served_model_name = "a:b"', "has no ':', got 'a:b'"),
    ],
)
def test_flag_values_sglang_would_reject(flag: str, problem: str) -> None:
    assert problem in only_problem(MINIMAL + flag + "\n")


@pytest.mark.parametrize(
    "flag",
    [
        "chunked_prefill_size = -1",
        "chunked_prefill_size = 1",
        "max_running_requests = 1",
        'served_model_name = "qwen"',
        'tokenizer_path = "a:b"',
    ],
)
def test_flag_values_sglang_accepts(flag: str) -> None:
    load(MINIMAL + flag + "\n")


@pytest.mark.parametrize(
    "text",
    [
        "[farm]\nname = 5\n",
        "[farm]\nmodule = 5\n",
        "[farm]\nstate_dir = 5\n",
        "[health]\npath = 5\n",
        "[metrics]\nlisten = 5\n",
        '[gateway]\nmode = "external"\nurl = 5\n',
        '[gateway]\nmode = "external"\nurl = "http://a b"\n',
        '[gateway]\nmode = "managed"\nextra_args = "--x"\n',
        '[gateway]\nmode = "managed"\nextra_args = [1]\n',
        '[model]\nsource = "Qwen/Qwen3-8B"\nrevision = 5\n',
        "[[oom.steps]]\nname = 5\nadd = { mem_fraction_static = -0.02 }\n",
    ],
)
def test_a_value_of_the_wrong_type_is_refused(text: str) -> None:
    assert "expected" in problems(MINIMAL + text)[0]


@pytest.mark.parametrize(
    "text",
    [
        '[gateway]\nmode = "external"\nurl = "https://gw.example:8000/"\n',
        '[gateway]\nmode = "managed"\nextra_args = ["--log-level=debug", "--x"]\n',
    ],
)
def test_a_value_of_the_right_type_is_taken(text: str) -> None:
    load(MINIMAL + text)


MULTILINE = "\n".join(
    [
        "tags = [  # a comment with [ and {",
        '  "x]#",',
        "  'y[{',",
        r'  "q\"]",',
        "]",
        'notes = """a',
        "\"] ''' # {",
        '"""',
        "other = '''b",
        '"""',
        "'''",
        r'esc = """c\"""',
        '"""',
        "max_running_requests = 0",
        "",
    ]
)


def test_problems_name_the_right_line_after_values_that_span_lines() -> None:
    found = problems(MINIMAL + MULTILINE)
    assert [p.split(" ", 2)[:2] for p in found] == [
        ["farm.toml:11:", "sglang.notes:"],
        ["farm.toml:14:", "sglang.other:"],
        ["farm.toml:17:", "sglang.esc:"],
        ["farm.toml:19:", "sglang.max_running_requests:"],
    ]


def test_a_quoted_key_is_found_on_its_line() -> None:
    text = MINIMAL + "dtype = 'auto'\n'max_running_requests' = 0\n"
    assert only_problem(text).startswith("farm.toml:7: sglang.max_running_requests: ")


def workers(gpus: str, extra: str = "") -> str:
    return f'[workers]\ngpus = {gpus}\n{extra}\n[sglang]\nmodel_path = "/models/m"\n'


def test_gpus_all_needs_a_gpu_to_count() -> None:
    assert problems(workers('"all"'), gpu_count=0) == [
        'farm.toml:2: workers.gpus: gpus = "all" but this host has no GPU that NVML can see'
    ]
    assert [w.gpus for w in load(workers('"all"'), gpu_count=1).workers] == [(0,)]


@pytest.mark.parametrize("gpus", ["[-1]", "[]", "5", '[0, "a"]'])
def test_gpus_must_be_a_non_empty_list_of_indices(gpus: str) -> None:
    assert problems(workers(gpus)) == [
        'farm.toml:2: workers.gpus: expected "all" or a non-empty list of GPU indices '
        f"(integers >= 0), got {gpus.replace(chr(34), chr(39))}"
    ]


def test_a_gpu_index_must_exist_on_this_host() -> None:
    assert problems(workers("[0, 2]"), gpu_count=2) == [
        "farm.toml:2: workers.gpus: GPU 2 does not exist; this host has 2 GPU(s), 0..1"
    ]
    assert len(load(workers("[0, 1]"), gpu_count=2).workers) == 2


def test_the_last_workers_port_must_exist() -> None:
    assert load(workers("[0, 1]", "base_port = 65534\n")).workers[1].port == 65535
    assert problems(workers("[0, 1]", "base_port = 65535\n")) == [
        "farm.toml:3: workers.base_port: 65535 + 1 (the last worker) exceeds 65535; "
        "choose a base port <= 65534"
    ]


def test_overrides_are_checked_even_without_workers_to_lay_out() -> None:
    assert problems(workers("[0, 1]", "overrides = 5\n")) == [
        "farm.toml:3: workers.overrides: expected tables [workers.overrides.N], got 5"
    ]
    text = workers("[]", "\n[workers.overrides.0]\nsglang = 5\n")
    assert problems(text)[1:] == [
        "farm.toml:5: workers.overrides.0.sglang: expected a table of SGLang flags, got 5"
    ]
    text = workers("[0, 1]", '\n[workers.overrides.0]\ngpus = "all"\n')
    assert problems(text, gpu_count=2) == [
        "farm.toml:5: workers.overrides.0.gpus: expected a list of this worker's GPUs, got 'all'"
    ]


OOM_STEP = MINIMAL + 'mem_fraction_static = 0.8\n\n[[oom.steps]]\nname = "a"\n'


def test_an_oom_step_names_each_of_its_problems() -> None:
    assert problems(OOM_STEP + "add = 5\n")[1:] == [
        "farm.toml:10: oom.steps[0].add: expected a table of flag = value, got 5"
    ]
    bounds = "add = { mem_fraction_static = -0.1 }\nmin = { mem_fraction_static = 0.6 }\n"
    assert problems(OOM_STEP + bounds + "max = { mem_fraction_static = 0.5 }\n") == [
        "farm.toml:12: oom.steps[0].max.mem_fraction_static: max 0.5 is below min 0.6"
    ]
    spec = load(OOM_STEP + bounds + "max = { mem_fraction_static = 0.6 }\n")
    assert spec.oom.steps[0].adjust[0].min == spec.oom.steps[0].adjust[0].max == 0.6
    found = problems(OOM_STEP + 'set = { "bad key" = 1, tp_size = 2, max_running_requests = 0 }\n')
    assert [p.split(": ", 2)[1] for p in found] == [
        "oom.steps[0].set.'bad key'",
        "oom.steps[0].set.tp_size",
        "oom.steps[0].set.max_running_requests",
    ]
    found = problems(
        OOM_STEP + "set = { mem_fraction_static = 0.7 }\n"
        'add = { mem_fraction_static = 0.1, chunked_prefill_size = "x" }\n'
    )
    assert found == [
        "farm.toml:11: oom.steps[0].add.mem_fraction_static: flag is also in set of this "
        "step; a step changes a flag one way (set, add or multiply)",
        "farm.toml:11: oom.steps[0].add.chunked_prefill_size: expected a number, got 'x'",
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            MINIMAL + "cuda_graph_bs = [1, true]\n",
            "farm.toml:6: sglang.cuda_graph_bs: expected a list of strings or numbers, "
            "got [1, True]",
        ),
        (
            MINIMAL + "cuda_graph_bs = [1, nan]\n",
            "farm.toml:6: sglang.cuda_graph_bs: expected a finite number, got nan",
        ),
        (
            MINIMAL + "chunked_prefill_size = true\n",
            "farm.toml:6: sglang.chunked_prefill_size: expected an integer > 0, or -1 to "
            "disable (SGLang rejects '8k'), got True",
        ),
        (
            MINIMAL + 'max_running_requests = "8"\n',
            "farm.toml:6: sglang.max_running_requests: expected an integer >= 1, got '8'",
        ),
        (
            MINIMAL + 'served_model_name = "a\\u0000b"\n',
            "farm.toml:6: sglang.served_model_name: contains a NUL, a control character: every "
            "value must be one line of printable text (it goes into unit files, command lines "
            "and environments; no process can receive a NUL); remove it (a JSON value fits "
            "on one line)",
        ),
        ("metrics = 5\n" + MINIMAL, "farm.toml:1: metrics: expected a table, got 5"),
        (
            "[farm]\nenv = 5\n" + MINIMAL,
            'farm.toml:2: farm.env: expected a table of NAME = "value", got 5',
        ),
        (
            '[farm.env]\n"1X" = "v"\n' + MINIMAL,
            "farm.toml:2: farm.env.1X: expected an environment variable name (letters, "
            "digits, '_', not starting with a digit)",
        ),
        (
            "[oom]\nsteps = 5\n" + MINIMAL,
            "farm.toml:2: oom.steps: expected a list of steps ([[oom.steps]] tables), got 5",
        ),
        (
            workers("[0]", "base_port = 70000\n"),
            "farm.toml:3: workers.base_port: expected an integer in 1..65535, got 70000",
        ),
        (
            MINIMAL + "[[oom.steps]]\nname = 5\nset = { max_running_requests = 8 }\n",
            "farm.toml:7: oom.steps[0].name: expected a non-empty string, got 5",
        ),
        (
            MINIMAL + '[gateway]\nmode = "managed"\nlisten = "127.0.0.1:9840"\n',
            "farm.toml:8: gateway.listen: port 9840 for the gateway ([gateway] listen) is "
            "already used by the metrics listener",
        ),
        (
            MINIMAL + '[gateway]\nmode = "managed"\nmetrics_listen = "127.0.0.1:9840"\n',
            "farm.toml:8: gateway.metrics_listen: port 9840 for the gateway's metrics "
            "listener is already used by the metrics listener",
        ),
    ],
)
def test_each_problem_is_named_once_and_exactly(text: str, problem: str) -> None:
    assert problems(text) == [problem]


def test_every_bad_flag_key_is_named_not_only_the_first() -> None:
    found = problems(MINIMAL + '"Bad-Key" = 1\nmax-running = 0\n')
    assert [p.split(": ", 2)[1] for p in found] == ["sglang.Bad-Key", "sglang.max-running"]


def test_sglang_must_be_a_table() -> None:
    assert problems("sglang = 5\n[workers]\ngpus = [0]\n")[0] == (
        "farm.toml:1: sglang: expected a table of SGLang flags, got 5"
    )


def test_an_external_gateways_listen_is_not_the_farms_to_claim() -> None:
    text = MINIMAL + '[gateway]\nmode = "external"\nurl = "http://x:1"\nlisten = "127.0.0.1:9840"\n'
    assert load(text).gateway.mode == "external"


def test_a_bad_value_is_shown_whole_up_to_80_characters() -> None:
    def shown(n: int) -> str:
        return only_problem(f'[farm]\nname = "{"!" * n}"\n' + MINIMAL).split(", got ")[1]

    assert shown(78) == repr("!" * 78)  # 80 characters with its quotes
    assert shown(79) == repr("!" * 79)[:77] + "..."


def test_a_model_source_keeps_the_root_and_drops_a_trailing_slash() -> None:
    root = load(MINIMAL + '[model]\nsource = "/"\n').model
    assert root is not None and root.source == "/"
    srv = load(MINIMAL + '[model]\nsource = "/srv/m/"\n').model
    assert srv is not None and srv.source == "/srv/m"


def test_an_oom_step_warns_of_an_older_sglangs_spelling() -> None:
    text = MINIMAL + '[[oom.steps]]\nname = "a"\nset = { cuda_graph_max_bs = 8 }\n'
    result = check_spec(text, source="farm.toml")
    assert [w.split(": ", 2)[1] for w in result.warnings] == ["oom.steps[0].set.cuda_graph_max_bs"]


@pytest.mark.parametrize(
    "body",
    [
        "set = 5\nadd = { mem_fraction_static = -0.1 }\n",  # an op that is not a table
        "",  # no set, add or multiply
        'set = { "Bad-Key" = 1, max_running_requests = 8 }\n',  # a bad flag key
        "set = { mem_fraction_static = 0.7 }\nadd = { mem_fraction_static = 0.1 }\n",
        "add = { mem_fraction_static = -0.1 }\nmin = { mem_fraction_static = 0.6 }\n"
        "max = { mem_fraction_static = 0.5 }\n",  # max below min
        "multiply = { mem_fraction_static = 0 }\n",  # a factor that is not > 0
        "add = { mem_fraction_static = -0.1 }\nmin = { max_running_requests = 1 }\n",
        'add = { mem_fraction_static = -0.1 }\nmin = { mem_fraction_static = "x" }\n',
    ],
)
def test_a_step_refused_for_its_own_problems_causes_no_others(body: str) -> None:
    """The next step may take its name: a refused step is not counted as a step."""
    text = (
        MINIMAL
        + "mem_fraction_static = 0.8\n\n"
        + f'[[oom.steps]]\nname = "a"\n{body}\n'
        + '[[oom.steps]]\nname = "a"\nset = { max_running_requests = 8 }\n'
    )
    found = problems(text)
    assert found and not [p for p in found if "already used" in p], found


def test_a_key_like_line_inside_a_string_is_no_key() -> None:
    lines = [
        'notes = """',
        "max_running_requests = 5",
        '"""',
        "other = '''",
        "max_running_requests = 6",
        "'''",
        r'esc = "a\"b = [" # comment [',
        "chunked_prefill_size = 0",
        "max_running_requests = 0",
    ]
    found = problems(MINIMAL + "\n".join(lines) + "\n")
    assert [p.split(" ", 2)[:2] for p in found] == [
        ["farm.toml:6:", "sglang.notes:"],
        ["farm.toml:9:", "sglang.other:"],
        ["farm.toml:13:", "sglang.chunked_prefill_size:"],
        ["farm.toml:14:", "sglang.max_running_requests:"],
    ]


@pytest.mark.parametrize(
    "text",
    [
        "[restart]\nmax_failures = 1\n",
        "[health]\nbusy_window = 0\n",
        "[restart]\nbackoff_initial = 0\nbackoff_max = 0\n",
        '[gateway]\nmode = "managed"\ndrain_timeout = 0\n',
    ],
)
def test_the_smallest_values_allowed_are_taken(text: str) -> None:
    load(MINIMAL + text)


def test_one_worker_with_a_model_to_stage() -> None:
    spec = load(workers("[0]") + '[model]\nsource = "/srv/m"\n')
    assert len(spec.workers) == 1 and spec.model is not None


def test_a_gpu_listed_twice_is_one_problem() -> None:
    assert problems(workers("[0, 0]")) == [
        "farm.toml:2: workers.gpus: GPU 0 is listed twice; each GPU belongs to one worker"
    ]


NO_BUFFER_STEP = '[[oom.steps]]\nname = "a"\nset = { mamba_radix_cache_strategy = "no_buffer" }\n'


def test_a_no_buffer_step_needs_overlap_off_on_every_worker() -> None:
    base = MINIMAL + 'mamba_radix_cache_strategy = "extra_buffer"\n'
    one = "\n[workers.overrides.0.sglang]\ndisable_overlap_schedule = true\n\n"
    assert problems(base + one + NO_BUFFER_STEP) == [
        "farm.toml:13: oom.steps[0].set.mamba_radix_cache_strategy: 'no_buffer' makes SGLang "
        "0.5.23 assert --disable-overlap-schedule; add disable_overlap_schedule = true to this "
        "step's set"
    ]
    both = NO_BUFFER_STEP.replace('"no_buffer" }', '"no_buffer", max_running_requests = 8 }')
    assert len(problems(base + "\n" + both)) == 1
    load(base + "disable_overlap_schedule = true\n\n" + NO_BUFFER_STEP)


def test_no_buffer_in_sglang_names_the_workers_only_when_not_all() -> None:
    every = problems(MINIMAL + 'mamba_radix_cache_strategy = "no_buffer"\n')
    assert every[0].endswith("add disable_overlap_schedule = true")
    some = workers(
        "[0, 1]",
        '\n[workers.overrides.1.sglang]\nmamba_radix_cache_strategy = "no_buffer"\n',
    )
    assert problems(some)[0].endswith("add disable_overlap_schedule = true (workers [1])")


def test_an_add_after_a_set_of_the_same_flag_still_checks_the_others() -> None:
    text = (
        MINIMAL
        + '\n[[oom.steps]]\nname = "a"\nset = { max_running_requests = 8 }\n'
        + '[[oom.steps]]\nname = "b"\n'
        + "add = { max_running_requests = -2, schedule_conservativeness = 0.1 }\n"
    )
    assert [p.split(": ", 2)[1] for p in problems(text)] == [
        "oom.steps[1].add.schedule_conservativeness"
    ]


def test_a_bound_that_is_not_a_number_is_refused() -> None:
    text = (
        MINIMAL
        + 'mem_fraction_static = 0.8\n[[oom.steps]]\nname = "a"\n'
        + 'add = { mem_fraction_static = -0.1 }\nmin = { mem_fraction_static = "x" }\n'
    )
    assert problems(text) == [
        "farm.toml:10: oom.steps[0].min.mem_fraction_static: expected a finite number, got 'x'"
    ]


def test_an_unreadable_config_says_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        check_spec_file(tmp_path)
    assert info.value.problems == (
        f"{tmp_path}: cannot read: Is a directory; check the path and its permissions, or "
        "pass --config PATH",
    )


def test_problems_read_top_to_bottom_then_those_with_no_line() -> None:
    found = problems('[farm]\nname = "!"\n[workers]\ngpus = [0]\nbase_port = 0\n')
    assert [p.split(": ", 1)[0] for p in found] == ["farm.toml:2", "farm.toml:5", "farm.toml"]
    # By line, whatever order the sections are read in.
    found = problems(
        '[sglang]\nmodel_path = "/m"\nmax_running_requests = 0\n'
        "[workers]\ngpus = [0]\nbase_port = 0\n"
    )
    assert [p.split(": ", 1)[0] for p in found] == ["farm.toml:3", "farm.toml:6"]


def test_extra_args_must_all_be_strings() -> None:
    assert (
        "expected"
        in problems(MINIMAL + '[gateway]\nmode = "managed"\nextra_args = ["--x", 1]\n')[0]
    )


def test_nested_arrays_escapes_and_literal_backslashes_do_not_lose_the_line() -> None:
    lines = [
        "nested = [  # [",
        "  [1, '#'],",
        "  [3],",  # a header's shape, inside the array
        "]",
        r"lit = ['a\', 1]",  # a literal string: the backslash escapes nothing
        r'esc = """a \""" still inside',
        "max_running_requests = 7",
        '"""',
        "max_running_requests = 0",
    ]
    found = problems(MINIMAL + "\n".join(lines) + "\n")
    assert [p.split(" ", 2)[:2] for p in found] == [
        ["farm.toml:6:", "sglang.nested:"],
        ["farm.toml:11:", "sglang.esc:"],
        ["farm.toml:14:", "sglang.max_running_requests:"],
    ]


@pytest.mark.parametrize(
    "lines",
    [
        ['notes = """a', 'b"""'],  # closed after other text
        ['one = """a"""'],  # opened and closed on one line
        ['empty = """"""'],
        ['x = ["", 1]'],  # an empty string, then the bracket
        ['arr = ["""a', 'b"""]'],  # the bracket right after the closing quotes
        [r"lit = '''a\'''"],  # a literal string: no escapes
        [r'tab = """x\t"""'],  # an escape right before the closing quotes
        [r'bs = ["a\\", 1]'],  # an escaped backslash right before the quote
    ],
)
def test_the_key_after_a_string_is_found_on_its_line(lines: list[str]) -> None:
    found = problems(MINIMAL + "\n".join([*lines, "max_running_requests = 0"]) + "\n")
    assert found[-1].startswith(
        f"farm.toml:{6 + len(lines)}: sglang.max_running_requests: expected an integer >= 1"
    )


def test_a_port_clash_lands_on_the_override_that_made_it() -> None:
    base = (
        "[workers]\ngpus = [0, 1]\n\n[workers.overrides.{}]\n{} = {}\n\n"
        '[sglang]\nmodel_path = "/m"\n'
    )
    assert problems(base.format(1, "nccl_port", 31000)) == [
        "farm.toml:5: workers.overrides.1.nccl_port: port 31000 for worker 1 (NCCL) is already "
        "used by worker 0 (NCCL); every HTTP, NCCL and metrics port must be distinct"
    ]
    assert problems(base.format(0, "port", 30001)) == [
        "farm.toml:5: workers.overrides.0.port: port 30001 for worker 0 (HTTP) is already used "
        "by worker 1 (HTTP); every HTTP, NCCL and metrics port must be distinct"
    ]


# --- [gateway] urls (issue 26: several gateways) ----------------------------------------


A, B = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
GW_HEAD = "[workers]\ngpus = [0, 1]\n[sglang]\nmodel_path = '/models/m'\n[gateway]\n"


def _gw_load(gateway: str) -> FarmSpec:
    return load_spec(GW_HEAD + gateway, source="farm.toml")


def _gw_problems(gateway: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _gw_load(gateway)
    return list(info.value.problems)


def test_urls_names_every_external_gateway_and_url_stays_for_one() -> None:
    g = _gw_load(f'mode = "external"\nurls = ["{A}", "{B}/"]\n').gateway
    assert g.external_urls == (A, B)
    assert _gw_load(f'mode = "external"\nurl = "{A}"\n').gateway.external_urls == (A,)
    assert _gw_load('mode = "managed"\n').gateway.external_urls == ()


@pytest.mark.parametrize(
    ("gateway", "words"),
    [
        (f'mode = "external"\nurl = "{A}"\nurls = ["{B}"]\n', "url and urls are both set"),
        (f'mode = "external"\nurls = ["{A}", "{A}/"]\n', "named twice"),
        ('mode = "external"\nurls = []\n', "expected a list of base URLs"),
        ('mode = "external"\nurls = ["10.0.0.5:8000"]\n', "expected a base URL"),
        (f'mode = "managed"\nurls = ["{A}"]\n', "urls is for mode = 'external'"),
        # Issue 26 review: the same gateway twice, once with credentials in its URL.
        ('mode = "external"\nurls = ["http://u:p@a:8000", "http://a:8000"]\n', "credentials"),
        ('mode = "external"\nurls = ["http://A:8000", "http://a:8000"]\n', "named twice"),
    ],
)
def test_bad_urls_are_refused_with_the_fix(gateway: str, words: str) -> None:
    found = _gw_problems(gateway)
    assert len(found) == 1, found
    assert "gateway.urls" in found[0] and words in found[0], found


def test_external_mode_without_url_or_urls_says_both() -> None:
    (problem,) = _gw_problems('mode = "external"\n')
    assert "gateway.url" in problem and "urls = [...]" in problem


@pytest.mark.parametrize("key", ["url", "urls"])
def test_credentials_in_a_gateway_url_are_refused_for_the_admin_key(key: str) -> None:
    """httpx would turn them into Basic auth, which replaces the farm's Bearer admin key
    (smg takes only that): refused, with the way that works."""
    value = '"http://farm:s3c@ret@10.0.0.5:8000"'  # an '@' in the password too
    problem, *_ = _gw_problems(  # with url: also 'missing', as for any bad url
        f'mode = "external"\n{key} = {value if key == "url" else f"[{value}]"}\n'
    )
    assert f"gateway.{key}" in problem and "credentials" in problem, problem
    assert "('http://…@10.0.0.5:8000')" in problem, problem
    assert "admin_key_file" in problem and "s3c" not in problem and "ret" not in problem, problem


@pytest.mark.parametrize(
    "value",
    [
        "http://u:s3cret@10.0.0.5:8000/prefix",  # a path: not a base URL either
        "http://u:s3/cret@10.0.0.5:8000",  # a '/' in the password
        "http://u:s3cret@",  # no host at all
    ],
)
def test_a_gateway_url_with_credentials_never_echoes_the_password(value: str) -> None:
    """Whatever else is wrong with the URL, its password never reaches the error (which
    Ansible's `validate:` output and the logs show)."""
    problems = _gw_problems(f'mode = "external"\nurl = "{value}"\n')
    assert problems and all("s3" not in p and "cret" not in p for p in problems), problems
    assert any("credentials" in p for p in problems), problems
