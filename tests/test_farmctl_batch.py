"""`farmctl batch` without a service to talk to: every way of not reaching one is one line
on stderr that says what and what to do, with the README's exit code (issue 33).

Against the real batch service (submit, wait, cancel, results, a service restarted
mid-wait): tests/test_farmctl_batch_service.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import asuser
from sglang_farm.cli.batchctl import BatchExit, connect_url, errors_path, service_from_config
from sglang_farm.cli.farmctl import cli

FARMCTL = [sys.executable, "-c", "from sglang_farm.cli.farmctl import main; main()"]


def config(tmp_path: Path, batch: str) -> Path:
    path = tmp_path / "farm.toml"
    path.write_text("[farm]\nname = 't'\n\n[batch]\n" + batch)
    return path


def farmctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FARMCTL, *args], capture_output=True, text=True, timeout=60)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_exit_codes_are_farmctls_where_they_mean_the_same() -> None:
    from sglang_farm.cli.ctl.exits import Exit

    for name in ("OK", "FAILED", "USAGE", "TIMED_OUT"):
        assert int(BatchExit[name]) == int(Exit[name]), name
    # Its own are past farmctl's last one.
    assert max(Exit) < BatchExit.UNREACHABLE and max(Exit) < BatchExit.NOT_COMPLETED
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "12 the batch service does not answer" in readme
    assert "13 a batch ended failed, expired or cancelled" in readme


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:8300", "http://127.0.0.1:8300"),
        ("0.0.0.0:8300", "http://127.0.0.1:8300"),
        (":8300", "http://127.0.0.1:8300"),
        ("[::]:8300", "http://[::1]:8300"),
        ("[::1]:9", "http://[::1]:9"),
        ("batch.example:443", "http://batch.example:443"),
    ],
)
def test_connect_url_reaches_a_wildcard_on_loopback(listen: str, url: str) -> None:
    assert connect_url(listen) == url


@pytest.mark.parametrize("listen", ["8300", "host:", "host:0", "host:70000", "h:p"])
def test_connect_url_refuses_what_is_no_address(listen: str) -> None:
    with pytest.raises(ValueError, match="expected host:port"):
        connect_url(listen)


def test_the_config_gives_address_key_and_whether_it_is_on(tmp_path: Path) -> None:
    svc = service_from_config(
        str(config(tmp_path, 'enabled = true\nlisten = "0.0.0.0:8399"\napi_key_file = "/k"\n'))
    )
    assert (svc.url, svc.key_file, svc.enabled) == ("http://127.0.0.1:8399", "/k", True)
    off = service_from_config(str(config(tmp_path, "")))
    assert (off.url, off.key_file, off.enabled) == ("http://127.0.0.1:8300", None, False)


def test_errors_file_name_sits_beside_the_output() -> None:
    assert errors_path("/tmp/out.jsonl") == "/tmp/out.errors.jsonl"
    assert errors_path("results") == "results.errors.jsonl"


def test_a_farm_without_batch_says_how_to_turn_it_on(tmp_path: Path) -> None:
    cfg = config(tmp_path, "")
    r = farmctl("--config", str(cfg), "batch", "list")
    assert r.returncode == BatchExit.UNREACHABLE, r.stderr
    assert r.stderr == (
        f"farmctl: the batch service is off: [batch] enabled is not true in {cfg}: set it, "
        "then start the service (systemctl enable --now sglang-farm-batch; a farm run with "
        "--runtime process starts it itself)\n"
    )


def test_a_service_that_is_not_running_is_exit_11_with_where_and_what_to_do(
    tmp_path: Path,
) -> None:
    port = closed_port()
    key = tmp_path / "batch.key"
    key.write_text("k\n")
    cfg = config(tmp_path, f'enabled = true\nlisten = "127.0.0.1:{port}"\napi_key_file = "{key}"\n')
    for args in (["list"], ["status", "batch_x"], ["wait", "batch_x"], ["cancel", "batch_x"]):
        r = farmctl("--config", str(cfg), "batch", *args)
        assert r.returncode == BatchExit.UNREACHABLE, (args, r.stderr)
        assert r.stderr.startswith(
            f"farmctl: the batch service does not answer at http://127.0.0.1:{port} ("
        ), r.stderr
        assert "is its farm running? a farm run with --runtime process starts it" in r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_a_key_only_the_farms_group_may_read_is_refused_to_another_user_with_the_fix(
    shared_dir: Path,
) -> None:
    tmp_path = shared_dir / "farm"
    tmp_path.mkdir(mode=0o755)
    key = tmp_path / "batch.key"
    key.write_text("secret\n")
    os.chmod(key, 0o640)
    cfg = config(tmp_path, f'enabled = true\nlisten = "127.0.0.1:9"\napi_key_file = "{key}"\n')
    os.chmod(cfg, 0o644)
    r = asuser.as_nobody([*FARMCTL, "--config", str(cfg), "batch", "list"], check=False)
    assert r.returncode == BatchExit.FAILED, r.stderr
    assert r.stderr == (
        f"farmctl: permission denied on the batch API key {key}: only root and members of the "
        "farm's group (default sglang-farm) may read it; use sudo or ask for "
        "'usermod -aG sglang-farm'\n"
    )
    assert "secret" not in r.stdout + r.stderr


def test_a_missing_or_empty_key_and_a_config_without_one(tmp_path: Path) -> None:
    key = tmp_path / "none.key"
    cfg = config(tmp_path, f'enabled = true\nlisten = "127.0.0.1:9"\napi_key_file = "{key}"\n')
    r = farmctl("--config", str(cfg), "batch", "list")
    assert r.returncode == BatchExit.FAILED
    assert f"the batch API key {key} ([batch] api_key_file of {cfg}) does not exist" in r.stderr
    key.write_text("\n")
    r = farmctl("--config", str(cfg), "batch", "list")
    assert r.returncode == BatchExit.FAILED
    assert r.stderr == f"farmctl: the batch API key {key} is empty: write the key into it\n"
    cfg = config(tmp_path, "enabled = true\n")
    r = farmctl("--config", str(cfg), "batch", "list")
    assert r.returncode == BatchExit.USAGE
    assert f"{cfg} names no [batch] api_key_file" in r.stderr


def test_bad_configs_are_usage_errors_naming_the_file(tmp_path: Path) -> None:
    r = farmctl("--config", str(tmp_path / "nope.toml"), "batch", "list")
    assert r.returncode == BatchExit.USAGE
    assert r.stderr == f"farmctl: cannot read {tmp_path / 'nope.toml'}: No such file or directory\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("[batch\n")
    r = farmctl("--config", str(bad), "batch", "list")
    assert r.returncode == BatchExit.USAGE and "is not valid TOML" in r.stderr
    cfg = config(tmp_path, 'enabled = true\nlisten = "8300"\n')
    r = farmctl("--config", str(cfg), "batch", "list")
    assert r.returncode == BatchExit.USAGE
    assert r.stderr == f"farmctl: {cfg}: [batch] listen: expected host:port, got '8300'\n"


def test_submit_refuses_a_missing_or_empty_file_before_any_call(tmp_path: Path) -> None:
    cfg = config(tmp_path, "")  # no service: the file is judged first
    res = CliRunner().invoke(cli, ["--config", str(cfg), "batch", "submit", str(tmp_path / "no")])
    assert res.exit_code == BatchExit.USAGE
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = farmctl("--config", str(cfg), "batch", "submit", str(empty))
    assert r.returncode == BatchExit.USAGE
    assert r.stderr == f"farmctl: {empty} is empty: a batch file holds one JSON request per line\n"


def test_batch_is_listed_in_farmctls_help() -> None:
    r = CliRunner().invoke(cli, ["--help"])
    assert r.exit_code == 0 and "batch" in r.output
    r = CliRunner().invoke(cli, ["batch", "--help"])
    assert r.exit_code == 0
    for command in ("submit", "list", "status", "wait", "cancel", "results"):
        assert command in r.output


def test_a_service_killed_mid_answer_is_exit_11_which_a_wait_rides_out(tmp_path: Path) -> None:
    # A listener that reads the request and closes the connection unanswered: what
    # `kill -9` of the batch service does to a call in flight (the README's walkthrough).
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)

    threading.Thread(target=serve, daemon=True).start()
    key = tmp_path / "batch.key"
    key.write_text("k\n")
    cfg = config(tmp_path, f'enabled = true\nlisten = "127.0.0.1:{port}"\napi_key_file = "{key}"\n')
    try:
        r = farmctl("--config", str(cfg), "batch", "status", "batch_x")
    finally:
        stop.set()
        listener.close()
    assert r.returncode == BatchExit.UNREACHABLE, r.stderr
    assert r.stderr.startswith(
        f"farmctl: batch batch_x: the batch service at http://127.0.0.1:{port} closed the "
        "connection ("
    ), r.stderr
    assert "it stopped or restarted" in r.stderr and "Traceback" not in r.stderr
