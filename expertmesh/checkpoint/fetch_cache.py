"""The cache directory `expertmesh fetch` (checkpoint/fetch.py) writes into, walked without following symbolic
links (a link where the index puts a file or a directory is removed and said so), and its record of verified files
under `.expertmesh-fetch/`."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path

from expertmesh.checkpoint.fetch_index import STATE_DIR, STATE_FILE, FetchError, FileEntry, check_open_file


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a fifo planted in the cache cannot hang us


class CacheDir:
    """The cache directory, walked from a directory descriptor one name at a time, never through a symbolic link:
    a link (or a file) where the index needs a directory, or a link (or a fifo, …) where it puts a file, is
    removed — and said so — and a real one made in its place, so nothing outside the cache is read or written. A
    directory in the way is left alone (FetchError). The cache directory itself may be a link: whoever chose
    `--cache` chose that."""

    def __init__(self, root: Path, out):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.out = root, out
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self.fd)

    def clear(self, dfd: int, name: str, rel: str, need: str) -> None:
        """Remove what is at `rel` (not a `need`) so that one can be made there."""
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            raise FetchError(
                f"{self.root / rel}: a directory in the cache where fetch needs a {need} (left alone: "
                f"remove it by hand)"
            )
        if stat.S_ISLNK(st.st_mode):
            what = f"a symbolic link in the cache (→ {os.readlink(name, dir_fd=dfd)!r})"
            why = "fetch never follows links out of the cache"
        else:
            what = "a file in the cache" if stat.S_ISREG(st.st_mode) else "a special file in the cache"
            why = "it is in the way"
        os.unlink(name, dir_fd=dfd)
        self.out(f"FETCH replaced {rel!r}: {what} where fetch needs a {need}: {why}")

    def directory(self, parts: list[str]) -> int:
        """A descriptor of the directory `parts` below the root, made where missing."""
        fd = os.dup(self.fd)
        try:
            for k, name in enumerate(parts):
                rel = "/".join(parts[: k + 1])
                for _ in range(3):  # there, made, or cleared and made
                    try:
                        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=fd)
                        break
                    except FileNotFoundError:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(name, 0o755, dir_fd=fd)
                    except OSError as e:
                        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                            raise
                        self.clear(fd, name, rel, "directory")
                else:
                    raise FetchError(f"{self.root / rel}: cannot make it a directory (something keeps replacing it)")
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open(self, dfd: int, name: str, rel: str, flags: int) -> int:
        """os.open of the regular file `name` in `dfd`, never through a link (whatever else is there is cleared)."""
        for _ in range(3):
            try:
                fd = os.open(name, flags | NOFOLLOW, 0o644, dir_fd=dfd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                    raise
                self.clear(dfd, name, rel, "file")
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            self.clear(dfd, name, rel, "file")
        raise FetchError(f"{self.root / rel}: cannot open it as a file (something keeps replacing it)")

    def create(self, dfd: int, name: str, rel: str) -> int:
        """A new, empty regular file `name` in `dfd` for writing: whatever was there is removed first, so nothing is
        written through a link — symbolic, or a hard link to a file elsewhere."""
        if self.regular(dfd, name, rel) is not None:
            os.unlink(name, dir_fd=dfd)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644, dir_fd=dfd)

    def regular(self, dfd: int, name: str, rel: str) -> os.stat_result | None:
        """The stat of the regular file at `rel`, None when there is none (anything else there is cleared)."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISREG(st.st_mode):
            return st
        self.clear(dfd, name, rel, "file")
        return None

    def check(self, dfd: int, name: str, rel: str, entry: FileEntry) -> str | None:
        with os.fdopen(self.open(dfd, name, rel, os.O_RDONLY), "rb") as fh:
            return check_open_file(fh, entry)

    def load_state(self, sfd: int) -> dict:
        """The record of verified files ({} when there is none or it is unreadable: everything is verified again)."""
        try:
            fh = os.fdopen(self.open(sfd, STATE_FILE, f"{STATE_DIR}/{STATE_FILE}", os.O_RDONLY), "rb")
        except FileNotFoundError:
            return {}
        with fh:
            with contextlib.suppress(ValueError, RecursionError):
                state = json.loads(fh.read())
                if isinstance(state, dict):
                    return state
        self.out(f"FETCH {STATE_DIR}/{STATE_FILE} unreadable: every file is verified again")
        return {}

    def save_state(self, sfd: int, state: dict) -> None:
        """Written whole to a temporary file, then renamed over the record: never torn."""
        tmp = STATE_FILE + ".tmp"
        fd = self.create(sfd, tmp, f"{STATE_DIR}/{tmp}")
        try:
            write_all(fd, json.dumps(state).encode())
        finally:
            os.close(fd)
        os.replace(tmp, STATE_FILE, src_dir_fd=sfd, dst_dir_fd=sfd)
