"""A model folder to stage and the farm that stages it: the staging tests share them."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from sglang_farm.staging.manifest import MANIFEST_NAME
from sglang_farm.staging.plan import MountFacts

AGENT_DIR = str(Path(__file__).resolve().parent.parent / "agent")


def make_source(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


MODEL = {
    "config.json": b'{"architectures": ["Qwen3ForCausalLM"]}',
    "model-00001-of-00002.safetensors": os.urandom(300_000),
    "model-00002-of-00002.safetensors": os.urandom(200_000),
    "tokenizer/tokenizer.json": b"{}" * 1000,
}


def spec_text(
    tmp: Path, source: Path, target: Path, model_extra: str = "", headroom: str = "0"
) -> str:
    return textwrap.dedent(
        f"""
            [farm]
            python = "{sys.executable}"
            module = "sglang_farm.sim"
            state_dir = "{tmp / "state"}"
            [workers]
            gpus = [0, 1]
            [metrics]
            gpu_source = "none"
            [sglang]
            model_path = "{target}"
            [model]
            source = "{source}"
            headroom = {headroom}
            {model_extra}
            """
    )


def roomy(path: Path) -> MountFacts:
    return MountFacts("/", "ext4", "rw", 1 << 40, 1 << 40)


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
