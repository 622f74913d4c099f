"""Pure: the JSON of OpenAI's objects (file, batch, list) and of output and error lines.

Shaped as OpenAI's Batch API has them, so its clients read them unchanged; a field the
service adds (`paused`) is one OpenAI's client ignores.
"""

from __future__ import annotations

import json
import secrets

from sglang_farm.batch.lifecycle import STAMP
from sglang_farm.batch.store import BatchRow, FileRow, Result


def new_id(prefix: str) -> str:
    """An opaque id: random, never derived from a name or a path."""
    return f"{prefix}{secrets.token_hex(12)}"


def file_object(f: FileRow) -> dict[str, object]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": int(f.created_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(b: BatchRow, *, paused: str | None = None) -> dict[str, object]:
    stamps = b.stamps or {}
    obj: dict[str, object] = {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": {"object": "list", "data": [dict(e) for e in b.errors]} if b.errors else None,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": str(b.status),
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": int(b.created_at),
        "expires_at": int(b.expires_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": dict(b.metadata) if b.metadata else None,
        "usage": {
            "input_tokens": b.prompt_tokens,
            "output_tokens": b.completion_tokens,
            "total_tokens": b.prompt_tokens + b.completion_tokens,
        },
    }
    for field in STAMP.values():
        at = stamps.get(field)
        obj[field] = int(at) if at is not None else None
    if paused is not None:
        obj["paused"] = paused
    return obj


def list_object(data: list[dict[str, object]], *, has_more: bool) -> dict[str, object]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def result_line(line_id: str, custom_id: str, r: Result) -> bytes:
    """One output or error line: the answer (`response`) and/or the `error`."""
    response: dict[str, object] | None = None
    if r.status_code is not None:
        body: object = None
        if r.body is not None:
            try:
                body = json.loads(r.body)
            except ValueError:
                body = r.body
        response = {"status_code": r.status_code, "request_id": r.request_id or "", "body": body}
    error = (
        {"code": r.error_code, "message": r.error_message or ""}
        if r.error_code is not None
        else None
    )
    doc = {"id": line_id, "custom_id": custom_id, "response": response, "error": error}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
