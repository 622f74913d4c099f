"""Pure: the bodies and server-sent events SGLang's generation routes answer with.

Shapes follow SGLang's own serving code (sgl-project/sglang):
`python/sglang/srt/entrypoints/http_server.py::generate_request` for `/generate`,
`entrypoints/openai/serving_chat.py::_generate_chat_stream` (chunks built by
`openai/sse_utils.py::build_sse_content`) and `openai/serving_completions.py` for the
OpenAI routes. A stream is `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`:

- `/generate`: one event per token, `text` and `output_ids` cumulative (SGLang's
  default, `--incremental-streaming-output` off), `meta_info.finish_reason` null
  until the last event;
- `/v1/chat/completions`: a first chunk with `delta: {"role": "assistant", "content": ""}`,
  one `delta: {"content": ...}` chunk per token, a last chunk with an empty delta and
  `finish_reason`, then (with `stream_options.include_usage`) a usage chunk with no choices;
- `/v1/completions`: one `text` chunk per token, `finish_reason` on the last one,
  then the optional usage chunk.

Every simulated token is the text " sim" (token id 1); a chat message's content is
those tokens without the leading space. An arithmetic question (sim/regress.py) is
answered instead with one token, " <number>", and finish reason "stop": a `Script` says
which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOKEN_TEXT = " sim"
TOKEN_ID = 1
EOS_ID = 2  # the token an answer "stops" on (SGLang's matched stop token)
FINISH_LENGTH = "length"  # the simulator always generates exactly max_new_tokens
FINISH_STOP = "stop"  # an answer: one token, then the end-of-sequence token
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Script:
    """What a reply's tokens say: " sim" each (`answer` None), or the one token " <answer>"."""

    answer: str | None = None

    @property
    def finish(self) -> str:
        return FINISH_LENGTH if self.answer is None else FINISH_STOP

    def token(self, n: int) -> str:
        """The text of token `n` (from 1)."""
        return TOKEN_TEXT if self.answer is None else f" {self.answer}"

    def text(self, tokens: int) -> str:
        """The text after `tokens` tokens (`/generate`, `/v1/completions`)."""
        return "".join(self.token(n) for n in range(1, tokens + 1))

    def finish_json(self, tokens: int) -> dict[str, Any]:
        """`/generate`'s `meta_info.finish_reason` once finished."""
        if self.answer is None:
            return {"type": FINISH_LENGTH, "length": tokens}
        return {"type": FINISH_STOP, "matched": EOS_ID}


PLAIN = Script()


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_text(tokens: int, script: Script = PLAIN) -> str:
    """A chat message's content after `tokens` tokens: "sim sim sim" (or the answer)."""
    return script.text(tokens).lstrip()


def chat_delta(token: int, script: Script = PLAIN) -> str:
    """The content one token adds to a chat message (`token` counts from 1)."""
    text = script.token(token)
    return text.lstrip() if token == 1 else text


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `cached` (with --enable-cache-report, as SGLang reports it):
    `prompt_tokens_details.cached_tokens`, the prompt tokens found in the prefix cache."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def generate_body(
    rid: str,
    prompt_tokens: int,
    tokens: int,
    *,
    finished: bool,
    e2e_s: float,
    script: Script = PLAIN,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A `/generate` answer (non-streaming) or one stream event after `tokens` tokens."""
    finish = script.finish_json(tokens) if finished else None
    return {
        "text": script.text(tokens),
        "output_ids": [TOKEN_ID] * tokens,
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "cached_tokens": cached_tokens,
            "e2e_latency": round(e2e_s, 4),
        },
    }


def chat_body(
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    tokens: int,
    script: Script = PLAIN,
    cached: int | None = None,
) -> dict[str, Any]:
    """A non-streaming `/v1/chat/completions` answer."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": chat_text(tokens, script)},
                "finish_reason": script.finish,
                "logprobs": None,
            }
        ],
        "usage": usage(prompt_tokens, tokens, cached),
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    *,
    role: str | None = None,
    content: str | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; the delta carries only the fields given."""
    delta: dict[str, str] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "matched_stop": None,
            }
        ],
    }


def usage_chunk(
    rid: str,
    created: int,
    model: str,
    obj: str,
    prompt_tokens: int,
    tokens: int,
    cached: int | None = None,
) -> dict[str, Any]:
    """The last chunk of a stream asked for `stream_options.include_usage`: no choices."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, tokens, cached),
    }


def completion_body(
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    tokens: int,
    script: Script = PLAIN,
    cached: int | None = None,
) -> dict[str, Any]:
    """A non-streaming `/v1/completions` answer: the whole text in one chunk, plus usage."""
    body = completion_chunk(rid, created, model, script.text(tokens), script.finish)
    body["usage"] = usage(prompt_tokens, tokens, cached)
    return body


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    """One streamed `text_completion` chunk."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "matched_stop": None,
            }
        ],
    }
