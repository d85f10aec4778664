"""The cost cache file: profiled cost tables shared safely by processes (torch-free).

Glossary:
    cache file    JSON ``{"kind": CACHE_KIND, "format": CACHE_FORMAT, "entries": {key: table}}``.
                  The ``kind`` marker is how a file is recognised as ours; any other file (a lengths
                  file passed by mistake, a file that does not parse) is an error naming it and is
                  never written, renamed over or chmod-ed. An empty file holds nothing to lose and
                  counts as an empty cache; so does a cache of ours in an older layout.
    store         one entry added under an exclusive ``flock`` on the side file ``<cache>.lock``:
                  read the file again, merge the entry into what is there now, write a temporary
                  file beside it and rename it over the cache. Processes sharing one cache keep each
                  other's entries, and a crash never leaves a half-written cache. The lock file is
                  left in place (removing it would race with a process waiting on it).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omnibal_compile._utils.files import atomic_write_text
from omnibal_compile.errors import InputError

__all__ = ["CACHE_FORMAT", "CACHE_KIND", "read_cache", "store_in_cache"]

CACHE_KIND = "omnibal-compile cost cache"
"""Marker in every cache file this library writes."""
CACHE_FORMAT = 3
"""Version of the cache file layout (2: blocks carry signature, profiled_as, time_spread; 3: and weight_grad_s).
A cache of ours in an older layout is read as empty and replaced on the next store; a newer one is an error."""

_FIX = "pass another path as the cost cache (a new file is made there)"


def read_cache(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The entries of the cache at ``path`` ({} when there is no file yet).

    Raises :class:`InputError` naming ``path`` when it exists but is not a cost cache of ours.
    """
    path = Path(path)
    if not path.exists():
        return {}
    if path.is_dir():
        raise InputError(f"cost cache {path} is a directory; give a file path (it is made on first use)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cost cache {path} cannot be read ({e}); {_FIX}") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InputError(
            f"cost cache {path} is not a cost cache (not JSON: {e}); it was left as it is; {_FIX}"
        ) from None
    # caches written before the marker existed: exactly these two keys, formats 1 and 2
    legacy = isinstance(data, dict) and set(data) == {"format", "entries"} and data["format"] in (1, 2)
    if not isinstance(data, dict) or (data.get("kind") != CACHE_KIND and not legacy):
        raise InputError(
            f"cost cache {path} is not a cost cache (no \"kind\": \"{CACHE_KIND}\" field); it was left as it is; {_FIX}"
        )
    fmt = data.get("format")
    if not isinstance(fmt, int) or fmt > CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        raise InputError(
            f"cost cache {path} has format {fmt!r} (this version reads format {CACHE_FORMAT} and older); {_FIX}"
        )
    return data["entries"] if fmt == CACHE_FORMAT else {}  # an older layout's entries are measured again


def store_in_cache(path: str | os.PathLike[str], key: str, entry: Any) -> None:
    """Add ``entry`` under ``key`` to the cache at ``path``, keeping every entry other processes stored.

    Raises :class:`InputError` when ``path`` holds a file that is not ours (it is left untouched) and
    ``OSError`` when the folder cannot be written.
    """
    path = Path(path).resolve()  # through a symlink: the link stays, its target is updated
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        entries = read_cache(path)  # now, under the lock: what other processes stored since we read
        entries[key] = entry
        _replace(path, {"kind": CACHE_KIND, "format": CACHE_FORMAT, "entries": entries})


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the merge still narrows the window
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _replace(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to a new file beside ``path`` and rename it over ``path`` (atomic)."""
    atomic_write_text(path, json.dumps(data))
