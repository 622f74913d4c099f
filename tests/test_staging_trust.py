"""Model staging trusts nothing another local user can write (issue 22, items 1, 2 and 9).

`/dev/shm` (model_path's usual folder) is writable by every local user. Each scenario
plays that user for real: the attacker's steps run as nobody (tests/asuser.py), in a
root-owned 01777 folder like /dev/shm. The agent's side (the stage) runs as the shipped
unit runs the agent: uid 0 with an empty capability set (`CapabilityBoundingSet=`), so
root does not bypass permission bits nor the sticky bit. The farm's state folder (the
stage lock's home) is pytest's, root-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from asuser import NOBODY_UID, as_nobody, nobody_owned, nobody_python
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.manifest import MANIFEST_NAME
from staging_tree import AGENT_DIR, MODEL, make_source, roomy, spec_text, tree

SECRET = b"root-only secret\n"
# Root as the unit runs it: no capability at all (units/sglang-farm.service).
CAPLESS_ROOT = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
STAGE_CHILD = """
import json, os, sys, threading
from pathlib import Path
from sglang_farm.config import load_spec
from sglang_farm.staging.failure import StageError
from sglang_farm.staging.plan import MountFacts
from sglang_farm.staging.runner import stage_model
spec = load_spec(Path(sys.argv[1]).read_text(), source="farm.toml")
print(os.getpid(), flush=True)  # the agent's pid, as `ps` shows it to every user
sys.stdin.readline()  # the other user's move first
try:
    r = stage_model(spec, cancel=threading.Event(),
                    measure=lambda _p: MountFacts("/", "ext4", "rw", 1 << 40, 1 << 40))
except StageError as e:
    print(json.dumps({"kind": str(e.kind), "message": e.message, "fix": e.fix}))
else:
    print(json.dumps({"current": r.current}))
"""


def stage(
    tmp: Path,
    source: Path,
    target: Path,
    *,
    state_dir: Path | None = None,
    before: Callable[[int], None] = lambda _pid: None,
    capless: bool = True,
    farm_group: str | None = None,
    groups: str | None = None,
) -> bool:
    """Stage as the agent under its unit (uid 0, no capabilities; `capless=False`: root with
    every capability, as `sglang-farm run` from a root shell); True when the copy was
    already current. `before(pid)` runs once the stager's pid is known, before it stages.
    `farm_group`: the config's [farm] group; `groups`: the agent's supplementary groups
    (setpriv's --groups, as the unit's SupplementaryGroups=). Raises the stage's StageError."""
    text = spec_text(tmp, source, target)
    if farm_group is not None:
        text = text.replace("[farm]\n", f'[farm]\ngroup = "{farm_group}"\n', 1)
    if state_dir is not None:
        default = tmp / "state"
        text = text.replace(f'state_dir = "{default}"', f'state_dir = "{state_dir}"')
    toml = tmp / "farm.toml"
    toml.write_text(text)
    caps = CAPLESS_ROOT if capless else []
    if groups is not None:
        caps = [*(caps or ["setpriv"]), f"--groups={groups}"]
    child = subprocess.Popen(
        [*caps, sys.executable, "-c", STAGE_CHILD, str(toml)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": AGENT_DIR},
    )
    try:
        assert child.stdout is not None
        before(int(child.stdout.readline()))
        stdout, stderr = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0 and stdout, f"exit {child.returncode}\n{stdout}\n{stderr}"
    out = json.loads(stdout.splitlines()[-1])
    if "kind" in out:
        raise StageError(StageFailureKind(out["kind"]), out["message"], out["fix"])
    return bool(out["current"])


def root_secret(tmp_path: Path) -> Path:
    """A root-only file (0600, in a 0700 folder) that nobody must never get to read or change."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    return secret


def nobody_files(root: Path, files: dict[str, bytes]) -> None:
    """`files` written under `root` by nobody itself."""
    nobody_python(
        "import sys, pathlib\n"
        "root = pathlib.Path(sys.argv[1])\n"
        "for rel, hexdata in zip(sys.argv[2::2], sys.argv[3::2]):\n"
        "    (root / rel).parent.mkdir(parents=True, exist_ok=True)\n"
        "    (root / rel).write_bytes(bytes.fromhex(hexdata))\n",
        str(root),
        *[a for rel, data in files.items() for a in (rel, data.hex())],
    )


def assert_ours(target: Path) -> None:
    """model_path is the agent's copy: its folders root's 0750, its files root's 0640."""
    for dirpath, dirs, files in os.walk(target):
        for name in [".", *dirs, *files]:
            st = os.lstat(Path(dirpath) / name)
            assert st.st_uid == os.geteuid(), (Path(dirpath) / name, st.st_uid)
            mode = stat.S_IMODE(st.st_mode)
            assert mode == (0o750 if stat.S_ISDIR(st.st_mode) else 0o640), (name, oct(mode))


def nobody_left(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if os.lstat(p).st_uid == NOBODY_UID)


# --- issue 30, item 8: a private model stays private ---------------------------------------


def test_a_private_source_staged_into_a_shared_folder_is_read_by_the_workers_group_only(
    tmp_path: Path,
    shared_dir: Path,
) -> None:
    """A 0600 source in a 0700 folder (gated weights) staged into /dev/shm came out 0644 in
    a 0755 folder, and nobody read it whole. The copy is the agent's and [farm] group's
    (0640, folders 0750): a member of that group (the workers) reads it, nobody else can
    even list it. The agent is in the group as its unit makes it (SupplementaryGroups=);
    `daemon` (gid 1) plays [farm] group."""
    private = tmp_path / "gated"
    src = make_source(private, MODEL)
    for p in src.rglob("*"):
        p.chmod(0o700 if p.is_dir() else 0o600)
    src.chmod(0o700)
    target = shared_dir / "model"
    assert not stage(tmp_path, src, target, farm_group="daemon", groups="1")
    name = "model-00001-of-00002.safetensors"
    read = "import sys; sys.stdout.write(open(sys.argv[1], 'rb').read().hex())"
    got = nobody_python(read, str(target / name), check=False)
    assert got.returncode != 0 and "PermissionError" in got.stderr, got.stdout[:80]
    assert as_nobody(["ls", str(target)], check=False).returncode != 0
    for dirpath, dirs, files in os.walk(target):
        for entry in [".", *dirs, *files]:
            st = os.lstat(Path(dirpath) / entry)
            mode = stat.S_IMODE(st.st_mode)
            assert (st.st_uid, st.st_gid) == (0, 1), (entry, st.st_uid, st.st_gid)
            assert mode == (0o750 if stat.S_ISDIR(st.st_mode) else 0o640), (entry, oct(mode))
    worker = subprocess.run(  # nobody's uid with the workers' group: reads it whole
        [
            "setpriv",
            f"--reuid={NOBODY_UID}",
            "--regid=1",
            "--groups=1",
            sys.executable,
            "-I",
            "-c",
            read,
            str(target / name),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode == 0, worker.stderr
    assert bytes.fromhex(worker.stdout) == MODEL[name]


def test_a_stage_for_a_group_the_agent_is_not_in_fails_saying_so(
    tmp_path: Path,
    shared_dir: Path,
) -> None:
    """Without the group among the agent's (a unit edited by hand), the copy cannot be
    given to the workers: the stage fails naming the group and the fix, leaving nothing."""
    src = make_source(tmp_path / "src", MODEL)
    target = shared_dir / "model"
    with pytest.raises(StageError) as ei:
        stage(tmp_path, src, target, farm_group="daemon")
    assert ei.value.kind is StageFailureKind.IO_ERROR
    assert "[farm] group 'daemon'" in ei.value.message and "not a member" in ei.value.message
    assert "SupplementaryGroups=" in ei.value.fix
    assert not target.exists() and sorted(p.name for p in shared_dir.iterdir()) == []


# --- item 1: the temporary folder ---------------------------------------------------------


def test_a_temporary_folder_planted_under_the_predictable_names_is_never_used(
    tmp_path: Path, shared_dir: Path
) -> None:
    # nobody reads the agent's pid from `ps` and plants the name the stage will use (and
    # its neighbours), writable by all and sticky, holding a subfolder it locks at 0700:
    # the removal of "a leftover" failed unnoticed, root staged into it, and model_path
    # ended nobody's.
    src = make_source(tmp_path / "src", MODEL)
    target = shared_dir / "model"
    planted: list[str] = []

    def plant(pid: int) -> None:
        for n in range(pid - 2, pid + 3):
            planted.append(f".model.staging-{n}")
            nobody_owned(shared_dir, planted[-1], 0o1777)
            nobody_owned(shared_dir / planted[-1], "locked", 0o700)

    assert not stage(tmp_path, src, target, before=plant)
    assert tree(target) == MODEL
    assert_ours(target)
    # nobody's folders are not the agent's to use, nor to remove: left as they were.
    assert nobody_left(shared_dir) == sorted(planted)
    for name in planted:
        assert os.listdir(shared_dir / name) == ["locked"]


def test_a_manifest_symlink_planted_in_the_temporary_folder_is_not_followed(
    tmp_path: Path, shared_dir: Path
) -> None:
    # Scenario: nobody's temporary folder holds `.sglang-farm-manifest.json` -> a root-only
    # 0600 file; the stage wrote the manifest through it and made it 0644.
    secret = root_secret(tmp_path)
    src = make_source(tmp_path / "src", MODEL)
    target = shared_dir / "model"

    def plant(pid: int) -> None:
        temp = nobody_owned(shared_dir, f".model.staging-{pid}", 0o1777)
        as_nobody(["ln", "-s", str(secret), str(temp / MANIFEST_NAME)])

    stage(tmp_path, src, target, before=plant)
    assert secret.read_bytes() == SECRET
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_uid == 0
    assert tree(target) == MODEL
    assert_ours(target)
    assert not (target / MANIFEST_NAME).is_symlink()


@pytest.mark.parametrize("capless", [True, False], ids=["unit", "root-shell"])
def test_a_leftover_temporary_of_another_user_is_left_alone_and_ours_removed(
    tmp_path: Path, shared_dir: Path, capless: bool
) -> None:
    # Root with its capabilities (the agent run by hand) removed whatever bore the name.
    src = make_source(tmp_path / "src", MODEL)
    target = shared_dir / "model"
    foreign = nobody_owned(shared_dir, ".model.staging-1", 0o755)
    nobody_files(foreign, {"keep.txt": b"nobody's"})
    ours = shared_dir / ".model.staging-2"  # a killed stage of the agent's
    ours.mkdir()
    (ours / "half.bin").write_bytes(b"x" * 10)
    stage(tmp_path, src, target, capless=capless)
    assert not ours.exists() and tree(target) == MODEL
    assert (foreign / "keep.txt").read_bytes() == b"nobody's"


def test_a_leftover_that_cannot_be_removed_is_reported_not_ignored(
    tmp_path: Path, shared_dir: Path
) -> None:
    # A removal that fails (here: a folder of the agent's left read-only, which root without
    # capabilities cannot empty) was ignored; it is a failing disk or a hand's doing.
    src = make_source(tmp_path / "src", MODEL)
    target = shared_dir / "model"
    ours = shared_dir / ".model.staging-7"
    (ours / "sub").mkdir(parents=True)
    (ours / "sub" / "half.bin").write_bytes(b"x")
    os.chmod(ours / "sub", 0o555)
    try:
        with pytest.raises(StageError) as err:
            stage(tmp_path, src, target)
    finally:
        os.chmod(ours / "sub", 0o755)
    e = err.value
    assert e.kind is StageFailureKind.IO_ERROR
    assert str(ours) in e.message and "Permission denied" in e.message
    assert f"rm -rf {ours}" in e.fix


def test_a_state_folder_another_user_can_write_is_refused_for_the_lock(
    tmp_path: Path, shared_dir: Path
) -> None:
    # The lock lives under [farm] state_dir: one nobody can write would let it plant the
    # lock (or swap it). Refused, naming the folder and the fix.
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    state = nobody_owned(shared_dir, "state", 0o755)
    with pytest.raises(StageError) as err:
        stage(tmp_path, src, target, state_dir=state)
    e = err.value
    assert e.kind is StageFailureKind.IO_ERROR
    assert str(state) in e.message and f"uid {NOBODY_UID}" in e.message
    assert f"chown root: {state}" in e.fix
    assert not target.exists()
    # Root's own, but writable by every user: refused alike.
    open_state = tmp_path / "open-state"
    open_state.mkdir()
    os.chmod(open_state, 0o777)
    with pytest.raises(StageError) as err:
        stage(tmp_path, src, target, state_dir=open_state)
    assert str(open_state) in err.value.message and "writable by" in err.value.message
    assert f"chmod go-w {open_state}" in err.value.fix


def test_model_path_in_a_folder_another_user_owns_is_refused(
    tmp_path: Path, shared_dir: Path
) -> None:
    # nobody could swap the copy out after the stage: no copy there can be trusted.
    src = make_source(tmp_path / "src", MODEL)
    parent = nobody_owned(shared_dir, "models", 0o755)
    target = parent / "model"
    with pytest.raises(StageError) as err:
        stage(tmp_path, src, target)
    assert str(parent) in err.value.message and f"uid {NOBODY_UID}" in err.value.message
    assert "model_path" in err.value.message
    assert not target.exists()


# --- item 2: symlinks in the source -------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_symlink_in_a_local_source_is_refused_and_never_reaches_model_path(
    tmp_path: Path, shared_dir: Path, kind: str
) -> None:
    # Scenario: a source folder of nobody's with tokenizer.json -> a root-only secret;
    # after the stage, the secret was a world-readable file in model_path.
    secret = root_secret(tmp_path)
    src = nobody_owned(shared_dir, "src", 0o755)
    nobody_files(src, {"config.json": MODEL["config.json"], "model.safetensors": b"w" * 100})
    name = "tokenizer.json" if kind == "file" else "tok"
    as_nobody(["ln", "-s", str(secret if kind == "file" else tmp_path), str(src / name)])
    target = tmp_path / "shm" / "model"
    with pytest.raises(StageError) as err:
        stage(tmp_path, src, target)
    e = err.value
    assert e.kind is StageFailureKind.BAD_SOURCE
    assert str(src / name) in e.message and "symbolic link" in e.message
    assert not target.exists()
    for dirpath, _dirs, files in os.walk(tmp_path / "shm"):
        for f in files:
            assert (Path(dirpath) / f).read_bytes() != SECRET


def hub_cache_snapshot(cache: Path, files: dict[str, bytes]) -> Path:
    """A Hub cache's layout for one repo: blobs named by their digest, a snapshot of links
    (`../../blobs/<digest>`) to them. Returns the snapshot folder."""
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    for rel, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        up = "../" * (len(Path(rel).parts) + 1)
        link.symlink_to(f"{up}blobs/{digest}")
    return snap


def test_a_hub_cache_snapshot_is_read_through_its_blobs_and_verified(tmp_path: Path) -> None:
    from sglang_farm.staging.copier import stage_copy
    from sglang_farm.staging.hub import snapshot_manifest

    snap = hub_cache_snapshot(tmp_path / "cache", MODEL)
    manifest = snapshot_manifest(snap, "hub:org/tiny@c")
    assert all(f.sha256 for f in manifest.files)  # each vouched for by its blob's name
    target = tmp_path / "shm" / "model"
    stage_copy(
        snap,
        manifest,
        target,
        headroom=0,
        cancel=threading.Event(),
        measure=roomy,
        lock_dir=tmp_path / "locks",
    )
    assert tree(target) == MODEL
    assert_ours(target)


@pytest.mark.parametrize(
    "link",
    ["secret", "../../blobs/../../../secret", "../../blobs/evil-blob"],
    ids=["outside", "out-through-blobs", "blob-is-a-link"],
)
def test_a_hub_snapshot_link_leading_outside_its_blobs_is_refused(
    tmp_path: Path, link: str
) -> None:
    from sglang_farm.staging.hub import snapshot_manifest

    secret = root_secret(tmp_path)
    snap = hub_cache_snapshot(tmp_path / "cache", MODEL)
    (snap.parent.parent / "blobs" / "evil-blob").symlink_to(secret)
    bad = snap / "tokenizer.json"
    bad.symlink_to(secret if link == "secret" else link)
    with pytest.raises(StageError) as err:
        snapshot_manifest(snap, "hub:org/tiny@c")
    assert str(bad) in err.value.message
    assert "blobs" in err.value.message


# --- item 9: what nobody plants never stops staging ---------------------------------------


@pytest.mark.parametrize("how", ["file", "symlink"])
def test_a_lock_file_planted_beside_model_path_does_not_stop_staging(
    tmp_path: Path, shared_dir: Path, how: str
) -> None:
    # Scenario: nobody creates `.model.lock` (or a link by that name) beside model_path:
    # every stage failed, so no worker started.
    src = make_source(tmp_path / "src", MODEL)
    target = shared_dir / "model"
    lock = shared_dir / ".model.lock"
    if how == "file":
        as_nobody(["touch", str(lock)])
    else:
        as_nobody(["ln", "-s", "/etc/hostname", str(lock)])
    assert not stage(tmp_path, src, target)
    assert tree(target) == MODEL
    assert_ours(target)


def test_a_model_path_planted_with_symlink_loops_does_not_stop_staging(
    tmp_path: Path, shared_dir: Path
) -> None:
    # Scenario: nobody creates model_path first (after a reboot emptied /dev/shm), holding
    # `a -> .` loops: every stage failed (ELOOP), so no worker started. It is moved aside,
    # never entered: nobody's files are neither read nor removed.
    src = make_source(tmp_path / "src", MODEL)
    target = nobody_owned(shared_dir, "model", 0o777)
    as_nobody(["ln", "-s", ".", str(target / "a")])
    as_nobody(["ln", "-s", "..", str(target / "b")])
    nobody_files(target, {"config.json": b'{"evil": 1}'})
    assert not stage(tmp_path, src, target)
    assert tree(target) == MODEL
    assert_ours(target)
    aside = [p for p in shared_dir.iterdir() if ".model.foreign-" in p.name]
    assert len(aside) == 1 and os.lstat(aside[0]).st_uid == NOBODY_UID
    assert sorted(os.listdir(aside[0])) == ["a", "b", "config.json"]
    assert stage(tmp_path, src, target)  # the next stage finds its own copy current


def test_a_model_path_that_is_another_users_symlink_is_not_followed(
    tmp_path: Path, shared_dir: Path
) -> None:
    src = make_source(tmp_path / "src", MODEL)
    victim = tmp_path / "victim"  # root's folder, which the link would have the stage fill
    victim.mkdir()
    (victim / "keep").write_text("root's")
    target = shared_dir / "model"
    as_nobody(["ln", "-s", str(victim), str(target)])
    stage(tmp_path, src, target)
    assert not target.is_symlink() and tree(target) == MODEL
    assert os.listdir(victim) == ["keep"]


def test_a_hub_cache_folder_another_user_owns_is_refused_before_any_download(
    tmp_path: Path, shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its owner could plant a snapshot of files no blob name vouches for.
    from sglang_farm.staging.hub import download

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))

    cache = nobody_owned(shared_dir, "hub-cache", 0o755)
    with pytest.raises(StageError) as err:
        download("org/tiny", None, cache, endpoint="http://127.0.0.1:9")
    assert "[model] cache_dir" in err.value.message and str(cache) in err.value.message
    assert f"uid {NOBODY_UID}" in err.value.message
    assert os.listdir(cache) == []
