#!/usr/bin/env python3
"""Pure: the demo's example batch input, OpenAI's Batch API JSONL (README, "Run a batch job").

    python3 scripts/batch_example.py > /tmp/prompts.jsonl            # 10,000 requests
    python3 scripts/batch_example.py --count 500 --model my/model    # another size or model

One request per line, `{"custom_id", "method", "url", "body"}` for `/v1/chat/completions`,
every custom_id unique (`prompt-00000` ...). The same arguments always give the same bytes:
the prompts come from a seeded generator of this script's own (no `random` whose
algorithm could change between Pythons), so a run can be compared with the last one.
Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

DEFAULT_COUNT = 10_000
DEFAULT_MODEL = "sim/Qwen3.6-27B"  # etc/sglang-farm/demo.toml's [sglang] model_path

_SUBJECTS = (
    "the water cycle",
    "a binary search",
    "photosynthesis",
    "the Treaty of Westphalia",
    "TCP slow start",
    "compound interest",
    "the Krebs cycle",
    "a hash table",
    "plate tectonics",
    "the French Revolution",
    "gradient descent",
    "an eclipse",
)
_ASKS = (
    "Explain {s} in two sentences.",
    "Write a haiku about {s}.",
    "List three facts about {s}.",
    "What is a common misconception about {s}?",
    "Summarise {s} for a ten-year-old.",
    "Give one exam question about {s}, with its answer.",
)
_SYSTEMS = (None, "You are a concise assistant.", "Answer in plain English, no lists.")


def _numbers(seed: int) -> Iterator[int]:
    """A 64-bit xorshift* generator: fixed here, so the file never changes under a new Python."""
    x = seed or 0x9E3779B97F4A7C15
    while True:
        x ^= (x >> 12) & 0xFFFFFFFFFFFFFFFF
        x ^= (x << 25) & 0xFFFFFFFFFFFFFFFF
        x ^= (x >> 27) & 0xFFFFFFFFFFFFFFFF
        yield (x * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF


def requests(
    count: int = DEFAULT_COUNT, model: str = DEFAULT_MODEL, seed: int = 33
) -> Iterator[str]:
    """The file's lines (without their newline)."""
    rnd = _numbers(seed)
    width = max(5, len(str(count - 1)))
    for i in range(count):
        subject = _SUBJECTS[next(rnd) % len(_SUBJECTS)]
        ask = _ASKS[next(rnd) % len(_ASKS)].format(s=subject)
        system = _SYSTEMS[next(rnd) % len(_SYSTEMS)]
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{ask} (#{i})"})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": 8 + next(rnd) % 25,  # 8..32: seconds of simulated work, not minutes
            "temperature": 0.7,
        }
        yield json.dumps(
            {
                "custom_id": f"prompt-{i:0{width}d}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            },
            separators=(",", ":"),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="requests (10,000)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"body.model ({DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    try:
        for line in requests(args.count, args.model):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has all it wanted
        # Python's documented way: no flush at exit into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
