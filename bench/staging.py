"""I/O: `python -m bench.staging`: what model staging costs against a plain `cp -r`.

Writes a synthetic model (shards of incompressible bytes and a `SHA256SUMS`) into
`--source-dir`, then, in one run and on the same files:
  1. `cp -r` of the source into the target's filesystem (the floor: no verification);
  2. the farm's first stage (`staging.copier.stage_copy`: a temporary sibling, every byte
     hashed as it streams and checked against SHA256SUMS, the rename into place);
  3. the same stage again with the copy unchanged (what every agent start costs);
and prints each one's seconds and GiB/s, and stage ÷ cp. With `--drop-caches` (root
only) the page cache is emptied before 1 and 2, so both read the source cold.

    python -m bench.staging --gib 16 --target /dev/shm/bench-model --drop-caches

The files are synthetic, not a real checkpoint: the figures are I/O and hashing costs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sglang_farm.staging.copier import stage_copy
from sglang_farm.staging.source import local_manifest

GIB = 1 << 30
CHUNK = 8 << 20


def write_model(root: Path, gib: float, shards: int) -> None:
    """`shards` files of incompressible bytes totalling `gib` GiB, with their SHA256SUMS."""
    root.mkdir(parents=True, exist_ok=True)
    per_shard = int(gib * GIB) // shards
    block = os.urandom(CHUNK)
    sums = []
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        h = hashlib.sha256()
        with open(root / name, "wb") as f:
            left = per_shard
            n = 0
            while left > 0:
                # Each chunk differs (a counter in front), so nothing deduplicates it.
                piece = (n.to_bytes(8, "little") + block[8:])[: min(CHUNK, left)]
                f.write(piece)
                h.update(piece)
                left -= len(piece)
                n += 1
        sums.append(f"{h.hexdigest()}  {name}")
    (root / "config.json").write_text('{"model_type": "synthetic"}\n')
    h = hashlib.sha256((root / "config.json").read_bytes())
    sums.append(f"{h.hexdigest()}  config.json")
    (root / "SHA256SUMS").write_text("\n".join(sums) + "\n")


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(gib: float, shards: int, source_dir: Path, target: Path, cold: bool) -> dict[str, Any]:
    src = source_dir / "model"
    shutil.rmtree(src, ignore_errors=True)
    write_model(src, gib, shards)
    size = sum(p.stat().st_size for p in src.iterdir())
    cp_dst = target.parent / f".{target.name}.cp-bench"
    for p in (cp_dst, target):
        shutil.rmtree(p, ignore_errors=True)
    dropped = drop_caches() if cold else False
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(cp_dst)], check=True)
    cp_s = time.perf_counter() - t0
    shutil.rmtree(cp_dst)
    if cold:
        drop_caches()
    cancel = threading.Event()
    locks = source_dir / "locks"  # the stage lock's folder ([farm] state_dir/staging)
    t0 = time.perf_counter()
    first = stage_copy(src, local_manifest(src), target, lock_dir=locks, headroom=0, cancel=cancel)
    stage_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = stage_copy(src, local_manifest(src), target, lock_dir=locks, headroom=0, cancel=cancel)
    again_s = time.perf_counter() - t0
    shutil.rmtree(target)
    shutil.rmtree(src)
    return {
        "bytes": size,
        "cold_source": dropped,
        "cp_s": round(cp_s, 3),
        "cp_gib_s": round(size / GIB / cp_s, 3),
        "stage_s": round(stage_s, 3),
        "stage_gib_s": round(size / GIB / stage_s, 3),
        "stage_over_cp": round(stage_s / cp_s, 3),
        "first_copied_bytes": first.copied_bytes,
        "unchanged_stage_s": round(again_s, 4),
        "unchanged_copied_bytes": again.copied_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.staging", description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0, help="model size (default 1 GiB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument(
        "--source-dir",
        type=Path,
        default=None,
        help="where the synthetic source is written (default: a folder in /var/tmp)",
    )
    ap.add_argument(
        "--target",
        type=Path,
        default=None,
        help="the workers' path to stage into (default: a folder in /dev/shm)",
    )
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="empty the page cache before cp and before the stage (root)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        source_dir = args.source_dir or Path(scratch)
        target = args.target or Path(f"/dev/shm/sglang-farm-bench-{os.getpid()}")
        figures = run(args.gib, args.shards, source_dir, target, args.drop_caches)
    for key, value in figures.items():
        print(f"{key:24} {value}")
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
