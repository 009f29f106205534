"""Files and folders replaced atomically: a reader sees the old version or the new one, never a mix, never
nothing, and a process killed halfway leaves nothing that the next save or load does not clean up. And the one
rule that tells a local path from a Hub repo id (`is_repo_id`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # read once: os.umask can only be read by setting it, which is not thread-safe


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` then ``os.replace`` onto ``path`` (after an fsync), removing the temp on failure;
    the file gets the permissions the umask gives a new file."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~UMASK)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def staging_folder(target: Path) -> Path:
    """A new empty folder beside ``target`` to build its next version in (named after this process, so a
    later `clean_leftovers` can tell a live save from a dead one), with ordinary permissions."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-{os.getpid()}-", dir=target.parent))
    os.chmod(staging, 0o777 & ~UMASK)
    return staging


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return getattr(libc, "renameat2", None)


_RENAMEAT2 = _renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the
    system or filesystem cannot, and nothing was changed."""
    if _RENAMEAT2 is None:
        return False
    return _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_folder(staging: Path, target: Path) -> None:
    """Put the complete folder ``staging`` at ``target``, replacing what is there. Where the system can swap
    two folders atomically there is no moment without a complete folder at ``target``; elsewhere the old folder
    is first moved to ``.<name>.old-<pid>-*`` beside it, and `recover_folder` puts it back if the process dies
    before the new one is in. The staged files reach the disk first: a crash after the swap finds them whole."""
    _sync_folder(staging)
    if not target.exists():
        os.rename(staging, target)
        _sync(target.parent)
        return
    if exchange(staging, target):
        _sync(target.parent)
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old version
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
    os.replace(target, backup)  # onto the empty folder just made
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(backup, target)
        raise
    _sync(target.parent)
    shutil.rmtree(backup, ignore_errors=True)


def _sync_folder(folder: Path) -> None:
    """fsync every file in ``folder``, then the folder itself (its entries)."""
    for path in folder.iterdir():
        if path.is_file():
            _sync(path)
    _sync(folder)


def _sync(path: Path) -> None:
    """fsync a file or a folder (a folder's entries: where a rename landed); a system that cannot is passed over."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems refuse fsync on a folder: nothing more to do there
    finally:
        os.close(handle)


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>staging|old)-(?P<pid>\d+)-[^/]+$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_folder(target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Undo what a save killed halfway left beside ``target``: with no folder at ``target``, put back the newest
    complete backup of a dead process; remove staging folders and backups of dead processes."""
    parent = target.parent
    if not parent.is_dir():
        return
    leftovers = []
    for entry in parent.iterdir():
        match = _LEFTOVER.match(entry.name)
        if match and match["name"] == target.name and entry.is_dir() and not _alive(int(match["pid"])):
            leftovers.append((match["kind"], entry))
    backups = sorted((e for kind, e in leftovers if kind == "old"), key=lambda e: e.stat().st_mtime, reverse=True)
    if not target.exists():
        for backup in backups:
            if is_complete(backup):
                os.rename(backup, target)
                break
    for _, entry in leftovers:
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hub repo id (``owner/name``) rather than a local path: not explicit (``./``,
    ``~``, absolute), one slash, and valid by the Hub's rules. Code that falls back to the Hub asks this first,
    so a missing local folder is reported as missing instead of being looked up."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if spec.startswith((".", "~", os.sep)) or os.path.isabs(spec) or spec.count("/") != 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True
