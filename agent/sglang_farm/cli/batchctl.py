"""I/O: `farmctl batch ...`, the operator's side of the batch service (issue 33).

It talks HTTP to the batch service (`sglang-farm-batch`) at `[batch] listen` of the
farm's config, with the Bearer key of `[batch] api_key_file` (root and the farm's
group read it), through OpenAI's Files and Batches API the service speaks: submit a
JSONL file, list, status, wait (a progress bar on a terminal, plain lines otherwise),
cancel, and the results and error files. What it prints is `cli.batchview`'s (pure).

farmctl imports this module at its start, so only click and the standard library are
imported here at module level: httpx and the view are imported by the commands that
use them (`farmctl status` must stay fast; tests/test_farmctl.py holds the import list).
It never imports `cli.farmctl` (farmctl imports it): its errors print the same way and
its exit codes are farmctl's (README's table), 12 and 13 its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from enum import IntEnum
from typing import IO, TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    import httpx

    from sglang_farm.cli.batchview import Sample

DEFAULT_LISTEN = "127.0.0.1:8300"  # [batch] listen's default (docs/config.md)
DEFAULT_CONFIG = "/etc/sglang-farm/farm.toml"  # host.paths.DEFAULT_CONFIG_PATH
POLL_S = 1.0  # `batch wait`: how often the batch is read
PLAIN_EVERY_S = 30.0  # `batch wait` without a terminal: a line at least this often
VALIDATION_WAIT_S = 60.0  # `batch submit`: how long it waits for validation to end
SERVICE_GRACE_S = 120.0  # `batch wait`: a service that stopped answering, waited for this long


class BatchExit(IntEnum):
    """farmctl batch's exit codes: farmctl's own where they mean the same (README)."""

    OK = 0
    FAILED = 1  # the service refused, or the key cannot be read
    USAGE = 2  # bad command line, unreadable --config, unknown batch
    TIMED_OUT = 7  # wait: time ran out (the batch keeps running)
    UNREACHABLE = 12  # the batch service does not answer ([batch] off, or not running)
    NOT_COMPLETED = 13  # wait, submit --wait: the batch ended failed, expired or cancelled


class BatchError(click.ClickException):
    """An expected error: one line on stderr (`farmctl: ...`), no traceback."""

    exit_code = BatchExit.FAILED

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"farmctl: {self.format_message()}", file=file or sys.stderr)


class Failed(BatchError):
    exit_code = BatchExit.FAILED


class BadUsage(BatchError):
    exit_code = BatchExit.USAGE


class TimedOut(BatchError):
    exit_code = BatchExit.TIMED_OUT


class Unreachable(BatchError):
    exit_code = BatchExit.UNREACHABLE


class NotCompleted(BatchError):
    exit_code = BatchExit.NOT_COMPLETED


def connect_url(listen: str) -> str:
    """The URL to reach a service listening at `listen` (`host:port`, `[v6]:port`): a
    wildcard address is reached on loopback. Raises ValueError for a bad address."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {listen!r}")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Service:
    """Where the batch service is and how to authenticate to it, from the config."""

    __slots__ = ("config", "enabled", "key_file", "url")

    def __init__(self, config: str, url: str, key_file: str | None, enabled: bool) -> None:
        self.config = config
        self.url = url
        self.key_file = key_file
        self.enabled = enabled


def service_from_config(path: str) -> Service:
    """The `[batch]` section of `path`: its listen address and key file. Raises BadUsage
    for a file that cannot be read or a section farmctl cannot use."""
    import shlex
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise BadUsage(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadUsage(
            f"{path} is not valid TOML ({exc}); "
            f"check it with: sglang-farm check-config --config {shlex.quote(path)}"
        ) from None
    section = data.get("batch", {})
    if not isinstance(section, dict):
        raise BadUsage(f"{path}: [batch] is not a table; docs/config.md lists its keys")
    listen = section.get("listen", DEFAULT_LISTEN)
    key_file = section.get("api_key_file")
    try:
        url = connect_url(listen if isinstance(listen, str) else "")
    except ValueError as exc:
        raise BadUsage(f"{path}: [batch] listen: {exc}") from None
    return Service(
        path,
        url,
        key_file if isinstance(key_file, str) and key_file else None,
        section.get("enabled") is True,
    )


def start_hint(svc: Service) -> str:
    """How to get the batch service running, for the config it was read from."""
    if not svc.enabled:
        return (
            f"[batch] enabled is not true in {svc.config}: set it, then start the "
            "service (systemctl enable --now sglang-farm-batch; a farm run with "
            "--runtime process starts it itself)"
        )
    if os.path.abspath(svc.config) == DEFAULT_CONFIG:
        return "is it running? (systemctl status sglang-farm-batch)"
    if os.path.basename(svc.config) == "demo.toml":
        return "is the demo running? start it with ./scripts/demo (it starts the batch service)"
    return (
        "is its farm running? a farm run with --runtime process starts it; under systemd: "
        "systemctl status sglang-farm-batch"
    )


def read_key(svc: Service) -> str:
    """The Bearer key of `[batch] api_key_file`. Raises Failed naming the file and the fix."""
    path = svc.key_file
    if path is None:
        raise BadUsage(
            f"{svc.config} names no [batch] api_key_file: the batch service needs one "
            "(docs/config.md, [batch])"
        )
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except PermissionError:
        raise Failed(
            f"permission denied on the batch API key {path}: only root and members of the "
            "farm's group (default sglang-farm) may read it; use sudo or ask for "
            "'usermod -aG sglang-farm'"
        ) from None
    except FileNotFoundError:
        raise Failed(
            f"the batch API key {path} ([batch] api_key_file of {svc.config}) does not "
            f"exist; {start_hint(svc)}"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Failed(f"cannot read the batch API key {path}: {exc}") from None
    if not key:
        raise Failed(f"the batch API key {path} is empty: write the key into it")
    return key


def _message(resp: httpx.Response) -> str:
    """The service's own error text (OpenAI's `{"error": {"message": ...}}`), else the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:300] or resp.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return json.dumps(body)[:300]


class BatchClient:
    """The batch service's HTTP API, its errors as farmctl's messages and exit codes."""

    __slots__ = ("_http", "svc")

    def __init__(self, svc: Service, key: str) -> None:
        import httpx

        self.svc = svc
        self._http = httpx.Client(
            base_url=svc.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(60.0, connect=5.0),
        )

    def close(self) -> None:
        self._http.close()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        import httpx

        try:
            yield
        except httpx.ConnectError as exc:
            raise Unreachable(
                f"the batch service does not answer at {self.svc.url} ({exc}); "
                f"{start_hint(self.svc)}"
            ) from None
        except httpx.TimeoutException:
            raise Failed(
                f"{what}: the batch service at {self.svc.url} did not answer in time; "
                "it may be overloaded: journalctl -u sglang-farm-batch"
            ) from None
        except (httpx.RemoteProtocolError, httpx.NetworkError) as exc:
            # It closed the connection mid-answer: it stopped, or was killed, meanwhile.
            raise Unreachable(
                f"{what}: the batch service at {self.svc.url} closed the connection ({exc}): "
                f"it stopped or restarted; {start_hint(self.svc)}"
            ) from None
        except httpx.HTTPError as exc:
            raise Failed(f"{what}: {exc}") from None

    def _check(self, resp: httpx.Response, what: str, batch_id: str | None) -> httpx.Response:
        if resp.status_code < 400:
            return resp
        if resp.status_code in (401, 403):
            raise Failed(
                f"the batch service at {self.svc.url} refused the key in {self.svc.key_file} "
                f"(HTTP {resp.status_code}): it is not the key the service was started "
                "with; restart the service after a key change"
            )
        if resp.status_code == 404 and batch_id is not None:
            raise BadUsage(
                f"no batch {batch_id} at the batch service {self.svc.url}: "
                "farmctl batch list lists them"
            )
        raise Failed(f"{what}: {_message(resp)} (HTTP {resp.status_code})")

    def json(
        self,
        method: str,
        path: str,
        what: str,
        *,
        batch_id: str | None = None,
        **kwargs: Any,
    ) -> Any:
        with self._errors(what):
            resp = self._http.request(method, path, **kwargs)
        self._check(resp, what, batch_id)
        try:
            return resp.json()
        except ValueError:
            raise Failed(f"{what}: the batch service answered no JSON") from None

    def batch(self, batch_id: str) -> dict[str, Any]:
        b = self.json("GET", f"/v1/batches/{batch_id}", f"batch {batch_id}", batch_id=batch_id)
        if not isinstance(b, dict):
            raise Failed(f"batch {batch_id}: the batch service answered no batch object")
        return b

    def download(self, file_id: str, dest: str, what: str) -> int:
        """File `file_id`'s content into `dest` (written beside it, renamed into place):
        the number of lines."""
        folder = os.path.dirname(os.path.abspath(dest))
        tmp = os.path.join(folder, f".{os.path.basename(dest)}.partial-{os.getpid()}")
        lines = 0
        try:
            with self._errors(what), self._http.stream("GET", f"/v1/files/{file_id}/content") as r:
                if r.status_code >= 400:
                    r.read()
                    self._check(r, what, None)
                with open(tmp, "wb") as out:
                    for chunk in r.iter_bytes():
                        out.write(chunk)
                        lines += chunk.count(b"\n")
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(tmp, dest)
        except OSError as exc:
            raise Failed(f"cannot write {dest}: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return lines

    def metrics(self) -> str | None:
        """The service's /metrics text (no key needed), None when it does not answer."""
        import httpx

        try:
            resp = self._http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None


class BatchCtx:
    """What the `batch` group hands its commands: the service, and the client once made."""

    __slots__ = ("_client", "as_json", "svc")

    def __init__(self, svc: Service, as_json: bool) -> None:
        self.svc = svc
        self.as_json = as_json
        self._client: BatchClient | None = None

    @property
    def client(self) -> BatchClient:
        if self._client is None:
            if not self.svc.enabled:
                raise Unreachable(f"the batch service is off: {start_hint(self.svc)}")
            self._client = BatchClient(self.svc, read_key(self.svc))
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _root_flag(ctx: click.Context, name: str) -> Any:
    """An option of farmctl's root command (`--config`, `--json`), read without importing
    it: farmctl imports this module."""
    return ctx.find_root().params.get(name)


_pass = click.make_pass_decorator(BatchCtx)


@click.group()
@click.option("--json", "as_json", is_flag=True, help="Print the service's raw objects as JSON.")
@click.pass_context
def batch(ctx: click.Context, as_json: bool) -> None:
    """Batch jobs: OpenAI's Batch API on the farm (the batch service, [batch]).

    \b
    farmctl batch submit prompts.jsonl --wait
    farmctl batch list
    farmctl batch status ID | wait ID | cancel ID
    farmctl batch results ID -o out.jsonl   (and out.errors.jsonl)

    The service's address and key come from [batch] listen and api_key_file of
    --config (default /etc/sglang-farm/farm.toml). Exit codes: 0 ok (wait: the batch
    completed), 1 refused or failed, 2 usage or unknown batch, 7 timed out (wait),
    12 the batch service does not answer, 13 the batch ended failed, expired or
    cancelled (wait, submit --wait).
    """
    config = _root_flag(ctx, "config_path") or DEFAULT_CONFIG
    bctx = BatchCtx(service_from_config(config), as_json or bool(_root_flag(ctx, "as_json")))
    ctx.obj = bctx
    ctx.call_on_close(bctx.close)


def _emit(obj: object) -> None:
    click.echo(json.dumps(obj, indent=2))


def _first_url(path: str) -> str | None:
    """The `url` of the file's first request line (the batch's endpoint), if it has one."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    url = json.loads(raw).get("url")
                    return url if isinstance(url, str) else None
    except (OSError, ValueError, AttributeError):
        return None
    return None


def _metadata(pairs: tuple[str, ...]) -> dict[str, str] | None:
    meta: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BadUsage(f"--metadata takes KEY=VALUE, got {pair!r}")
        meta[key] = value
    return meta or None


@batch.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--endpoint",
    help="/v1/chat/completions or /v1/completions (default: the first line's url).",
)
@click.option(
    "--window",
    "completion_window",
    default="24h",
    show_default=True,
    help="The batch's completion_window: past it, it ends expired.",
)
@click.option(
    "--metadata",
    "metadata",
    multiple=True,
    metavar="KEY=VALUE",
    help="Metadata kept with the batch (repeatable).",
)
@click.option("--wait", "wait_", is_flag=True, help="Then wait for its end, as batch wait does.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="With --wait: give up waiting after this many seconds.",
)
@_pass
def submit(
    b: BatchCtx,
    file: str,
    endpoint: str | None,
    completion_window: str,
    metadata: tuple[str, ...],
    wait_: bool,
    timeout: float | None,
) -> None:
    """Upload FILE (JSONL: custom_id, method, url, body per line) and start its batch.

    Bad lines are refused before anything is sent, each named with its line number
    and field (exit 1). Prints the batch's id first on its line.
    """
    meta = _metadata(metadata)
    try:
        size = os.path.getsize(file)
        fh = open(file, "rb")  # noqa: SIM115 (closed below, after the upload)
    except OSError as exc:
        raise BadUsage(f"cannot read {file}: {exc.strerror}") from None
    if size == 0:
        fh.close()
        raise BadUsage(f"{file} is empty: a batch file holds one JSON request per line")
    endpoint = endpoint or _first_url(file) or "/v1/chat/completions"
    client = b.client
    with fh:
        uploaded = client.json(
            "POST",
            "/v1/files",
            f"upload of {file}",
            files={"file": (os.path.basename(file), fh, "application/jsonl")},
            data={"purpose": "batch"},
            timeout=None if size > 64 << 20 else 600.0,
        )
    file_id = uploaded.get("id") if isinstance(uploaded, dict) else None
    if not isinstance(file_id, str):
        raise Failed(f"upload of {file}: the batch service answered no file id")
    body: dict[str, Any] = {
        "input_file_id": file_id,
        "endpoint": endpoint,
        "completion_window": completion_window,
    }
    if meta:
        body["metadata"] = meta
    created = client.json("POST", "/v1/batches", f"batch of {file}", json=body)
    bid = str(created.get("id"))
    deadline = time.monotonic() + VALIDATION_WAIT_S
    while created.get("status") == "validating" and time.monotonic() < deadline:
        time.sleep(0.2)
        created = client.batch(bid)
    from sglang_farm.cli import batchview as view

    if b.as_json and not wait_:
        _emit(created)
    status = str(created.get("status"))
    total = view.counts(created)[0]
    if status == "failed":
        if not b.as_json:
            click.echo(f"{bid} refused: {file} has bad lines; nothing was sent")
            for line in view.validation_errors(created):
                click.echo(f"  {line}")
        raise Failed(f"{view.end_line(bid, created)}")
    if not b.as_json:
        click.echo(
            f"{bid} submitted: {status}, {total:,} requests ({file} as {file_id}); "
            f"watch it: farmctl batch wait {bid}"
        )
    if wait_:
        _wait(b, bid, timeout, first=created)


@batch.command("list")
@click.option(
    "--limit", type=click.IntRange(1, 100), default=20, show_default=True, help="Batches per page."
)
@click.option("--all", "all_", is_flag=True, help="Every batch, page after page.")
@_pass
def list_(b: BatchCtx, limit: int, all_: bool) -> None:
    """The batches, newest first: status, requests done and failed, endpoint, age."""
    from sglang_farm.cli import batchview as view

    batches: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        page = b.client.json("GET", "/v1/batches", "batch list", params=params)
        data = page.get("data") if isinstance(page, dict) else None
        batches += [d for d in data or [] if isinstance(d, dict)]
        if not (all_ and page.get("has_more") and data):
            break
        after = str(data[-1].get("id"))
    if b.as_json:
        _emit({"object": "list", "data": batches})
        return
    if not batches:
        click.echo("no batches yet: farmctl batch submit FILE starts one")
        return
    click.echo(view.list_table(batches, time.time()))


def _service_figures(b: BatchCtx, bid: str, want_tokens: bool) -> tuple[float | None, int | None]:
    """The service's ETA for `bid` and its token count (all batches'), from /metrics."""
    from sglang_farm.cli import batchview as view

    text = b.client.metrics()
    if text is None:
        return None, None
    eta = view.metric_sum(text, "sglang_farm_batch_eta_seconds", {"batch": bid})
    tok = view.metric_sum(text, "sglang_farm_batch_tokens_total") if want_tokens else None
    return eta, int(tok) if tok is not None else None


@batch.command()
@click.argument("batch_id", metavar="ID")
@_pass
def status(b: BatchCtx, batch_id: str) -> None:
    """One batch: its status, counts, files, times, ETA, and any validation errors."""
    from sglang_farm.cli import batchview as view

    obj = b.client.batch(batch_id)
    if b.as_json:
        _emit(obj)
        return
    eta = None
    if obj.get("status") not in view.TERMINAL:
        eta, _ = _service_figures(b, batch_id, want_tokens=False)
    click.echo(view.status_text(obj, time.time(), eta))


def _wait(
    b: BatchCtx, bid: str, timeout: float | None, *, first: dict[str, Any] | None = None
) -> NoReturn:
    from sglang_farm.cli import batchview as view

    tty = sys.stdout.isatty()
    start = time.monotonic()
    samples: list[Sample] = []
    last_plain: tuple[float, int, str] | None = None
    obj = first if first is not None else b.client.batch(bid)
    drawn = False
    if tty and str(obj.get("status")) not in view.TERMINAL:
        click.echo(f"batch {bid} (Ctrl-C stops watching; the batch keeps running):")
    try:
        while True:
            now = time.monotonic()
            st = str(obj.get("status"))
            if st in view.TERMINAL:
                break
            want_tokens = view.tokens(obj) is None
            eta_svc, tok = _service_figures(b, bid, want_tokens)
            samples = view.add_sample(samples, view.sample(obj, now, tok))
            r = view.rates(samples)
            # Cancelling: nothing more is sent, so no time to the end to tell.
            eta = view.eta_seconds(samples[-1], r, eta_svc) if st != "cancelling" else None
            if tty:
                line = view.progress_line(st, samples[-1], r, eta, columns=_columns() - 1)
                click.echo("\r" + line + "\x1b[K", nl=False)
                drawn = True
            else:
                done = samples[-1].done
                if (
                    last_plain is None
                    or last_plain[2] != st
                    or (done != last_plain[1] and now - last_plain[0] >= PLAIN_EVERY_S)
                ):
                    click.echo(view.plain_line(bid, st, samples[-1], r, eta))
                    last_plain = (now, done, st)
            if timeout is not None and now - start >= timeout:
                if drawn:
                    click.echo("")
                raise TimedOut(
                    f"batch {bid} is still {st} after {timeout:g} s ({samples[-1].done:,}/"
                    f"{samples[-1].total:,} done); it keeps running: farmctl batch wait {bid}"
                )
            time.sleep(POLL_S)
            obj = _batch_riding_out_restarts(b, bid, tty)
    except KeyboardInterrupt:
        if drawn:
            click.echo("")
        click.echo(f"stopped watching; batch {bid} keeps running (farmctl batch wait {bid})")
        sys.exit(130)
    if drawn:
        click.echo("")
    if b.as_json:
        _emit(obj)
    end = view.end_line(bid, obj)
    if obj.get("status") == "completed":
        if not b.as_json:
            click.echo(end)
        sys.exit(BatchExit.OK)
    raise NotCompleted(end)


def _batch_riding_out_restarts(b: BatchCtx, bid: str, tty: bool) -> dict[str, Any]:
    """The batch, read again; while the service does not answer (it is restarting: a crash,
    `kill -9`, an upgrade) it is asked again every second for up to `SERVICE_GRACE_S`."""
    deadline: float | None = None
    while True:
        try:
            obj = b.client.batch(bid)
        except Unreachable:
            now = time.monotonic()
            if deadline is None:
                deadline = now + SERVICE_GRACE_S
                said = (
                    f"the batch service at {b.svc.url} does not answer; waiting up to "
                    f"{SERVICE_GRACE_S:g} s for it to come back (batch {bid} resumes from "
                    "its store)"
                )
                click.echo(("\r" + said + "\x1b[K") if tty else said, nl=not tty)
            elif now >= deadline:
                if tty:
                    click.echo("")
                raise
            time.sleep(POLL_S)
            continue
        if deadline is not None:
            back = f"the batch service answers again; batch {bid} is {obj.get('status')}"
            click.echo(("\r" + back + "\x1b[K\n") if tty else back, nl=not tty)
        return obj


def _columns() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


@batch.command()
@click.argument("batch_id", metavar="ID")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Give up after this many seconds (exit 7; the batch keeps running).",
)
@_pass
def wait(b: BatchCtx, batch_id: str, timeout: float | None) -> None:
    """Watch a batch until it ends: done/total, failed, tokens/s, ETA.

    A bar redrawn in place on a terminal; otherwise a line when the status changes and
    every 30 s while it moves. Exit 0 once it completed (some requests may have
    failed: they are the error file's lines), 12 if it failed, expired or was
    cancelled, 7 after --timeout.
    """
    _wait(b, batch_id, timeout)


@batch.command()
@click.argument("batch_id", metavar="ID")
@_pass
def cancel(b: BatchCtx, batch_id: str) -> None:
    """Cancel a batch: nothing new is sent; the results it has are kept."""
    obj = b.client.json(
        "POST", f"/v1/batches/{batch_id}/cancel", f"cancel of {batch_id}", batch_id=batch_id
    )
    if b.as_json:
        _emit(obj)
        return
    st = obj.get("status") if isinstance(obj, dict) else None
    click.echo(
        f"batch {batch_id}: {st}; what it has finished is kept "
        f"(farmctl batch wait {batch_id}, then farmctl batch results {batch_id} -o FILE)"
    )


def errors_path(out: str) -> str:
    """The error file's default name beside `out`: `out.jsonl` -> `out.errors.jsonl`."""
    root, ext = os.path.splitext(out)
    return f"{root}.errors{ext or '.jsonl'}"


@batch.command()
@click.argument("batch_id", metavar="ID")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(dir_okay=False),
    help="Where the results go (one JSON line per succeeded request).",
)
@click.option(
    "--errors",
    "errors",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where the error file goes (default: OUTPUT with .errors before its suffix).",
)
@_pass
def results(b: BatchCtx, batch_id: str, output: str, errors: str | None) -> None:
    """Fetch a batch's output file, and its error file (the requests that failed).

    Lines come in no particular order: join them on custom_id. Each file is written
    beside its name and renamed into place, so a reader never sees half of one.
    """
    from sglang_farm.cli import batchview as view

    obj = b.client.batch(batch_id)
    st = str(obj.get("status"))
    out_id, err_id = obj.get("output_file_id"), obj.get("error_file_id")
    if not out_id and not err_id:
        if st not in view.TERMINAL:
            raise Failed(
                f"batch {batch_id} is {st}: its files are written when it ends; "
                f"farmctl batch wait {batch_id}"
            )
        raise Failed(f"batch {batch_id} ended {st} with no result: nothing was completed")
    said: list[str] = []
    if isinstance(out_id, str):
        n = b.client.download(out_id, output, f"output of {batch_id}")
        said.append(f"{n:,} results in {output}")
    else:
        said.append("no results (no request succeeded)")
    if isinstance(err_id, str):
        err_out = errors or errors_path(output)
        n = b.client.download(err_id, err_out, f"error file of {batch_id}")
        said.append(f"{n:,} failed requests in {err_out}")
    else:
        said.append("no failed requests")
    if b.as_json:
        _emit({"batch": batch_id, "status": st, "output": output, "lines": said})
        return
    click.echo(f"batch {batch_id} ({st}): " + "; ".join(said))
