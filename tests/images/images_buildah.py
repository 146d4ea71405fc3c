"""buildah as the images tier's engine: a private vfs image store, working containers, and
root-filesystem snapshots (how the tier checks a process wrote nothing outside its volumes)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
# chroot isolation runs where crun cannot (hybrid cgroups, no RLIMIT_NOFILE); the vfs driver
# needs no overlay support. Both are what a CI container or a VM without a daemon allows.
ISOLATION = "chroot"
# A test of the tier may include building both images (its session fixture) on two cores.
TIER_TIMEOUT_S = 1800


def cache_dir() -> Path:
    """Where scripts/build-images.sh keeps the debootstrap tarball and the tier its image store."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenlane-images"
    return Path(os.environ.get("TOKENLANE_IMAGES_CACHE") or default)


def engine_env() -> dict[str, str]:
    """The environment of every buildah call: the tier's own store, so it never touches (or
    depends on) the images of the machine's default one."""
    store = cache_dir()
    conf = store / "storage.conf"
    if not conf.exists():
        store.mkdir(parents=True, exist_ok=True)
        conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{store}/storage"\nrunroot = "{store}/run"\n')
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf), "BUILDAH_ISOLATION": ISOLATION}


def buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["buildah", *args], env=engine_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result


def image_config(image: str) -> dict:
    """The OCI config of `image` (User, Env, Entrypoint, Labels, ...)."""
    return json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]


def run_flags(*, user: Optional[str] = None, env: Optional[dict[str, str]] = None,
              volumes: Optional[list[tuple[Path, str, bool]]] = None, cap_drop_all: bool = False) -> list[str]:
    """`buildah run` flags; volumes are (host path, container path, read-only) triples."""
    flags = ["--isolation", ISOLATION]
    if user:
        flags += ["--user", user]
    if cap_drop_all:
        flags += ["--cap-drop", "all"]
    for name, value in (env or {}).items():
        flags += ["--env", f"{name}={value}"]
    for host, target, read_only in volumes or []:
        flags += ["--volume", f"{host}:{target}:{'ro' if read_only else 'rw'}"]
    return flags


class Container:
    """A buildah working container of an image (removed on exit)."""

    def __init__(self, image: str):
        self.image = image
        self.name = ""

    def __enter__(self) -> "Container":
        self.name = buildah("from", "--pull-never", "--quiet", self.image).stdout.strip()
        return self

    def __exit__(self, *exc) -> None:
        buildah("rm", self.name, check=False)

    def run(self, argv: list[str], timeout: float = 300, **flags) -> subprocess.CompletedProcess:
        """Run `argv` inside and wait; flags as run_flags takes them."""
        return subprocess.run(["buildah", "run", *run_flags(**flags), self.name, "--", *argv], env=engine_env(),
                              capture_output=True, text=True, timeout=timeout)

    def start(self, argv: list[str], log: Path, **flags) -> subprocess.Popen:
        """Start `argv` inside without waiting; stdout and stderr go to `log`. SIGTERM to the
        returned process makes buildah kill the command inside."""
        with open(log, "wb") as out:
            return subprocess.Popen(["buildah", "run", *run_flags(**flags), self.name, "--", *argv],
                                    env=engine_env(), stdout=out, stderr=subprocess.STDOUT)

    def rootfs(self) -> Path:
        """The container's root filesystem on the host (vfs: a plain folder the process writes to)."""
        return Path(buildah("mount", self.name).stdout.strip())


def walk(root: Path, skip: set[str]) -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to root, lstat) of everything under root but the relative paths in skip
    and what lies under them."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for name in list(dirnames) + filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel in skip:
                if name in dirnames:
                    dirnames.remove(name)
                continue
            yield rel, os.lstat(os.path.join(dirpath, name))


def snapshot(root: Path, skip: set[str]) -> dict[str, tuple]:
    """What a write would change: every entry with its mode and owner, and a file's size and
    mtime. A directory's mtime is left out: buildah itself creates and removes its mount points
    under /run at every run (root-owned, mode 755: the container's user cannot), and what
    a write leaves in a directory shows as an entry."""
    return {rel: (st.st_mode, st.st_uid) if stat.S_ISDIR(st.st_mode)
            else (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
            for rel, st in walk(root, skip)}


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    added = [f"+ {p}" for p in sorted(after.keys() - before.keys())]
    removed = [f"- {p}" for p in sorted(before.keys() - after.keys())]
    changed = [f"~ {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return added + removed + changed


def unpacked_size(root: Path) -> int:
    """Bytes of the regular files under root, hard links counted once: the image's size on disk."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, st in walk(root, set()):
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def missing_tools() -> list[str]:
    return [tool for tool in ("buildah",) if shutil.which(tool) is None]
