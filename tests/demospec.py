"""A spec like etc/sglang-farm/demo.toml, built in code: the unit files' tests and the batch
operations' share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from sglang_farm.spec import (
    FarmSection,
    FarmSpec,
    FlagValue,
    RestartPolicy,
    StartupPolicy,
    WorkerSpec,
)


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
