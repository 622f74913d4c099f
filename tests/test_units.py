"""Unit rendering: golden files, systemd quoting, atomic writing, `systemd-analyze verify`."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import TYPE_CHECKING

import pytest

from sglang_farm.gateway.managed import from_spec, launch_argv, smg_stop_timeout
from sglang_farm.runtime.unit_files import UnitChanges, render_to_dir, write_secrets, write_units
from sglang_farm.runtime.unit_secrets import credentials_dir, render_secrets
from sglang_farm.runtime.unit_syntax import (
    GATEWAY_UNIT,
    HEADER_PREFIX,
    credential_line,
    environment_line,
    exec_line,
    systemd_quote,
)
from sglang_farm.runtime.units import STATIC_UNITS, gateway_python, render, render_agent_dropin
from sglang_farm.sglang.argv import build_command
from sglang_farm.spec import (
    Endpoint,
    FarmSection,
    FarmSpec,
    FlagValue,
    GatewaySpec,
    RestartPolicy,
    StartupPolicy,
    WorkerSpec,
)

if TYPE_CHECKING:
    from sdcontainer import SystemdContainer

GOLDEN = Path(__file__).parent / "golden" / "units"
DEFAULT_CONFIG = "/etc/sglang-farm/farm.toml"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def demo_spec(
    *,
    n: int = 8,
    python: str = "/opt/sglang-farm/venv/bin/python3",
    user: str = "sglang",
    group: str = "sglang",
) -> FarmSpec:
    """A spec like etc/sglang-farm/demo.toml: n simulated workers, one GPU each."""
    flags: Mapping[str, FlagValue] = MappingProxyType(
        {
            "model_path": "/srv/models/Qwen2.5-7B-Instruct",
            "served_model_name": "qwen-7b",
            "mem_fraction_static": 0.88,
            "enable_metrics": True,
            "disable_radix_cache": False,
            "cuda_graph_bs": (1, 2, 4, 8),
            "sim_load_seconds": 3,
        }
    )
    workers = tuple(
        WorkerSpec(
            id=i,
            gpus=(i,),
            host="127.0.0.1",
            port=30000 + i,
            nccl_port=31000 + i,
            flags=flags,
            env=MappingProxyType({"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}),
        )
        for i in range(n)
    )
    return FarmSpec(
        source="/etc/sglang-farm/demo.toml",
        farm=FarmSection(
            name="demo",
            python=python,
            module="sglang_farm.sim",
            user=user,
            group=group,
        ),
        workers=workers,
        startup=StartupPolicy(load_timeout=600.0),
        restart=RestartPolicy(stop_timeout=45.5),
    )


# --- golden files -------------------------------------------------------------------


def gateway_spec(
    *,
    n: int = 2,
    python: str = "/opt/sglang-farm/venv/bin/python3",
    gateway: GatewaySpec | None = None,
) -> FarmSpec:
    """The demo farm with a managed gateway: both key files, a policy and extra flags."""
    return replace(
        demo_spec(n=n, python=python),
        gateway=gateway
        or GatewaySpec(
            mode="managed",
            listen=Endpoint("127.0.0.1", 8000),
            policy="round_robin",
            metrics_listen=Endpoint("127.0.0.1", 29000),
            extra_args=("--log-level", "warn", "--request-timeout-secs", "600"),
            admin_key_file="/etc/sglang-farm/gateway-admin.key",
            api_key_file="/etc/sglang-farm/gateway-api.key",
        ),
    )


GOLDEN_CASES = {
    # etc/sglang-farm/demo.toml's shape: 8 simulated workers, no gateway.
    "demo": lambda: render(demo_spec()),
    # [gateway] mode = "managed": the gateway's own unit beside the workers' drop-ins.
    "managed-gateway": lambda: render(gateway_spec()),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_render_matches_golden_files_byte_for_byte(case: str, update_golden: bool) -> None:
    files = GOLDEN_CASES[case]()
    folder = GOLDEN / case
    if update_golden:
        shutil.rmtree(folder, ignore_errors=True)
        for rel, text in files.items():
            target = folder.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode())
    on_disk = {
        PurePosixPath(p.relative_to(folder).as_posix()): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file()
    }
    assert sorted(on_disk) == sorted(files), "run pytest --update-golden after a deliberate change"
    for rel, text in files.items():
        assert text.encode() == on_disk[rel], f"{case}/{rel} differs from its golden file"


def test_golden_folder_holds_only_the_cases() -> None:
    # A case renamed or dropped must not leave its old files behind unchecked.
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(GOLDEN_CASES)


def test_render_is_deterministic_and_lists_static_units_and_one_dropin_per_worker() -> None:
    spec = demo_spec(n=3)
    first = render(spec)
    assert first == render(spec)
    assert list(first) == sorted(first)
    assert set(first) == {
        PurePosixPath("sglang-farm.service"),
        PurePosixPath("sglang-farm.target"),
        PurePosixPath("sglang-farm-batch.service"),
        PurePosixPath("sglang@.service"),
        PurePosixPath("sglang@0.service.d/50-farm.conf"),
        PurePosixPath("sglang@1.service.d/50-farm.conf"),
        PurePosixPath("sglang@2.service.d/50-farm.conf"),
    }
    assert set(render(spec, static=False)) == {
        PurePosixPath(f"sglang@{i}.service.d/50-farm.conf") for i in range(3)
    }


def test_static_units_are_the_shipped_files_and_carry_no_generated_header() -> None:
    files = render(demo_spec(n=1))
    shipped = Path(__file__).parent.parent / "units"
    for name in STATIC_UNITS:
        assert files[PurePosixPath(name)] == (shipped / name).read_text()
        assert not files[PurePosixPath(name)].startswith(HEADER_PREFIX)


def test_dropin_carries_header_command_line_environment_user_and_timeouts() -> None:
    spec = demo_spec(n=2)
    text = render(spec, config_path="/etc/sglang-farm/demo.toml")[
        PurePosixPath("sglang@1.service.d/50-farm.conf")
    ]
    lines = text.splitlines()
    assert lines[0] == ("# generated by sglang-farm from /etc/sglang-farm/demo.toml, do not edit.")
    assert "User=sglang" in lines and "Group=sglang" in lines
    assert "TimeoutStartSec=600s" in lines
    assert "TimeoutStopSec=45500ms" in lines
    assert 'Environment="CUDA_VISIBLE_DEVICES=1"' in lines
    # The config's own variables (possible tokens) are in a root-only file, not here.
    assert not any("SGLANG_ENABLE_JIT_DEEPGEMM=0" in line for line in lines)
    assert "EnvironmentFile=/var/lib/sglang-farm/credentials/sglang@1.env" in lines
    assert lines.count("ExecStart=") == 1  # the reset comes before our one command
    assert lines[lines.index("ExecStart=") + 1].startswith("ExecStart=")
    # The gate: the agent's interpreter, isolated, with the URL and timeouts (no config).
    assert (
        "ExecStartPost=/usr/lib/sglang-farm/venv/bin/python3 -I -m sglang_farm.cli.main"
        " wait-ready --url http://127.0.0.1:30001/ready --url http://127.0.0.1:30001/health"
        " --timeout 600 --probe-timeout 25"
        " --interval 0.25 --main-pid $MAINPID %i" in lines
    )
    # The ExecStart= value, continuation lines joined the way systemd joins them,
    # holds exactly build_command's argv.
    start = text.index("\nExecStart=/") + len("\nExecStart=")
    end = text.index("\n", text.index("--nccl-port", start))
    joined = text[start:end].replace("\\\n", " ").split()
    assert joined == list(build_command(spec.farm, spec.workers[1]).argv)


def test_commands_replace_only_that_workers_command() -> None:
    spec = demo_spec(n=2)
    ladder = dict(spec.workers[0].flags, mem_fraction_static=0.8, cuda_graph_bs=(1, 2))
    files = render(spec, commands={0: build_command(spec.farm, spec.workers[0], ladder)})
    w0 = files[PurePosixPath("sglang@0.service.d/50-farm.conf")]
    w1 = files[PurePosixPath("sglang@1.service.d/50-farm.conf")]
    assert "--mem-fraction-static 0.8 \\" in w0
    assert "--cuda-graph-bs 1 2 \\" in w0
    assert "--mem-fraction-static 0.88 \\" in w1
    assert "--cuda-graph-bs 1 2 4 8 \\" in w1


def test_agent_dropin_only_when_binary_or_config_differ_from_the_package() -> None:
    spec = demo_spec(n=1)
    key = PurePosixPath("sglang-farm.service.d/50-farm.conf")
    assert key not in render(spec)
    text = render(spec, agent_bin="/home/dev/venv/bin/sglang-farm", config_path="/home/dev/f.toml")[
        key
    ]
    assert text.startswith(f"{HEADER_PREFIX} from /home/dev/f.toml, do not edit.\n")
    assert text.endswith(
        "ExecStart=\n"
        "ExecStart=/home/dev/venv/bin/sglang-farm run --runtime systemd --config /home/dev/f.toml\n"
    )


@pytest.mark.parametrize("field", ["user", "group"])
@pytest.mark.parametrize(
    "bad", ["sglang\nExecStartPre=+/bin/sh -c id", "a\rb", "a\tb", "x\x7f", "x\0y"]
)
def test_user_or_group_with_a_control_character_is_refused_not_written_as_a_directive(
    field: str, bad: str
) -> None:
    # A newline in User= would start a new directive (ExecStartPre=+... runs as root).
    spec = demo_spec(n=1, **{field: bad})
    with pytest.raises(ValueError, match=f"control character.*{field}|{field}.*control character"):
        render(spec)


def test_description_with_a_control_character_is_refused() -> None:
    spec = demo_spec(n=1)
    gw = GatewaySpec(mode="managed", listen=Endpoint("127.0.0.1\nExecStartPre=+/bin/id", 8000))
    with pytest.raises(ValueError, match="control character"):
        render(replace(spec, gateway=gw))


def test_worker_comment_cannot_carry_a_directive_whatever_the_host() -> None:
    # config.py refuses such a host; the renderer is the last line of defence.
    spec = demo_spec(n=1)
    worker = replace(spec.workers[0], host="127.0.0.1\nExecStartPre=+/bin/id")
    text = render(replace(spec, workers=(worker,)), static=False)[
        PurePosixPath("sglang@0.service.d/50-farm.conf")
    ]
    assert not any(line.startswith("ExecStartPre=") for line in text.splitlines())


def test_worker_comment_shows_the_address_the_worker_listens_on() -> None:
    spec = demo_spec(n=1)
    worker = replace(spec.workers[0], host="0.0.0.0")
    text = render(replace(spec, workers=(worker,)), static=False)[
        PurePosixPath("sglang@0.service.d/50-farm.conf")
    ]
    comment = next(line for line in text.splitlines() if line.startswith("# Worker 0:"))
    assert "0.0.0.0:30000" in comment, comment
    assert "--host 0.0.0.0" in text
    # The loopback URL the farm probes is named as such, not as where it listens.
    assert "probed at http://127.0.0.1:30000" in comment, comment


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("-inf")])
@pytest.mark.parametrize("which", ["load_timeout", "stop_timeout"])
def test_nan_or_negative_timeouts_are_refused_with_the_setting_named(
    bad: float, which: str
) -> None:
    spec = demo_spec(n=1)
    if which == "load_timeout":
        spec = replace(spec, startup=replace(spec.startup, load_timeout=bad))
    else:
        spec = replace(spec, restart=replace(spec.restart, stop_timeout=bad))
    with pytest.raises(ValueError, match=f"{which}.*{bad!r}|{bad!r}.*{which}"):
        render(spec)


AGENT_DROPIN = PurePosixPath("sglang-farm.service.d/50-farm.conf")


def _with_hosts(spec: FarmSpec, *hosts: str) -> FarmSpec:
    workers = tuple(replace(w, host=h) for w, h in zip(spec.workers, hosts, strict=True))
    return replace(spec, workers=workers)


def test_agent_dropin_allows_the_non_loopback_addresses_the_config_names() -> None:
    spec = _with_hosts(demo_spec(n=3), "127.0.0.1", "10.0.0.5", "0.0.0.0")
    spec = replace(spec, gateway=GatewaySpec(mode="external", url="http://[fd00::9]:8000"))
    text = render(spec, static=False)[AGENT_DROPIN]
    # Worker 2 listens everywhere and is probed on loopback: the shipped localhost will do.
    assert "IPAddressAllow=10.0.0.5 fd00::9" in text.splitlines()
    # The packaged binary and config: no ExecStart= override.
    assert "ExecStart=" not in text


def test_agent_dropin_allows_every_gateway_of_urls() -> None:
    """Issue 26: the agent calls each gateway of `[gateway] urls`, not only the first."""
    urls = ("http://10.0.0.7:8000", "http://10.0.0.8:8000")
    spec = replace(demo_spec(n=1), gateway=GatewaySpec(mode="external", urls=urls))
    assert (
        "IPAddressAllow=10.0.0.7 10.0.0.8" in render(spec, static=False)[AGENT_DROPIN].splitlines()
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda s: _with_hosts(s, "gpu-node-1.internal"),  # a name: resolved by DNS anywhere
        lambda s: replace(
            s, metrics=replace(s.metrics, listen=Endpoint("0.0.0.0", 9840))
        ),  # scrapers
        lambda s: replace(s, gateway=GatewaySpec(mode="external", url="https://smg.example")),
    ],
)
def test_agent_dropin_allows_any_address_when_peers_cannot_be_listed(
    change: Callable[[FarmSpec], FarmSpec],
) -> None:
    spec = change(demo_spec(n=1))
    assert "IPAddressAllow=any" in render(spec, static=False)[AGENT_DROPIN].splitlines()


def test_loopback_config_with_the_packaged_groups_needs_no_agent_dropin() -> None:
    gw = GatewaySpec(mode="managed", listen=Endpoint("0.0.0.0", 8000), admin_key_file="/etc/k")
    spec = replace(demo_spec(n=2), gateway=gw)
    assert AGENT_DROPIN not in render(spec)


def test_agent_dropin_names_the_configs_groups_in_place_of_the_packaged_ones() -> None:
    spec = demo_spec(n=1, group="gpu")
    spec = replace(spec, control=replace(spec.control, group="ops"))
    lines = render(spec, static=False)[AGENT_DROPIN].splitlines()
    reset = lines.index("SupplementaryGroups=")
    assert lines[reset + 1] == "SupplementaryGroups=ops gpu"
    # root is the agent's own group already; nothing to add.
    spec = demo_spec(n=1, group="root")
    spec = replace(spec, control=replace(spec.control, group="root"))
    lines = render(spec, static=False)[AGENT_DROPIN].splitlines()
    assert "SupplementaryGroups=" in lines
    assert not [
        x for x in lines if x.startswith("SupplementaryGroups=") and x != "SupplementaryGroups="
    ]


def test_agent_dropin_refuses_a_group_with_a_control_character() -> None:
    spec = demo_spec(n=1)
    spec = replace(spec, control=replace(spec.control, group="ops\nExecStartPre=+/bin/id"))
    with pytest.raises(ValueError, match="control character"):
        render(spec)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_shipped_agent_unit_exposure_is_at_most_2_0(tmp_path: Path) -> None:
    # issue 15: the agent scored 3.1 before its device, IP, clock and capability limits,
    # 2.4 before ProtectKernelTunables= and ProtectControlGroups= (packaging/README.md
    # records the score). The journal follower reads the journal by polling, which works
    # under both (test_agent_hardening_allows_what_the_agent_does runs it in the unit).
    assert SYSTEMD_ANALYZE is not None
    shutil.copy(Path(__file__).parent.parent / "units" / "sglang-farm.service", tmp_path)
    result = subprocess.run(
        [
            SYSTEMD_ANALYZE,
            "security",
            "--offline=true",
            "--threshold=20",
            "--no-pager",
            str(tmp_path / "sglang-farm.service"),
        ],
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    last = (result.stdout.strip().splitlines() or [""])[-1]
    score = float(last.rsplit(":", 1)[-1].split()[0]) if ":" in last else 99.0
    assert result.returncode == 0 and score <= 2.0, (
        last,
        result.stderr,
    )


# --- the managed gateway's unit ----------------------------------------------------

GW = PurePosixPath(GATEWAY_UNIT)


def _exec_start_words(text: str) -> list[str]:
    """The ExecStart= words of a unit, continuation lines joined as systemd joins them."""
    start = text.index("\nExecStart=") + len("\nExecStart=")
    end = start
    while text[end:].split("\n", 1)[0].endswith("\\"):
        end = text.index("\n", end) + 1
    end = text.index("\n", end)
    return text[start:end].replace("\\\n", " ").split()


def test_gateway_unit_only_in_managed_mode_and_also_when_not_static() -> None:
    managed = gateway_spec()
    assert GW in render(managed)
    # The agent's own render (Runtime.prepare) leaves out the shipped units, not this one.
    assert set(render(managed, static=False)) == {
        GW,
        *(PurePosixPath(f"sglang@{i}.service.d/50-farm.conf") for i in range(2)),
    }
    for mode, url in (("off", None), ("external", "http://10.0.0.5:8000")):
        spec = gateway_spec(gateway=GatewaySpec(mode=mode, url=url))
        assert GW not in render(spec)
        assert GW not in render(spec, static=False)


def test_gateway_unit_runs_the_gateway_the_agent_built() -> None:
    """The agent builds its ManagedGateway once (service.build_gateway) and the unit is
    rendered from that one, not from a second reading of [gateway]."""
    spec = gateway_spec()
    built = replace(from_spec(spec.gateway), port=8123, policy="random")
    words = _exec_start_words(render(spec, static=False, gateway=built)[GW])
    assert words[words.index("--port") + 1] == "8123"
    assert words[words.index("--policy") + 1] == "random"
    assert render(spec, static=False, gateway=from_spec(spec.gateway)) == render(spec, static=False)


def test_gateway_unit_runs_the_key_file_launcher_with_keys_from_credentials() -> None:
    spec = gateway_spec()
    text = render(spec, static=False)[GW]
    assert text.startswith(f"{HEADER_PREFIX} from /etc/sglang-farm/farm.toml, do not edit.\n")
    lines = text.splitlines()
    words = _exec_start_words(text)
    expected = launch_argv(
        from_spec(
            GatewaySpec(
                mode="managed",
                listen=Endpoint("127.0.0.1", 8000),
                metrics_listen=Endpoint("127.0.0.1", 29000),
                policy="round_robin",
                extra_args=spec.gateway.extra_args,
            )
        ),
        "/usr/lib/sglang-farm/venv/bin/python3",
        admin_key_file="%d/admin-key",
        api_key_file="%d/api-key",
    )
    # The packaged interpreter, isolated (-I), then exactly the launcher's argv.
    assert words == [expected[0], "-I", *expected[1:]]
    assert "--admin-key-file" in words and "--api-key-file" in words
    # The keys reach the service only through its credentials directory (%d).
    assert "LoadCredential=admin-key:/etc/sglang-farm/gateway-admin.key" in lines
    assert "LoadCredential=api-key:/etc/sglang-farm/gateway-api.key" in lines
    for directive in (
        "Type=exec",
        "PartOf=sglang-farm.target",
        "Restart=on-failure",
        "RestartSec=5",
        "DynamicUser=yes",
        "CapabilityBoundingSet=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "SystemCallFilter=@system-service",
        "MemoryDenyWriteExecute=yes",
    ):
        assert directive in lines, directive
    # The agent starts it (after rendering it): nothing installs or wants it.
    assert "[Install]" not in text and not any(ln.startswith("Wants=") for ln in lines)


def test_gateway_unit_without_key_files_loads_the_generated_admin_key() -> None:
    """Issue 22 item 3: a managed gateway is never left with an open worker API. Without
    [gateway] admin_key_file, the unit loads the key the agent generates in the state
    directory (gateway.adminkey), and only the admin key."""
    spec = gateway_spec(gateway=GatewaySpec(mode="managed"))
    text = render(spec)[GW]
    lines = text.splitlines()
    creds = [ln for ln in lines if ln.startswith("LoadCredential=")]
    assert creds == [f"LoadCredential=admin-key:{spec.farm.state_dir}/gateway-admin.key"]
    words = _exec_start_words(text)
    assert words[words.index("--admin-key-file") + 1] == "%d/admin-key"
    assert "--api-key-file" not in words
    assert "open to whoever" not in text


def test_gateway_interpreter_is_the_packaged_venv_or_the_one_beside_the_agent() -> None:
    assert gateway_python("/usr/bin/sglang-farm") == "/usr/lib/sglang-farm/venv/bin/python3"
    assert gateway_python("/home/dev/venv/bin/sglang-farm") == "/home/dev/venv/bin/python3"
    spec = gateway_spec()
    dev = render(spec, agent_bin="/home/dev/venv/bin/sglang-farm")[GW]
    assert _exec_start_words(dev)[0] == "/home/dev/venv/bin/python3"
    given = render(spec, agent_bin="/home/dev/venv/bin/sglang-farm", python="/opt/py/bin/python3")
    assert _exec_start_words(given[GW])[0] == "/opt/py/bin/python3"


def test_gateway_stop_timeout_outlasts_smg_drain_and_grace() -> None:
    # smg: 5 s of listening after SIGTERM, then up to its shutdown grace (180 s default).
    assert "TimeoutStopSec=195s" in render(gateway_spec())[GW].splitlines()
    assert smg_stop_timeout(["--shutdown-grace-period-secs", "30"]) == 45.0
    assert smg_stop_timeout(["--shutdown-grace-period-secs=0"]) == 15.0
    assert smg_stop_timeout(["--shutdown-grace-period-secs", "soon"]) == 195.0


def test_gateway_unit_escapes_paths_and_flags_for_systemd() -> None:
    spec = gateway_spec(
        gateway=GatewaySpec(
            mode="managed",
            extra_args=("--log-dir", "/var/log/smg 100%", "--x", "$HOME"),
            admin_key_file="/etc/sf/admin 100%.key",
        )
    )
    text = render(spec, python="/opt/my env/bin/python3")[GW]
    assert "LoadCredential=admin-key:/etc/sf/admin 100%%.key" in text.splitlines()
    assert 'ExecStart="/opt/my env/bin/python3" -I -m sglang_farm.gateway.launch' in text
    assert '"/var/log/smg 100%%"' in text and "$$HOME" in text
    # The key file's word is the one specifier left for systemd to expand.
    assert "--admin-key-file %d/admin-key" in text


@pytest.mark.parametrize(
    "bad", ["etc/key", "/etc/key\nExecStartPre=/bin/sh", "/etc/\tkey", "/etc/key ", "/etc/key\\"]
)
def test_credential_line_refuses_paths_systemd_would_misread(bad: str) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        credential_line("admin-key", bad)


def test_exec_line_writes_specifier_words_bare_and_refuses_unsafe_ones() -> None:
    assert exec_line(["/p", "--f", "%d/k", "%d"], specifiers=[2]) == "/p --f %d/k %%d"
    with pytest.raises(ValueError, match="bare word"):
        exec_line(["/p", "%d/a b"], specifiers=[1])
    with pytest.raises(ValueError, match="bare word"):
        exec_line(["/p"], specifiers=[0])


def test_gateway_unit_for_a_non_loopback_listen_with_an_admin_key_file() -> None:
    spec = gateway_spec(
        gateway=GatewaySpec(
            mode="managed", listen=Endpoint("0.0.0.0", 8000), admin_key_file="/etc/sglang-farm/k"
        )
    )
    assert "--host 0.0.0.0" in render(spec)[GW]


# --- quoting ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "word"),
    [
        ("plain", "plain"),
        ("--mem-fraction-static", "--mem-fraction-static"),
        ("0.88", "0.88"),
        ("Qwen/Qwen2.5-7B@main", "Qwen/Qwen2.5-7B@main"),
        ("100%", "100%%"),
        ("%i", "%%i"),
        ("$HOME", "$$HOME"),
        ("${HOME}x", '"$${HOME}x"'),
        ("a b", '"a b"'),
        ("", '""'),
        ('say "hi"', '"say \\"hi\\""'),
        ("it's", '"it\'s"'),
        ("back\\slash", '"back\\\\slash"'),
        (";", '";"'),
        ("line\nbreak\ttab", '"line\\nbreak\\ttab"'),
        ("bell\x07", '"bell\\x07"'),
        ('{"a": "100% $x"}', '"{\\"a\\": \\"100%% $$x\\"}"'),
        ("naïve", '"naïve"'),
    ],
)
def test_systemd_quote(arg: str, word: str) -> None:
    assert systemd_quote(arg) == word


def test_systemd_quote_refuses_nul() -> None:
    with pytest.raises(ValueError, match="NUL"):
        systemd_quote("a\0b")


def test_exec_line_program_path_rules() -> None:
    assert exec_line(["/usr/bin/x", "a b"]) == '/usr/bin/x "a b"'
    assert exec_line(["/opt/my env/python", "-m"]) == '"/opt/my env/python" -m'
    assert exec_line(["/opt/100%/python"]) == "/opt/100%%/python"
    # Unquoted, a leading "-" would mean "ignore the exit status".
    assert exec_line(["-python"]) == '"-python"'
    for bad in ("/opt/$x/python", '/opt/"q"/python', "/opt/a\\b", "/opt/a\nb", ""):
        with pytest.raises(ValueError, match="program path"):
            exec_line([bad])
    with pytest.raises(ValueError):
        exec_line([])


def test_exec_line_wraps_before_each_long_flag() -> None:
    text = exec_line(["/p", "-m", "mod", "--a", "1", "--b", "--c", "x y"], wrap=True)
    assert text == '/p -m mod \\\n    --a 1 \\\n    --b \\\n    --c "x y"'


def test_environment_line_quotes_without_doubling_dollar() -> None:
    assert environment_line("A", "x y") == '"A=x y"'
    assert environment_line("P", "100%") == '"P=100%%"'
    assert environment_line("D", "$HOME") == '"D=$HOME"'
    assert environment_line("Q", 'a"b\\c') == '"Q=a\\"b\\\\c"'
    assert environment_line("E", "") == '"E="'
    with pytest.raises(ValueError):
        environment_line("A=B", "x")


# --- writing ------------------------------------------------------------------------


def _p(s: str) -> PurePosixPath:
    return PurePosixPath(s)


def test_write_units_writes_then_skips_identical_files(tmp_path: Path) -> None:
    files = render(demo_spec(n=2), static=False)
    first = write_units(tmp_path, files)
    assert first.written == ("sglang@0.service.d/50-farm.conf", "sglang@1.service.d/50-farm.conf")
    assert first.changed and first.removed == () and first.unchanged == ()
    target = tmp_path / "sglang@0.service.d" / "50-farm.conf"
    assert target.read_text() == files[_p("sglang@0.service.d/50-farm.conf")]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o755
    inode, mtime = target.stat().st_ino, target.stat().st_mtime_ns

    second = write_units(tmp_path, files)
    assert second == UnitChanges(unchanged=first.written)
    assert not second.changed
    assert (target.stat().st_ino, target.stat().st_mtime_ns) == (inode, mtime)
    # No temp files are left behind.
    assert sorted(p.name for p in target.parent.iterdir()) == ["50-farm.conf"]


def test_write_units_replaces_a_changed_file_atomically_by_rename(tmp_path: Path) -> None:
    write_units(tmp_path, {_p("sglang@0.service.d/50-farm.conf"): f"{HEADER_PREFIX} a\n"})
    target = tmp_path / "sglang@0.service.d" / "50-farm.conf"
    # A reader holding the old file keeps the old content: the new one is a new inode.
    with target.open() as old:
        changes = write_units(
            tmp_path, {_p("sglang@0.service.d/50-farm.conf"): f"{HEADER_PREFIX} b\n"}
        )
        assert old.read() == f"{HEADER_PREFIX} a\n"
    assert changes.written == ("sglang@0.service.d/50-farm.conf",)
    assert target.read_text() == f"{HEADER_PREFIX} b\n"


def test_write_units_removes_our_stale_dropins_and_keeps_foreign_files(tmp_path: Path) -> None:
    write_units(tmp_path, render(demo_spec(n=3), static=False))
    # An administrator's own drop-in for worker 2, and one without our header in worker 1's folder.
    (tmp_path / "sglang@2.service.d" / "90-local.conf").write_text("[Service]\nNice=5\n")
    (tmp_path / "sglang@1.service.d" / "40-mine.conf").write_text("[Service]\n")
    # Another program's unit folder whose name does not start with the prefix.
    (tmp_path / "other.service.d").mkdir()
    (tmp_path / "other.service.d" / "50-farm.conf").write_text(f"{HEADER_PREFIX} x\n")

    changes = write_units(tmp_path, render(demo_spec(n=1), static=False))

    assert changes.removed == ("sglang@1.service.d/50-farm.conf", "sglang@2.service.d/50-farm.conf")
    assert changes.unchanged == ("sglang@0.service.d/50-farm.conf",)
    assert changes.changed
    assert (tmp_path / "sglang@0.service.d" / "50-farm.conf").exists()
    assert sorted(p.name for p in (tmp_path / "sglang@1.service.d").iterdir()) == ["40-mine.conf"]
    assert sorted(p.name for p in (tmp_path / "sglang@2.service.d").iterdir()) == ["90-local.conf"]
    assert (tmp_path / "other.service.d" / "50-farm.conf").exists()


def test_write_units_removes_emptied_dropin_folders(tmp_path: Path) -> None:
    write_units(tmp_path, render(demo_spec(n=2), static=False))
    changes = write_units(tmp_path, render(demo_spec(n=1), static=False))
    assert changes.removed == ("sglang@1.service.d/50-farm.conf",)
    assert not (tmp_path / "sglang@1.service.d").exists()
    assert (tmp_path / "sglang@0.service.d").is_dir()


def test_write_units_removes_a_stale_agent_dropin(tmp_path: Path) -> None:
    spec = demo_spec(n=1)
    write_units(tmp_path, render(spec, agent_bin="/dev/bin/sglang-farm"))
    changes = write_units(tmp_path, render(spec))
    assert changes.removed == ("sglang-farm.service.d/50-farm.conf",)
    assert not (tmp_path / "sglang-farm.service.d").exists()


def test_write_units_removes_a_stale_gateway_unit_but_never_a_foreign_one(
    tmp_path: Path,
) -> None:
    write_units(tmp_path, render(gateway_spec(), static=False))
    assert (tmp_path / GATEWAY_UNIT).is_file()
    off = render(demo_spec(n=2), static=False)
    changes = write_units(tmp_path, off)
    assert changes.removed == (GATEWAY_UNIT,) and changes.changed
    assert not (tmp_path / GATEWAY_UNIT).exists()
    # An administrator's own unit of that name (no header) stays.
    (tmp_path / GATEWAY_UNIT).write_text("[Service]\nExecStart=/usr/local/bin/my-gateway\n")
    assert write_units(tmp_path, off).removed == ()
    assert (tmp_path / GATEWAY_UNIT).exists()


def test_write_units_overwrites_a_rendered_path_even_without_header(tmp_path: Path) -> None:
    (tmp_path / "sglang-farm.target").write_text("old\n")
    files = {_p("sglang-farm.target"): "new\n"}
    assert write_units(tmp_path, files).written == ("sglang-farm.target",)
    assert (tmp_path / "sglang-farm.target").read_text() == "new\n"


@pytest.mark.parametrize("bad", ["/etc/x.conf", "../x.conf", "a/../../x.conf"])
def test_write_units_refuses_paths_outside_root(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="relative"):
        write_units(tmp_path / "root", {_p(bad): "x"})
    assert not (tmp_path / "x.conf").exists()


def test_render_to_dir_creates_the_folder_and_reports_changes(tmp_path: Path) -> None:
    out = tmp_path / "out" / "units"
    changes = render_to_dir(demo_spec(n=2), out)
    assert set(changes.written) == {str(p) for p in render(demo_spec(n=2))}
    assert not render_to_dir(demo_spec(n=2), out).changed


# --- systemd-analyze verify ---------------------------------------------------------


def _verify(unit_dir: Path, names: list[str]) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(
        # --man=no: the man pages come with the Debian package, not this checkout.
        [SYSTEMD_ANALYZE, "verify", "--man=no", *(str(unit_dir / n) for n in names)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_rendered_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # ExecStart= programs must exist for verify: a real interpreter with an awkward
    # path (space and percent sign, both quoted by the renderer) and a stub agent.
    bindir = tmp_path / "venv 100%" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python3"
    python.symlink_to(sys.executable)
    agent = bindir / "sglang-farm"
    agent.write_text("#!/bin/sh\nexit 0\n")
    agent.chmod(0o755)
    # The managed gateway too: its interpreter is the one beside the agent (same awkward
    # folder), its key files have awkward names, its extra flags awkward values.
    gateway = GatewaySpec(
        mode="managed",
        extra_args=("--log-dir", "/var/log/smg 100% $x", "--shutdown-grace-period-secs", "7"),
        admin_key_file=str(tmp_path / "keys 100%" / "admin.key"),
        api_key_file=str(tmp_path / "keys 100%" / "api.key"),
    )
    spec = replace(demo_spec(n=8, python=str(python), user="root", group="root"), gateway=gateway)
    out = tmp_path / "units"
    render_to_dir(spec, out, agent_bin=str(agent), config_path=str(tmp_path / "farm.toml"))
    assert (out / GATEWAY_UNIT).is_file()

    names = [f"sglang@{i}.service" for i in spec.worker_ids]
    names += ["sglang-farm.service", "sglang-farm.target", GATEWAY_UNIT]
    result = _verify(out, names)
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_verify_catches_a_mis_quoted_program_path(tmp_path: Path) -> None:
    # The check above is only worth something if verify resolves the program path the
    # way systemd will run it: the same unit with the quotes dropped must fail.
    bindir = tmp_path / "venv 100%" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python3").symlink_to(sys.executable)
    out = tmp_path / "units"
    render_to_dir(demo_spec(n=1, python=str(bindir / "python3"), user="root"), out)
    conf = out / "sglang@0.service.d" / "50-farm.conf"
    quoted = str(bindir / "python3").replace("%", "%%")
    text = conf.read_text()
    assert f'ExecStart="{quoted}" -m' in text
    conf.write_text(text.replace(f'"{quoted}"', quoted, 1))
    (out / "sglang-farm.service").unlink()
    result = _verify(out, ["sglang@0.service"])
    assert "not executable" in result.stderr or "bad unit file" in result.stderr


# --- under a real systemd (the throwaway container of tests/sdcontainer.py) ---------

# A stand-in worker: records its exact argv (from /proc) and environment, puts a
# child in its process group that records any SIGTERM it gets, and signals
# "ready" a moment later, as SGLang binds its port only after loading.
_FAKE_WORKER = r"""
import json, os, signal, sys, time
port = sys.argv[sys.argv.index("--port") + 1]
with open("/proc/self/cmdline", "rb") as fh:
    argv = [a.decode() for a in fh.read().split(b"\0")[:-1]]
with open(f"/run/sf/argv-{port}.json", "w") as fh:
    json.dump({"argv": argv, "sys_argv": sys.argv[1:], "env": dict(os.environ)}, fh)
if os.fork() == 0:
    def child_term(*_):
        open(f"/run/sf/child-got-sigterm-{port}", "w").close()
    signal.signal(signal.SIGTERM, child_term)
    while True:
        time.sleep(1)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(1.5)
open(f"/run/sf/ready-{port}", "w").close()
while True:
    time.sleep(1)
"""

# Stand-in for the agent's interpreter running the gate, `python3 -I -m
# sglang_farm.cli.main wait-ready --url URL ... --main-pid PID ID`: waits for the ready
# mark of worker ID (the last argument).
_FAKE_WAIT_READY = """#!/bin/sh
[ "$1 $2 $3 $4" = "-I -m sglang_farm.cli.main wait-ready" ] || exit 64
eval "id=\\${$#}"
while [ ! -e "/run/sf/ready-$((30000 + id))" ]; do sleep 0.1; done
"""

# Stand-in agent: does what the agent does, under sglang-farm.service's hardening,
# records which parts worked ("ok"), and whether what it must not do was refused
# ("refused") or not ("allowed"), then sends READY=1 from its main process.
_AGENT_PROBE = """
import ctypes, grp, json, os, pathlib, resource, select, signal, socket, subprocess, time

results = {}

def attempt(name, fn):
    try:
        fn()
        results[name] = "ok"
    except Exception as exc:
        results[name] = f"{type(exc).__name__}: {exc}"

def refused(name, fn):
    try:
        fn()
        results[name] = "allowed"
    except PermissionError:
        results[name] = "refused"
    except Exception as exc:
        results[name] = f"{type(exc).__name__}: {exc}"

def manager_call(method, *args):
    from pystemd.systemd1 import Manager
    with Manager() as m:
        getattr(m.Manager, method)(*args)

def dropin():
    d = pathlib.Path("/run/systemd/system/sf-dummy.service.d")
    d.mkdir(exist_ok=True)
    (d / "50-farm.conf").write_text("[Service]\\nEnvironment=PROBE=1\\n")

def control_socket():
    # Without CAP_CHOWN: the owner hands it to a group it is a member of.
    path = "/run/sglang-farm/control.sock"
    if os.path.exists(path):  # left by the previous start (RuntimeDirectoryPreserve=)
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o660)
    gid = grp.getgrnam("sglang-farm").gr_gid
    os.chown(path, -1, gid)
    assert os.stat(path).st_gid == gid

def tcp_listen():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()

def connect(host, port):
    with socket.create_connection((host, port), timeout=5):
        pass

def model_file():
    # Owned by another user, group sglang, 0750/0640: read through the supplementary group.
    assert pathlib.Path("/srv/sf-models/m/config.json").read_text() == "{}"

def limits():
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    # 65536, or what the machine allows systemd itself if that is less (a container's
    # manager cannot go above its own hard limit).
    pid1 = [l.split()[-2] for l in open("/proc/1/limits") if l.startswith("Max open files")]
    assert nofile[0] == nofile[1] and nofile[0] in (65536, int(pid1[0])), (nofile, pid1)
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # cgroup v2: the unit's limits
        cg = open("/proc/self/cgroup").read().strip().split("::")[-1]
        got = [open(f"/sys/fs/cgroup{cg}/{f}").read().strip() for f in ("pids.max", "memory.max")]
        assert got == ["1024", str(4 << 30)], got

attempt("ctypes_callback", lambda: ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 7)())
attempt("import_pynvml", lambda: __import__("pynvml"))
attempt("write_dropin", dropin)
attempt("daemon_reload", lambda: manager_call("Reload"))
attempt("start_unit", lambda: manager_call("StartUnit", b"sf-dummy.service", b"replace"))
attempt("control_socket", control_socket)
attempt("tcp_listen", tcp_listen)
attempt("state_dir", lambda: pathlib.Path("/var/lib/sglang-farm/x").write_text("1"))
attempt("journal", lambda: subprocess.run(["journalctl", "-n1", "-q"], check=True))
def agent_follower():
    # The agent's own follower (runtime/journal.py), under this unit's hardening: it must
    # learn a unit started after it and deliver that unit's line.
    import asyncio
    from sglang_farm.runtime import LogLine
    from sglang_farm.runtime.journal import JournalFollower
    mark = f"sf-mark-{os.getpid()}"
    unit = f"sf-echo@{os.getpid()}.service"

    async def run():
        got = asyncio.Event()
        def emit(ev):
            if isinstance(ev, LogLine) and ev.text == mark:
                got.set()
        follower = JournalFollower(emit, lambda u: 0 if u == unit else None)
        follower.start()
        try:
            await asyncio.sleep(1.0)
            manager_call("StartUnit", unit.encode(), b"replace")
            # Whether it delivers, not how fast: on a loaded 2-core machine one poll of
            # the journal (a journalctl per 0.5 s) has taken more than 15 s.
            await asyncio.wait_for(got.wait(), 45)
        finally:
            await follower.close()

    asyncio.run(run())

results["cgroup2"] = "ok" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "no"
attempt("journal_follow", agent_follower)
attempt("model_file", model_file)
attempt("read_proc_of_other_users", lambda: open(f"/proc/1/stat").read())
attempt("limits", limits)
attempt("dev_null", lambda: open("/dev/null", "wb").write(b"x"))
refused("device_not_allowed", lambda: open("/dev/sf-mem", "rb"))
refused("clock_setting", lambda: time.clock_settime(time.CLOCK_REALTIME, time.time()))
attempt("loopback_peer", lambda: connect("127.0.0.1", 18091))
refused("other_address", lambda: connect("10.9.9.9", 18090))
pathlib.Path("/var/lib/sglang-farm/probe.json").write_text(json.dumps(results))
n = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
n.connect(os.environ["NOTIFY_SOCKET"])
n.send(b"READY=1")
while True:
    signal.pause()
"""

# A TCP listener for the probe's address checks: `listen.py HOST PORT`.
_LISTENER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
while True:
    s.accept()[0].close()
"""

TRICKY_FLAGS: Mapping[str, FlagValue] = MappingProxyType(
    {
        "model_path": "/srv/models/my model",
        "quotes": "say \"hi\" and 'bye'",
        "backslash": "a\\b\\\\c",
        "dollar": "$HOME ${USER} $$",
        "percent": "100% %i %n",
        "semicolon": ";",
        "empty": "",
        "newline": "two\nlines\ttab",
        "unicode": "naïve ✓",
        "json": '{"a": [1, "x y"], "b": "$z"}',
        "enable_metrics": True,
    }
)


CONTAINER_API_KEY = "sk-container-secret-77"


def _container_spec() -> FarmSpec:
    env = MappingProxyType({"PYTHONPATH": "/opt/sf", "SF_TRICKY": 'x y "q" \\ $HOME %n ü\nl2'})
    workers = tuple(
        WorkerSpec(
            id=i,
            gpus=(i,),
            host="127.0.0.1",
            port=30000 + i,
            nccl_port=31000 + i,
            # Worker 0 with an API key (delivered by LoadCredential=), worker 1 without.
            flags=MappingProxyType({**TRICKY_FLAGS, "api_key": CONTAINER_API_KEY})
            if i == 0
            else TRICKY_FLAGS,
            env=env,
        )
        for i in range(2)
    )
    return FarmSpec(
        source="/opt/sf/farm.toml",
        farm=FarmSection(python="/usr/bin/python3", module="sfworker", user="root", group="root"),
        workers=workers,
        startup=StartupPolicy(load_timeout=30.0),
        restart=RestartPolicy(stop_timeout=10.0),
    )


@pytest.fixture(scope="module")
def unit_container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdContainer]:
    """A booted systemd container with the rendered farm installed in /run/systemd/system."""
    from sdcontainer import booted

    out = tmp_path_factory.mktemp("units")
    render_to_dir(_container_spec(), out, agent_bin="/opt/sf/sglang-farm")
    # The agent's drop-in as for the package's groups (workers' group `sglang`, created
    # below as sysusers.d would): the agent reads the workers' files through it.
    packaged = replace(_container_spec().farm, group="sglang")
    spec = replace(_container_spec(), farm=packaged)
    (out / "sglang-farm.service.d" / "50-farm.conf").write_text(
        render_agent_dropin(agent_bin="/opt/sf/sglang-farm", config_path=DEFAULT_CONFIG, spec=spec)
    )
    secrets = tmp_path_factory.mktemp("secrets")
    write_secrets(secrets, render_secrets(_container_spec()))
    with booted() as c:
        # The workers' secret files, as the agent writes them (root-only).
        folder = str(credentials_dir(_container_spec()))
        c.run(["install", "-d", "-m", "0700", folder])
        for entry in sorted(secrets.iterdir()):
            c.write_file(f"{folder}/{entry.name}", entry.read_text(), mode=0o600)
        c.write_file("/opt/sf/sfworker.py", _FAKE_WORKER)
        # The agent's interpreter, beside its binary (units.gateway_python).
        c.write_file("/opt/sf/python3", _FAKE_WAIT_READY, mode=0o755)
        c.write_file("/opt/sf/agent-probe", f"#!{sys.executable}\n{_AGENT_PROBE}", mode=0o755)
        c.write_file("/run/systemd/system/sf-dummy.service", "[Service]\nExecStart=sleep 600\n")
        c.run(["mkdir", "-p", "/run/sf"])
        # What the package creates (sysusers.d): the agent unit's SupplementaryGroups=.
        c.run(["groupadd", "--system", "sglang-farm"])
        c.run(["groupadd", "--system", "sglang"])
        # A model in another user's folder, group sglang, as the workers leave files.
        c.run(["install", "-d", "-o", "nobody", "-g", "sglang", "-m", "0750", "/srv/sf-models/m"])
        c.write_file("/srv/sf-models/m/config.json", "{}", mode=0o640)
        c.run(["chown", "nobody:sglang", "/srv/sf-models/m/config.json"])
        # A device node the agent's device policy does not allow (/dev/mem's numbers).
        c.run(["mknod", "/dev/sf-mem", "c", "1", "1"])
        # A non-loopback address on this host, and listeners there and on loopback.
        c.run(["ip", "addr", "add", "10.9.9.9/32", "dev", "lo"])
        c.write_file("/opt/sf/listen.py", _LISTENER)
        for unit, host, port in (
            ("sf-listen-lo", "127.0.0.1", "18091"),
            ("sf-listen-other", "10.9.9.9", "18090"),
        ):
            c.run(
                ["systemd-run", f"--unit={unit}", sys.executable, "/opt/sf/listen.py", host, port]
            )
        # Lives a moment: a line of a process that is already gone may lose its unit.
        # Type=oneshot: its start job lasts, so systemd logs "Starting" for it (as for a
        # worker, whose readiness gate keeps it activating), which is how the agent's
        # follower learns of a new unit; a Type=simple unit gets only "Started".
        c.write_file(
            "/run/systemd/system/sf-echo@.service",
            "[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo sf-mark-%i; sleep 2'\n",
        )
        c.copy_in(out, "/run/systemd/system")
        c.run(["systemctl", "daemon-reload"])
        yield c


def _wait_state(c: SystemdContainer, unit: str, want: str, timeout: float = 15.0) -> list[str]:
    """Poll `systemctl is-active` until it says `want`; returns every state seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = c.run(["systemctl", "is-active", unit], check=False).stdout.strip()
        if not seen or seen[-1] != state:
            seen.append(state)
        if state == want:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"{unit} never became {want}; states seen: {seen}")


@pytest.mark.systemd
def test_systemd_runs_the_exact_argv_and_env_and_gates_readiness(
    unit_container: SystemdContainer,
) -> None:
    c = unit_container
    spec = _container_spec()
    c.run(["systemctl", "start", "--no-block", "sglang@0.service"])
    seen = _wait_state(c, "sglang@0.service", "active")
    # Loading (the wait-ready gate still waiting) is `activating`, ready is `active`.
    assert "activating" in seen, seen
    rec = json.loads(c.run(["cat", "/run/sf/argv-30000.json"]).stdout)
    cmd = build_command(spec.farm, spec.workers[0])
    assert rec["argv"] == list(cmd.argv)
    # The config's environment came from the root-only EnvironmentFile=, exactly.
    for key, value in cmd.env:
        assert rec["env"][key] == value
    # The key: not on the process's command line, in SGLang's sys.argv (from the credential).
    assert CONTAINER_API_KEY not in " ".join(rec["argv"])
    assert rec["sys_argv"][-2:] == ["--api-key", CONTAINER_API_KEY]
    assert "SGLANG_FARM_API_KEY" not in rec["env"]
    shown = c.run(["systemctl", "show", "sglang@0.service"]).stdout
    shown += c.run(["systemctl", "cat", "sglang@0.service"]).stdout
    assert CONTAINER_API_KEY not in shown and 'x y "q"' not in shown

    # Stop: SIGTERM to the main process only (KillMode=mixed), then SIGKILL for the rest.
    c.run(["systemctl", "stop", "sglang@0.service"], timeout=30)
    assert c.run(["systemctl", "is-active", "sglang@0.service"], check=False).stdout.strip() == (
        "inactive"
    )
    assert c.run(["test", "-e", "/run/sf/child-got-sigterm-30000"], check=False).returncode == 1
    assert c.run(["pgrep", "-f", "sfworker"], check=False).stdout == ""


@pytest.mark.systemd
def test_agent_hardening_allows_what_the_agent_does(unit_container: SystemdContainer) -> None:
    c = unit_container
    # The agent's own drop-in points its ExecStart= at the probe.
    c.write_file(
        "/run/systemd/system/sglang-farm.service.d/60-probe.conf",
        "[Service]\nExecStart=\nExecStart=/opt/sf/agent-probe\n",
    )
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", "sglang-farm.target"], timeout=100)
    _wait_state(c, "sglang-farm.service", "active", timeout=60)
    results = json.loads(c.run(["cat", "/var/lib/sglang-farm/probe.json"]).stdout)
    # systemd enforces device and IP allow-lists with cgroup v2 BPF programs; on a
    # machine whose container runs on cgroup v1 (this harness's CI machine does) they
    # are not applied, and only what the agent needs can be checked.
    enforced = results.pop("cgroup2") == "ok"
    denials = {"device_not_allowed", "other_address", "clock_setting"}
    assert {k: v for k, v in results.items() if k not in denials} == dict.fromkeys(
        set(results) - denials, "ok"
    ), results
    assert set(results) >= {
        "daemon_reload",
        "start_unit",
        "control_socket",
        "write_dropin",
        "journal_follow",
        "model_file",
        "limits",
        "read_proc_of_other_users",
        "loopback_peer",
    }
    assert results["clock_setting"] == "refused", results
    if enforced:
        assert results["device_not_allowed"] == "refused", results
        assert results["other_address"] == "refused", results
    assert c.run(["systemctl", "is-active", "sf-dummy.service"]).stdout.strip() == "active"
    if enforced:
        # An address the config names (the rendered agent drop-in's IPAddressAllow=)
        # is reachable from the agent's next start.
        c.write_file(
            "/run/systemd/system/sglang-farm.service.d/70-ip.conf",
            "[Service]\nIPAddressAllow=10.9.9.9\n",
        )
        c.run(["systemctl", "daemon-reload"])
        c.run(["systemctl", "restart", "sglang-farm.service"], timeout=60)
        again = json.loads(c.run(["cat", "/var/lib/sglang-farm/probe.json"]).stdout)
        assert again["other_address"] == "allowed", again
    # A worker is PartOf the target: stopping the target stops the agent and the workers.
    c.run(["systemctl", "start", "sglang@1.service"], timeout=30)
    c.run(["systemctl", "stop", "sglang-farm.target"], timeout=30)
    # (systemctl waits for the target's job only; the PartOf= stops follow.)
    for unit in ("sglang-farm.service", "sglang@1.service"):
        _wait_state(c, unit, "inactive")


@pytest.mark.systemd
def test_gateway_unit_serves_as_a_dynamic_user_under_its_hardening_keys_unseen(
    unit_container: SystemdContainer,
) -> None:
    from sdcontainer import VENV_PYTHON
    from sdfarm import http_get, open_test_venv_to_dynamic_users

    c = unit_container
    key = f"sf-admin-{os.urandom(8).hex()}"
    c.write_file("/etc/sf-gw/admin.key", key + "\n", mode=0o600)
    spec = replace(
        _container_spec(),
        gateway=GatewaySpec(
            mode="managed",
            listen=Endpoint("127.0.0.1", 18000),
            metrics_listen=Endpoint("127.0.0.1", 18001),
            admin_key_file="/etc/sf-gw/admin.key",
            # smg waits 5 s after SIGTERM, then this grace: the stop below stays quick.
            extra_args=("--shutdown-grace-period-secs", "1"),
        ),
    )
    # The interpreter of this test run (it has smg), as the agent's would be.
    text = render(spec, python=VENV_PYTHON, static=False)[GW]
    c.write_file(f"/run/systemd/system/{GATEWAY_UNIT}", text)
    open_test_venv_to_dynamic_users(c)
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", GATEWAY_UNIT], timeout=30)

    deadline = time.monotonic() + 30
    health: object = None
    while time.monotonic() < deadline:
        health = http_get(c, "http://127.0.0.1:18000/health")[0]
        failed = c.run(["systemctl", "is-failed", GATEWAY_UNIT], check=False).stdout.strip()
        if health == 200 or failed == "failed":
            break
        time.sleep(0.2)
    assert health == 200, (health, c.journal(GATEWAY_UNIT, lines=40))
    # The worker API wants the admin key, read from the credential; /metrics answers on
    # its own listener.
    assert http_get(c, "http://127.0.0.1:18000/workers")[0] == 401
    status, body = http_get(c, "http://127.0.0.1:18000/workers", key=key)
    assert status == 200 and body["workers"] == [], (status, body)
    assert http_get(c, "http://127.0.0.1:18001/metrics")[0] == 200
    # A user of its own (not root), and the key in no command line, property or unit text.
    pid = c.run(["systemctl", "show", "-p", "MainPID", "--value", GATEWAY_UNIT]).stdout.strip()
    uid = c.run(["stat", "-c", "%u", f"/proc/{pid}"]).stdout.strip()
    assert uid not in ("", "0"), uid
    for shown in (
        c.run(["cat", f"/proc/{pid}/cmdline"]).stdout,
        c.run(["systemctl", "show", GATEWAY_UNIT]).stdout,
        c.run(["systemctl", "cat", GATEWAY_UNIT]).stdout,
        c.journal(GATEWAY_UNIT),
    ):
        assert key not in shown
    # Still up a moment later: nothing it does trips the syscall filter or W^X.
    time.sleep(1.0)
    assert c.run(["systemctl", "is-active", GATEWAY_UNIT], check=False).stdout.strip() == "active"
    t0 = time.monotonic()
    c.run(["systemctl", "stop", GATEWAY_UNIT], timeout=60)
    took = time.monotonic() - t0
    result = c.run(["systemctl", "show", "-p", "Result", "--value", GATEWAY_UNIT]).stdout.strip()
    # smg exits by itself after its 5 s window and 1 s grace: no SIGKILL, no timeout.
    assert result == "success" and took < 15, (result, took)
