"""tests/readme_check.py: which README blocks it runs, and that a failing example fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import readme_check as R  # noqa: E402

SETUP = (
    "# title\n\n```bash\npip install -e . && omnibal-compile demo\n"
    "pip install -e '.[test]' && \\\n  python -m pytest tests\n```\n"
)


def _check(tmp_path: Path, body: str, *extra: str) -> int:
    readme = tmp_path / "README.md"
    readme.write_text(SETUP + body)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return R.main([str(readme), "--workdir", str(work), *extra])


def test_each_kind_of_block_is_told_apart() -> None:
    text = SETUP + (
        "```python\nprint(1)\n```\n"
        "```python\n# save as pkg/mod.py: a module\nX = 1\n```\n"
        "<!-- not run: needs two nodes -->\n\n```bash\ntorchrun ...\n```\n"
        "```\n$ some output\n```\n"
        "```text\na table\n```\n"
        '```json\n{"a": 1}\n```\n'
        "````sh\necho ```\n````\n"
    )
    blocks = R.parse_blocks(text)
    assert [b.line for b in blocks] == [3, 8, 11, 17, 20, 23, 26, 29]
    how = [b.how() for b in blocks]
    assert how[0].startswith("set-up commands") and blocks[0].setup
    assert how[1:] == ["run (python)", "saved as pkg/mod.py (a later block runs it)", "not run: needs two nodes",
                       "text (output or listing): not run", "text (output or listing): not run", "parsed as JSON",
                       "run (bash)"]
    assert blocks[-1].code == "echo ```\n"  # a longer fence holds a shorter one
    assert R.setup_commands(blocks) == ["pip install -e . && omnibal-compile demo",
                                        "pip install -e '.[test]' &&    python -m pytest tests"]


def test_unknown_language_and_unclosed_block_are_errors() -> None:
    with pytest.raises(ValueError, match="line 9: block language 'rust'"):
        R.parse_blocks(SETUP + "\n```rust\nfn main() {}\n```\n")
    with pytest.raises(ValueError, match="line 9: the block opened here is never closed"):
        R.parse_blocks(SETUP + "\n```python\nprint(1)\n")


def test_blocks_run_in_order_in_one_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = (
        "```python\n# save as helper.py\nVALUE = 41\n```\n"
        "```python\nimport sys; sys.path.insert(0, '.')\nimport helper\n"
        "open('out.txt', 'w').write(str(helper.VALUE + 1))\n```\n"
        '```bash\ntest "$(cat out.txt)" = 42\n```\n'
        '```json\n{"ok": true}\n```\n'
    )
    assert _check(tmp_path, body) == 0
    out = capsys.readouterr().out
    assert out.count(" pass ") == 4 and "0 failed" in out and "set-up" in out


@pytest.mark.parametrize("broken", [
    "```python\nraise ValueError('planted')\n```\n",
    "```bash\nfalse\necho after\n```\n",           # a failing command in the middle of a block
    "```bash\nfalse | cat\n```\n",                 # ... or inside a pipe
    '```json\n{"a": 1,}\n```\n',
])
def test_a_failing_block_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: str) -> None:
    body = "```python\nprint('fine')\n```\n" + broken + "```bash\necho still runs\n```\n"
    assert _check(tmp_path, body) == 1
    out = capsys.readouterr().out
    assert "1 failed (" in out and "README.md:11)" in out and out.count(" pass ") == 2
    if "planted" in broken:
        assert "ValueError: planted" in out  # the error tail is shown


def test_only_and_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = "```python\nimport time; time.sleep(30)\n```\n```python\nprint('second')\n```\n"
    assert _check(tmp_path, body, "--only", "13") == 0  # the second block only (line 13 is inside it)
    assert _check(tmp_path, body, "--timeout", "1", "--only", "8") == 1
    assert "timed out after 1 s" in capsys.readouterr().out
    assert _check(tmp_path, body, "--only", "99") == 2


def test_the_readme_opens_with_its_two_setup_commands() -> None:
    text = (R.ROOT / "README.md").read_text()
    blocks = R.parse_blocks(text)
    assert blocks[0].lang == "bash" and blocks[0].setup
    cmds = R.setup_commands(blocks)
    assert len(cmds) == 2 and cmds[0].endswith("omnibal-compile demo") and cmds[1].endswith("python -m pytest tests")
    assert len(blocks[0].code.strip().splitlines()) == 2  # exactly two lines, as CI reads them
    assert len(text.splitlines()) <= 300
    reasons = [b.not_run for b in blocks if b.not_run]
    assert len(reasons) <= 3, reasons  # exceptions stay few; each gives its reason in the README


def test_docs_pages_parse_and_exceptions_stay_few() -> None:
    files = R.default_files()
    assert files[0].name == "README.md" and any(f.parts[-2:] == ("guides", "planning.md") for f in files)
    reasons = []
    for f in files[1:]:
        blocks = R.parse_blocks(f.read_text(), setup=False)
        assert not any(b.setup for b in blocks), f  # only the README has a set-up block
        reasons += [(f.name, b.not_run) for b in blocks if b.not_run]
    assert len(reasons) <= 8, reasons  # each a block that cannot run here (installs, GPUs, hours, two nodes)


def test_several_files_each_in_its_own_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pages run one after another, each in a fresh scratch copy: a file one page writes is not seen by the next;
    a page's first block is an ordinary one (only README.md opens with set-up commands)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# a\n\n```bash\necho a > from_a.txt\n```\n")
    (docs / "b.md").write_text("# b\n\n```bash\ntest ! -e from_a.txt\n```\n\n```python\nraise SystemExit(3)\n```\n")
    assert R.main([str(docs)]) == 1
    out = capsys.readouterr().out
    assert out.count(" pass ") == 2 and "1 failed" in out and "b.md:7" in out
    assert R.main([str(docs / "a.md"), "--list"]) == 0
    assert "a.md:3      bash    run (bash)" in capsys.readouterr().out
    assert R.main([str(docs / "a.md"), str(docs / "b.md"), "--only", "3"]) == 2  # --only takes one file


def test_jobs_check_pages_at_the_same_time_each_report_whole(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--jobs 2: two pages run at once (each page's block waits for the other's to start, which one at a time
    never sees), each page's report printed together; --jobs 1 runs them one after another."""
    docs, marks = tmp_path / "docs", tmp_path / "marks"
    docs.mkdir()
    marks.mkdir()
    wait = "touch {m}/{me}\nfor i in $(seq 100); do test -e {m}/{other} && exit 0; sleep 0.1; done; exit 1\n"
    for me, other in (("a", "b"), ("b", "a")):
        (docs / f"{me}.md").write_text(f"# {me}\n\n```bash\n{wait.format(m=marks, me=me, other=other)}```\n")
    assert R.main([str(docs), "--jobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for page in ("a.md", "b.md"):
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"examples of {docs / page}"))
        assert " pass " in lines[at + 1]  # its block's line right under its page, not another page's
    assert "2 blocks checked" in lines[-1] and "0 failed" in lines[-1]
    for f in marks.iterdir():
        f.unlink()
    assert R.main([str(docs), "--jobs", "1"]) == 1  # one at a time: a waits for b in vain
    assert R.main([str(docs), "--jobs", "2", "--workdir", str(tmp_path)]) == 2  # pages would share one folder


@pytest.mark.slow
def test_the_ci_step_fails_when_an_example_fails(tmp_path: Path) -> None:
    """.ci/readme_clone on a small repository (cheap set-up commands) whose README has one broken example:
    it clones, makes a venv, runs both set-up commands and the examples, and exits 1 naming the phase."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / ".ci").mkdir()
    shutil.copy(R.ROOT / "tests" / "readme_check.py", repo / "tests")
    shutil.copy(R.ROOT / ".ci" / "readme_clone", repo / ".ci")
    readme = "# t\n\n```bash\necho one > one.txt\ntest -f one.txt\n```\n\n```python\nprint('ok')\n```\n\n"
    (repo / "README.md").write_text(readme + "```python\nraise SystemExit('planted failure')\n```\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "t"], check=True)
    proc = subprocess.run(["bash", str(repo / ".ci" / "readme_clone")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "=== README set-up command 1: passed" in proc.stdout and "=== README set-up command 2: passed" in proc.stdout
    assert "planted failure" in proc.stdout and "failed: README and docs examples" in proc.stdout
