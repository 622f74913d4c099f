"""I/O: the HTTP routes, OpenAI's Files and Batches API (Starlette, served by uvicorn),
and `/metrics` (no key). Every `/v1` route needs `Authorization: Bearer <key>`.

Uploaded files are kept in `<state_dir>/files/` (0700), each as a 0600 file named by its
opaque id: no name a client sends reaches the file system. The batch's output and error
files are read from the store's rows as they are downloaded.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sglang_farm.batch import lifecycle
from sglang_farm.batch.lifecycle import BatchStatus
from sglang_farm.batch.metrics import BatchMetrics
from sglang_farm.batch.objects import batch_object, file_object, list_object, new_id
from sglang_farm.batch.store import BatchRow, FileRow, NotFound, Store, StoreError, StoreFull
from sglang_farm.batch.validate import ENDPOINTS

MAX_UPLOAD = 1 << 40  # no cap of OpenAI's 200 MB; the store's free space is the bound
# Beyond an input file's size, what the store needs for it: its rows, then the answers.
SPACE_FACTOR = 3
RESERVE = 16 << 20


def _error(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": code,
            }
        },
        status_code=status,
    )


class BatchApi:
    def __init__(
        self,
        store: Store,
        files_dir: str,
        api_key: str,
        metrics: BatchMetrics,
        *,
        wake: Callable[[], None] = lambda: None,
        paused: Callable[[], str | None] = lambda: None,
        free_bytes: Callable[[str], int] = lambda p: shutil.disk_usage(p).free,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._dir = Path(files_dir)
        self._key = api_key.encode()
        self._m = metrics
        self._wake = wake
        self._paused = paused
        self._free = free_bytes
        self._clock = clock
        self.app = Starlette(
            routes=[
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/files", self.upload, methods=["POST"]),
                Route("/v1/files", self.list_files, methods=["GET"]),
                Route("/v1/files/{id}", self.get_file, methods=["GET"]),
                Route("/v1/files/{id}", self.delete_file, methods=["DELETE"]),
                Route("/v1/files/{id}/content", self.file_content, methods=["GET"]),
                Route("/v1/batches", self.create_batch, methods=["POST"]),
                Route("/v1/batches", self.list_batches, methods=["GET"]),
                Route("/v1/batches/{id}", self.get_batch, methods=["GET"]),
                Route("/v1/batches/{id}/cancel", self.cancel_batch, methods=["POST"]),
            ]
        )

    def input_path(self, file_id: str) -> Path:
        return self._dir / f"{file_id}.jsonl"

    def _authorized(self, request: Request) -> bool:
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self._key)

    async def _guard(self, request: Request) -> JSONResponse | None:
        if not self._authorized(request):
            return _error(
                401,
                "missing or wrong API key: send Authorization: Bearer <the key in [batch] "
                "api_key_file>",
                code="invalid_api_key",
            )
        return None

    async def _run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kw)

    # --- metrics ---------------------------------------------------------------------------

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._m.registry), media_type=CONTENT_TYPE_LATEST)

    # --- files -----------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=1 << 20)
        except Exception as exc:  # starlette's MultiPartException and the parser's own
            return _error(400, f"not a multipart form: {exc}")
        try:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                return _error(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
            if not isinstance(upload, UploadFile):
                return _error(400, "missing the file part (multipart field 'file')", param="file")
            size = upload.size if upload.size is not None else 0
            free = await self._run(self._free, str(self._dir))
            if size * SPACE_FACTOR + RESERVE > free:
                return _error(
                    507,
                    f"the file ({size} bytes) needs about {size * SPACE_FACTOR + RESERVE} bytes "
                    f"in the batch store, which has {free} free; free space there or split "
                    "the file",
                    param="file",
                    code="insufficient_storage",
                )
            fid = new_id("file-")
            written = await self._run(self._save, fid, upload)
            row = FileRow(fid, "batch", _safe_name(upload.filename), written, self._clock())
            await self._run(self._store.add_file, row)
        except StoreFull as exc:
            return _error(507, str(exc), code="insufficient_storage")
        except OSError as exc:
            return _error(
                507, f"could not keep the file: {exc.strerror or exc}", code="insufficient_storage"
            )
        finally:
            await form.close()
        return JSONResponse(file_object(row))

    def _save(self, fid: str, upload: UploadFile) -> int:
        path = self.input_path(fid)
        tmp = path.with_suffix(".part")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                upload.file.seek(0)
                shutil.copyfileobj(upload.file, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
                n = out.tell()
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return n

    async def list_files(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        purpose = request.query_params.get("purpose")
        rows = await self._run(self._store.files, purpose=purpose)
        return JSONResponse(list_object([file_object(f) for f in rows], has_more=False))

    async def _file(self, file_id: str) -> FileRow | JSONResponse:
        try:
            row: FileRow = await self._run(self._store.file, file_id)
        except NotFound:
            return _error(404, f"no file {file_id!r}", param="file_id", code="not_found")
        return row

    async def get_file(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        got = await self._file(request.path_params["id"])
        return got if isinstance(got, JSONResponse) else JSONResponse(file_object(got))

    async def delete_file(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        got = await self._file(request.path_params["id"])
        if isinstance(got, JSONResponse):
            return got
        await self._run(self._store.delete_file, got.id)
        if got.kind == "input":
            await self._run(self.input_path(got.id).unlink, missing_ok=True)
        return JSONResponse({"id": got.id, "object": "file", "deleted": True})

    async def file_content(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        got = await self._file(request.path_params["id"])
        if isinstance(got, JSONResponse):
            return got
        if got.kind == "input":
            path = self.input_path(got.id)
            if not path.exists():
                return _error(
                    404,
                    f"file {got.id!r}'s bytes are not on this host (an input file stays with "
                    "the batch service that received it)",
                    code="not_found",
                )
            return StreamingResponse(_read_chunks(path), media_type="application/octet-stream")
        assert got.batch_id is not None
        lines = self._store.result_lines(got.batch_id, got.kind)
        return StreamingResponse(lines, media_type="application/octet-stream")

    # --- batches ---------------------------------------------------------------------------

    async def create_batch(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        try:
            doc = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(doc, dict):
            return _error(400, "the body must be a JSON object")
        endpoint = doc.get("endpoint")
        if endpoint not in ENDPOINTS:
            return _error(
                400,
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                param="endpoint",
            )
        window = doc.get("completion_window", "24h")
        seconds = lifecycle.parse_window(window)
        if seconds is None:
            return _error(
                400,
                "completion_window must be like '24h' (or '<n>s', '<n>m', '<n>h', '<n>d'), "
                f"got {window!r}",
                param="completion_window",
            )
        metadata = doc.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            return _error(400, "metadata must be an object of strings", param="metadata")
        fid = doc.get("input_file_id")
        got = await self._file(str(fid))
        if isinstance(got, JSONResponse):
            return got
        if got.kind != "input" or got.purpose != "batch":
            return _error(400, f"file {got.id!r} is not a batch input file", param="input_file_id")
        free = await self._run(self._free, str(self._dir))
        if got.bytes * (SPACE_FACTOR - 1) + RESERVE > free:
            return _error(
                507,
                f"the batch needs about {got.bytes * (SPACE_FACTOR - 1) + RESERVE} bytes in the "
                f"batch store, which has {free} free; free space there",
                code="insufficient_storage",
            )
        now = self._clock()
        row = BatchRow(
            id=new_id("batch_"),
            endpoint=str(endpoint),
            input_file_id=got.id,
            completion_window=str(window),
            status=BatchStatus.VALIDATING,
            created_at=now,
            expires_at=now + seconds,
            metadata=metadata,
        )
        try:
            await self._run(self._store.add_batch, row)
        except StoreFull as exc:
            return _error(507, str(exc), code="insufficient_storage")
        self._wake()
        return JSONResponse(batch_object(await self._run(self._store.batch, row.id)))

    async def get_batch(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        try:
            b = await self._run(self._store.batch, request.path_params["id"])
        except NotFound as exc:
            return _error(404, str(exc), code="not_found")
        return JSONResponse(self._object(b))

    def _object(self, b: BatchRow) -> dict[str, object]:
        live = b.status not in lifecycle.TERMINAL
        return batch_object(b, paused=self._paused() if live else None)

    async def list_batches(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        after = request.query_params.get("after")
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            return _error(400, "limit must be an integer from 1 to 100", param="limit")
        if not 1 <= limit <= 100:
            return _error(400, "limit must be an integer from 1 to 100", param="limit")
        try:
            rows = await self._run(self._store.batches, after=after, limit=limit + 1)
        except NotFound as exc:
            return _error(404, str(exc), param="after", code="not_found")
        data = [self._object(b) for b in rows[:limit]]
        return JSONResponse(list_object(data, has_more=len(rows) > limit))

    async def cancel_batch(self, request: Request) -> Response:
        if (denied := await self._guard(request)) is not None:
            return denied
        bid = request.path_params["id"]
        for _ in range(5):  # the runner may move it meanwhile: read, then move from that
            try:
                b = await self._run(self._store.batch, bid)
            except NotFound as exc:
                return _error(404, str(exc), code="not_found")
            if not lifecycle.can_cancel(b.status):
                if b.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                    return JSONResponse(self._object(b))
                return _error(
                    409,
                    f"batch {bid} is {b.status}: only a validating or in-progress batch can "
                    "be cancelled",
                    code="batch_not_cancellable",
                )
            try:
                moved = await self._run(
                    self._store.set_status, bid, b.status, BatchStatus.CANCELLING, now=self._clock()
                )
            except StoreError as exc:
                return _error(503, str(exc))
            if moved:
                self._wake()
                return JSONResponse(self._object(await self._run(self._store.batch, bid)))
        return _error(409, f"batch {bid} kept changing; try again")


def _read_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def _safe_name(name: str | None) -> str:
    """The client's name for the file, shown back only (never a path here)."""
    base = (name or "input.jsonl").replace("\\", "/").rsplit("/", 1)[-1]
    return "".join(ch for ch in base if ch.isprintable())[:255] or "input.jsonl"


def dumps(doc: object) -> str:
    return json.dumps(doc)
