"""Model staging from the Hub, through a local stand-in of its HTTP API (tests/fake_hub.py).

huggingface_hub's own `snapshot_download` does the download (`endpoint=` points it at
the stand-in); the farm then copies the snapshot into the workers' path, verified
against the Hub's etags (an LFS file's sha256, a small file's git blob id).
"""

from __future__ import annotations

import hashlib
import os
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fake_hub import FakeHub, FakeRepo, serve
from sglang_farm.config import load_spec
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.manifest import MANIFEST_NAME, manifest_from_json
from sglang_farm.staging.plan import MountFacts
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.runner import stage_model

TINY = {
    "config.json": b'{"architectures": ["Qwen3ForCausalLM"]}',
    "model.safetensors": os.urandom(200_000),
    "tokenizer/tokenizer.json": b'{"v": 1}' * 20,
}


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    h = FakeHub()
    h.add(FakeRepo("tiny-org/tiny-model", dict(TINY)))
    with serve(h):
        yield h


def roomy(path: Path) -> MountFacts:
    return MountFacts("/", "ext4", "rw", 1 << 40, 1 << 40)


def hub_spec(tmp: Path, extra: str = "", source: str = "tiny-org/tiny-model") -> FarmSpec:
    return load_spec(
        textwrap.dedent(
            f"""
            [farm]
            python = "{sys.executable}"
            module = "sglang_farm.sim"
            state_dir = "{tmp / "state"}"
            [workers]
            gpus = [0]
            [metrics]
            gpu_source = "none"
            [sglang]
            model_path = "{tmp / "shm" / "model"}"
            [model]
            source = "{source}"
            headroom = 0
            {extra}
            """
        ),
        source="test.toml",
    )


def files_of(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def test_hub_download_through_the_stand_in_is_staged_verified_by_the_hubs_etags(
    tmp_path: Path, hub: FakeHub
) -> None:
    spec = hub_spec(tmp_path)
    seen: list[StageProgress] = []
    r = stage_model(
        spec, cancel=threading.Event(), report=seen.append, measure=roomy, endpoint=hub.url
    )
    target = tmp_path / "shm" / "model"
    assert files_of(target) == TINY and not r.current
    # The persistent cache holds the snapshot (default: <state_dir>/hub-cache).
    assert (tmp_path / "state" / "hub-cache" / "models--tiny-org--tiny-model").is_dir()
    # The agent's alone: gated weights reach others only as the copy, to the workers' group.
    assert (tmp_path / "state" / "hub-cache").stat().st_mode & 0o777 == 0o700
    recorded = manifest_from_json((target / MANIFEST_NAME).read_text())
    assert recorded is not None
    by = recorded.by_path()
    assert by["model.safetensors"].sha256 == hashlib.sha256(TINY["model.safetensors"]).hexdigest()
    assert by["config.json"].git_sha1 is not None  # a small file: its git blob id
    assert recorded.origin == "hub:tiny-org/tiny-model@" + hub.repos["tiny-org/tiny-model"].commit
    assert any(p.step == "downloading" for p in seen) and any(p.step == "copying" for p in seen)
    # Again: nothing downloaded (the cache), nothing copied (the copy is current).
    gets = len([q for q in hub.requests if q.method == "GET" and "/resolve/" in q.path])
    r2 = stage_model(spec, cancel=threading.Event(), measure=roomy, endpoint=hub.url)
    assert r2.current
    assert len([q for q in hub.requests if q.method == "GET" and "/resolve/" in q.path]) == gets


def test_an_interrupted_download_resumes_with_a_range_request(tmp_path: Path, hub: FakeHub) -> None:
    # huggingface_hub writes in 10 MiB chunks: the connection drops after the first one.
    big = os.urandom(12 << 20)
    hub.repos["tiny-org/tiny-model"].files["model.safetensors"] = big
    hub.cut_after["model.safetensors"] = 11 << 20
    stage_model(hub_spec(tmp_path), cancel=threading.Event(), measure=roomy, endpoint=hub.url)
    gets = hub.gets("model.safetensors")
    assert [g.range for g in gets] == [None, "bytes=10485760-"]
    assert (tmp_path / "shm" / "model" / "model.safetensors").read_bytes() == big


def test_a_corrupt_cache_blob_is_a_checksum_mismatch(tmp_path: Path, hub: FakeHub) -> None:
    spec = hub_spec(tmp_path)
    stage_model(spec, cancel=threading.Event(), measure=roomy, endpoint=hub.url)
    blob = (
        tmp_path
        / "state"
        / "hub-cache"
        / "models--tiny-org--tiny-model"
        / "blobs"
        / hashlib.sha256(TINY["model.safetensors"]).hexdigest()
    )
    blob.write_bytes(b"\0" * len(TINY["model.safetensors"]))  # bit rot on the cache disk
    # Force a fresh copy of that file: the staged one is damaged as well.
    (tmp_path / "shm" / "model" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(StageError) as err:
        stage_model(spec, cancel=threading.Event(), measure=roomy, endpoint=hub.url)
    assert err.value.kind is StageFailureKind.CHECKSUM_MISMATCH
    assert "model.safetensors" in err.value.message
    # The fix: the corrupt blob out of the cache (a Hub snapshot has no SHA256SUMS).
    assert f"rm {blob}" in err.value.fix and "SHA256SUMS" not in err.value.fix


def test_an_unknown_repo_is_a_hub_error_with_what_to_check(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(StageError) as err:
        stage_model(
            hub_spec(tmp_path, source="tiny-org/nope"),
            cancel=threading.Event(),
            measure=roomy,
            endpoint=hub.url,
        )
    assert err.value.kind is StageFailureKind.HUB_ERROR
    assert "tiny-org/nope@main" in err.value.message
    assert "[model] source" in err.value.fix
    assert not (tmp_path / "shm" / "model").exists()


def test_the_token_comes_from_a_private_file_and_is_sent(tmp_path: Path, hub: FakeHub) -> None:
    token = tmp_path / "hf-token"
    token.write_text("hf_secret123\n")
    token.chmod(0o644)
    spec = hub_spec(tmp_path, f'token_file = "{token}"')
    with pytest.raises(StageError) as err:
        stage_model(spec, cancel=threading.Event(), measure=roomy, endpoint=hub.url)
    assert err.value.kind is StageFailureKind.CREDENTIALS
    assert "readable by others" in err.value.message and "chmod 600" in err.value.fix
    assert "hf_secret123" not in str(err.value)
    assert hub.requests == []  # refused before any request
    token.chmod(0o600)
    stage_model(spec, cancel=threading.Event(), measure=roomy, endpoint=hub.url)
    assert {q.authorization for q in hub.requests} == {"Bearer hf_secret123"}


def test_a_repo_id_the_library_refuses_is_a_hub_error_not_a_crash(tmp_path: Path) -> None:
    from sglang_farm.staging.hub import download

    with pytest.raises(StageError) as err:
        download("org/name..x", None, tmp_path / "cache")
    assert err.value.kind is StageFailureKind.HUB_ERROR
    assert "org/name..x@main" in err.value.message
    assert "[model] source" in err.value.fix


def test_a_recorded_manifest_whose_entries_are_not_objects_is_no_manifest() -> None:
    assert manifest_from_json('{"origin": "x", "files": [1, "a"]}') is None
    assert (
        manifest_from_json('{"origin": "x", "files": [{"path": "a", "size": 1, "sha256": 5}]}')
        is None
    )
    assert manifest_from_json("[]") is None


def test_download_progress_is_throttled_like_the_copy(tmp_path: Path, hub: FakeHub) -> None:
    # Each report rebuilds the farm view: at most one per REPORT_EVERY_S of the clock
    # (frozen here), however many chunks arrive.
    repo = hub.repos["tiny-org/tiny-model"]
    for n in range(6):
        repo.files[f"shard-{n}.safetensors"] = os.urandom(300_000)
    seen: list[StageProgress] = []
    stage_model(
        hub_spec(tmp_path),
        cancel=threading.Event(),
        report=seen.append,
        measure=roomy,
        endpoint=hub.url,
        clock=lambda: 100.0,
    )
    downloading = [p for p in seen if p.step == "downloading"]
    assert 1 <= len(downloading) <= 2, len(downloading)


def test_cancel_stops_a_download_mid_way(tmp_path: Path, hub: FakeHub) -> None:
    repo = hub.repos["tiny-org/tiny-model"]
    for n in range(6):
        repo.files[f"shard-{n}.safetensors"] = os.urandom(300_000)
    cancel = threading.Event()

    def report(p: StageProgress) -> None:
        if p.step == "downloading":
            cancel.set()  # the agent is stopping

    with pytest.raises(StageError) as err:
        stage_model(
            hub_spec(tmp_path), cancel=cancel, report=report, measure=roomy, endpoint=hub.url
        )
    assert err.value.kind is StageFailureKind.CANCELLED
    assert "download" in err.value.message
    assert not (tmp_path / "shm" / "model").exists()
