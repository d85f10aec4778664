"""The cost cache file: a file that is not ours is never touched; processes sharing one keep every entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnibal_compile.costs._cache import CACHE_FORMAT, CACHE_KIND, read_cache, store_in_cache
from omnibal_compile.errors import InputError

# Each writer process stores its own keys one by one, all writers released at the same moment.
_WRITER = """
import sys, time
from omnibal_compile.costs._cache import store_in_cache
path, name, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
time.sleep(max(0.0, go - time.time()))
for i in range(n):
    store_in_cache(path, f"{name}-{i}", {"i": i, "by": name})
"""


def test_two_processes_storing_at_once_lose_no_entry(tmp_path):
    import time

    path, n = tmp_path / "costs.json", 60
    store_in_cache(path, "before", {"i": -1})
    go = time.time() + 2.0  # both interpreters are up by then
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name, str(n), str(go)], env=env) for name in "ab"
    ]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    entries = read_cache(path)
    assert sorted(entries) == sorted(["before", *(f"{name}-{i}" for name in "ab" for i in range(n))])
    assert entries["b-7"] == {"i": 7, "by": "b"}
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    [
        b"vit_num,token_num\n1,300\n2,812\n",  # a lengths CSV passed by mistake
        b'[{"vit_num": 1, "token_num": 300}]',  # JSON, but not a cache
        b'{"format": 2, "entries": {}, "note": "mine"}',  # looks close, has no marker
        b"\xff\xfe not text",
    ],
)
def test_a_file_that_is_not_a_cache_is_an_error_and_left_byte_identical(tmp_path, content):
    path = tmp_path / "lengths.csv"
    path.write_bytes(content)
    os.chmod(path, 0o640)
    before = path.stat()
    with pytest.raises(InputError, match=rf"cost cache {path} .*pass another path"):
        read_cache(path)
    with pytest.raises(InputError, match=rf"cost cache {path} "):
        store_in_cache(path, "k", {"i": 1})
    after = path.stat()
    assert path.read_bytes() == content
    assert (after.st_mode, after.st_ino, after.st_mtime_ns) == (before.st_mode, before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["lengths.csv"]


def test_a_newer_cache_or_a_folder_is_an_error(tmp_path):
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"kind": CACHE_KIND, "format": CACHE_FORMAT + 1, "entries": {}}))
    with pytest.raises(InputError, match=rf"{newer} has format {CACHE_FORMAT + 1}"):
        store_in_cache(newer, "k", 1)
    with pytest.raises(InputError, match=rf"cost cache {tmp_path} is a directory"):
        read_cache(tmp_path)


def test_our_cache_keeps_its_mode_and_caches_from_before_the_marker_are_ours(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": 2, "entries": {"old": {"x": 1}}}))  # written before the marker existed
    os.chmod(path, 0o604)
    store_in_cache(path, "new", {"x": 2})
    assert read_cache(path) == {"new": {"x": 2}}  # ours, read as an older layout (format 2 < 3): measured again
    assert json.loads(path.read_text())["kind"] == CACHE_KIND
    assert path.stat().st_mode & 0o777 == 0o604
    older = tmp_path / "older.json"
    older.write_text(json.dumps({"format": 1, "entries": {"old": {"x": 1}}}))  # an older layout: measured again
    assert read_cache(older) == {}
    store_in_cache(older, "new", {"x": 2})
    assert json.loads(older.read_text()) == {"kind": CACHE_KIND, "format": CACHE_FORMAT, "entries": {"new": {"x": 2}}}
    empty = tmp_path / "empty.json"
    empty.touch()  # nothing to lose: used as an empty cache
    store_in_cache(empty, "k", 1)
    assert read_cache(empty) == {"k": 1}
    link = tmp_path / "link.json"
    link.symlink_to(path)
    store_in_cache(link, "via-link", 3)
    assert link.is_symlink() and "via-link" in read_cache(path)
