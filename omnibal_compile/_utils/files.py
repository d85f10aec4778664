"""Writing files so that a reader sees the old content or the new, never a part: :func:`atomic_write_text`."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["atomic_write_text", "file_sha256", "same_file", "writable_folder"]


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` atomically; returns the path.

    The text goes to a new file beside ``path`` (same folder, so same file system), is flushed and
    fsynced, and is renamed over ``path`` (``os.replace``). A failure at any point (a full disk, a
    kill) leaves ``path`` as it was and no temporary file behind. An existing file keeps its mode.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for any new file
    try:
        with os.fdopen(fd, "w") as f:
            if p.exists():
                os.fchmod(f.fileno(), p.stat().st_mode & 0o7777)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def writable_folder(path: str | os.PathLike[str], flag: str, holds: str) -> Path:
    """Folder ``path`` of option ``flag``, made if missing, checked to be one this process can write into.

    The one check of an output folder before any work (``holds``: what goes in it, for the message):
    a file in its place, a parent that is a file, a folder that cannot be made or written are
    InputErrors naming the flag, instead of an ``OSError`` after the work is done.
    """
    from omnibal_compile.errors import InputError

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{flag} {folder} is a file, not a folder: {holds} go inside it; give a folder instead")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{flag} {folder}: cannot create the folder ({e.strerror or e}); give a folder you can "
                         "write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {folder}: the folder is not writable, so {holds} could not be written; give a "
                         "folder you can write")
    return folder


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether paths ``a`` and ``b`` name one file (links and ``..`` resolved; a missing path is compared by name)."""
    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
    except OSError:
        pass
    return pa.resolve() == pb.resolve()


def file_sha256(path: str | os.PathLike[str]) -> str | None:
    """The sha256 of a file's bytes (hex), or None when it cannot be read."""
    import hashlib

    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()
