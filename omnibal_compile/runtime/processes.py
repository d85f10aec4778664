"""Local rank processes: start them, watch them, always end all of them, and say what went wrong.

Torch-free, so the worker can set its side up before importing torch.

Glossary:
    rank process  one process per rank, started in its own session (so its process group holds it
                  and everything it starts) and, on Linux, with ``PR_SET_PDEATHSIG`` = SIGKILL, so
                  it dies with the launcher even when the launcher itself is killed.
    ending        every rank's process group gets SIGTERM and then SIGCONT (a stopped process acts
                  on signals only once continued), then SIGKILL after :data:`GRACE_S`; on success
                  too, so nothing a rank started outlives the launcher.
    first error   a rank's first error line: from its error file (``OMNIBAL_ERROR_FILE``, written by
                  :func:`write_error_file` when the worker ends on an exception), else the exception
                  line of the first traceback in its output, else how it ended (exit code, signal).
    frozen rank   a rank whose process is stopped (``/proc`` state ``T``: SIGSTOP, a debugger, job
                  control). The others fail in their next collective after its timeout, or the run
                  hits its time limit; either way the report names the stopped rank.
    stack dump    on a time-out each running rank gets SIGUSR1, on which the worker's faulthandler
                  prints its Python stack: the report says where each rank was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omnibal_compile._utils.tables import format_table
from omnibal_compile.errors import LaunchError

__all__ = [
    "ERROR_FILE_ENV",
    "GRACE_S",
    "STACK_SIGNAL",
    "first_error_line",
    "run_ranks",
    "write_error_file",
]

ERROR_FILE_ENV = "OMNIBAL_ERROR_FILE"
"""Environment variable naming the file a rank writes its error to (set per rank by the launcher)."""
GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL when the ranks are ended."""
STACK_SIGNAL = signal.SIGUSR1
"""Signal on which a rank prints its Python stack (``faulthandler.register`` in the worker)."""
SETTLE_S = 1.0
"""Seconds the launcher keeps watching after the first failure before it ends the ranks: a rank that
dies takes a moment to be seen dead, while its peers see their connections close at once."""
_TAIL = 15
"""Output lines of the failing rank shown in the report."""


# -- the rank's side -------------------------------------------------------------------------------


def write_error_file(exc: BaseException) -> None:
    """Record ``exc`` as this rank's first error in ``$OMNIBAL_ERROR_FILE`` (no-op when unset)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or Path(path).exists():  # the first error only
        return
    import traceback

    first = str(exc).strip().splitlines()
    data = {"error": f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__,
            "traceback": "".join(traceback.format_exception(exc))}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(data))


# -- reading what a rank left ----------------------------------------------------------------------

_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ")
"""The C++ source location gloo and c10d put in their messages: noise to the reader."""
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
"""What torch.distributed puts before each line of a rank's uncaught exception."""


def first_error_line(lines: Sequence[str]) -> str | None:
    """The exception line of the first Python traceback in ``lines`` (a rank's output), if any."""
    in_traceback = False
    for raw in lines:
        line = _RANK_PREFIX.sub("", raw.rstrip("\n"))
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line.strip() and not line[0].isspace():
            return line.strip()  # the first unindented line after the frames
    return None


def _proc_state(pid: int) -> str | None:
    """``/proc`` state letter of ``pid`` (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z``...), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (``SigCgt`` in ``/proc``): else the signal would kill it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (sig - 1) & 1)


def _frame(line: str) -> tuple[str, str, str] | None:
    m = re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def _where(dump: Sequence[str]) -> str | None:
    """Where a faulthandler stack dump says the main thread was: innermost frame, and ours if deeper."""
    blocks: list[list[tuple[str, str, str]]] = []
    for line in dump:
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif blocks and (f := _frame(line)):
            blocks[-1].append(f)
    main = next((b for b in blocks if any(f[0].endswith("runtime/worker.py") for f in b)), blocks[0] if blocks else [])
    if not main:
        return None
    short = lambda f: f"{f[2]} ({_short_path(f[0])}:{f[1]})"  # noqa: E731
    ours = next((f for f in main if "omnibal_compile" in f[0]), None)
    text = f"waiting in {short(main[0])}"
    return text + (f", called from {short(ours)}" if ours and ours != main[0] else "")


def _short_path(path: str) -> str:
    for root in ("omnibal_compile/", "torch/"):
        if root in path:
            return root + path.split(root, 1)[1]
    return path


# -- the launcher's side ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Rank:
    rank: int
    proc: subprocess.Popen[str]
    error_file: Path
    lines: list[str] = field(default_factory=list)
    ended_at: float | None = None
    failed_at: float | None = None
    """When its failure was seen: its error file appeared or it exited with an error."""
    state_at_end: str | None = None
    """``/proc`` state when the launcher ended it (None: it ended by itself)."""
    reader: threading.Thread | None = None

    def update(self, now: float) -> None:
        if self.ended_at is None and self.proc.poll() is not None:
            self.ended_at = now
        if self.failed_at is None and (self.error_file.exists() or (self.ended_at is not None and self.proc.returncode)):
            self.failed_at = now

    def died_of_signal(self) -> bool:
        code = self.proc.returncode
        return self.state_at_end is None and code is not None and code < 0 and not self.error_file.exists()

    def first_error(self) -> str | None:
        line = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            line = str(json.loads(self.error_file.read_text())["error"])
        line = line or first_error_line(self.lines)
        return _SOURCE_LOCATION.sub("", line) if line else None

    def how_it_ended(self) -> str:
        if self.state_at_end is not None:
            now = "stopped" if self.state_at_end in "Tt" else "failed" if self.failed_at is not None else "running"
            return f"{now}; ended by the launcher"
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {_signal_name(-code)}"
        return "finished" if code == 0 else f"exit {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _pdeathsig() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with the launcher (Linux), resolved before any fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before the line above
            os._exit(1)

    return preexec


def run_ranks(
    argv: Sequence[str],
    *,
    nproc: int,
    env: Mapping[str, str],
    workdir: str | os.PathLike[str],
    timeout_s: float | None = None,
    on_line: Callable[[int, str], None] | None = None,
    grace_s: float = GRACE_S,
) -> None:
    """Run ``argv`` as ranks 0..nproc-1 and wait for all of them; every rank process ends before this returns.

    Each rank gets ``env`` plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    ``OMNIBAL_ERROR_FILE`` (in ``workdir``); its stdout and stderr are read line by line (``on_line(rank,
    line)``). Raises :class:`LaunchError` when a rank fails (the others are then ended at once) or the
    run exceeds ``timeout_s``: the message names the rank at fault and its first error line.
    """
    workdir = Path(workdir)
    ranks: list[_Rank] = []
    start = time.monotonic()
    deadline = start + timeout_s if timeout_s is not None else None
    outcome = "interrupted"
    try:
        preexec = _pdeathsig()
        for r in range(nproc):
            error_file = workdir / f"error-rank{r}.json"
            error_file.unlink(missing_ok=True)
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), ERROR_FILE_ENV: str(error_file)}
            proc = subprocess.Popen(
                list(argv), env=rank_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, errors="replace", start_new_session=True, preexec_fn=preexec,
            )
            ranks.append(_Rank(rank=r, proc=proc, error_file=error_file))
        for rk in ranks:
            rk.reader = threading.Thread(target=_pump, args=(rk, on_line), daemon=True)
            rk.reader.start()
        outcome = _watch(ranks, deadline)
        if outcome == "timeout":
            _dump_stacks(ranks)
    finally:
        _end_all(ranks, grace_s)
        for rk in ranks:
            if rk.reader is not None:
                rk.reader.join(timeout=5)
    if outcome != "ok":
        raise LaunchError(_report(ranks, outcome, timeout_s, grace_s))


def _pump(rank: _Rank, on_line: Callable[[int, str], None] | None) -> None:
    assert rank.proc.stdout is not None
    for line in rank.proc.stdout:
        rank.lines.append(line)
        if on_line is not None:
            on_line(rank.rank, line)


def _watch(ranks: list[_Rank], deadline: float | None) -> str:
    """Wait until every rank finished (``ok``), one failed (``failed``) or the deadline passed (``timeout``)."""
    settled: float | None = None
    while True:
        now = time.monotonic()
        for rk in ranks:
            rk.update(now)
        if settled is None and any(rk.failed_at is not None for rk in ranks):
            settled = now + SETTLE_S
        if settled is not None and (now >= settled or all(rk.ended_at is not None for rk in ranks)):
            return "failed"
        if settled is None and all(rk.ended_at is not None for rk in ranks):
            return "ok"
        if settled is None and deadline is not None and now >= deadline:
            return "timeout"
        time.sleep(0.05)


def _dump_stacks(ranks: list[_Rank], wait_s: float = 2.0) -> None:
    """Ask every running rank for its Python stack (:data:`STACK_SIGNAL`) and give them a moment to print it."""
    asked = []
    for rk in ranks:
        running = rk.proc.poll() is None and _proc_state(rk.proc.pid) not in ("T", "t")
        if running and _catches(rk.proc.pid, STACK_SIGNAL):  # not before the worker set its handler up
            with contextlib.suppress(ProcessLookupError):
                rk.proc.send_signal(STACK_SIGNAL)
                asked.append((rk, len(rk.lines)))
    end = time.monotonic() + wait_s
    while asked and time.monotonic() < end:
        if all(any(_frame(x) for x in rk.lines[n:]) for rk, n in asked):
            time.sleep(0.2)  # the rest of the dump
            break
        time.sleep(0.05)


def _end_all(ranks: list[_Rank], grace_s: float) -> None:
    """End every rank's process group: SIGTERM and SIGCONT, then SIGKILL after ``grace_s``; reap them."""
    for rk in ranks:
        if rk.proc.poll() is None:
            rk.state_at_end = _proc_state(rk.proc.pid) or "?"
    groups = [rk.proc.pid for rk in ranks]  # each rank leads its own group (start_new_session)
    for sig in (signal.SIGTERM, signal.SIGCONT):  # in this order: a stopped rank wakes up to its SIGTERM
        for g in groups:
            _signal_group(g, sig)
    end = time.monotonic() + grace_s
    for rk in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rk.proc.wait(timeout=max(0.0, end - time.monotonic()))
    for g in groups:
        _signal_group(g, signal.SIGKILL)  # also whatever a rank started, even after the rank itself ended
    for rk in ranks:
        rk.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# -- the report ------------------------------------------------------------------------------------


def _report(ranks: list[_Rank], outcome: str, timeout_s: float | None, grace_s: float) -> str:
    stopped = [rk for rk in ranks if rk.state_at_end in ("T", "t")]
    # A rank that died of a signal without an error of its own (killed, out of memory, a crash) is
    # the cause; its peers fail next with closed connections. Otherwise the first to fail.
    failed = sorted((rk for rk in ranks if rk.failed_at is not None),
                    key=lambda rk: (not rk.died_of_signal(), rk.failed_at, rk.rank))
    causes = [f"rank {rk.rank} stopped responding (its process is stopped: SIGSTOP, a debugger or job control)"
              for rk in stopped]
    first = failed[0] if failed else None
    if first is not None:
        error, code = first.first_error(), first.proc.returncode
        then = " then" if stopped else ""
        if error:
            causes.append(f"rank {first.rank}{then} failed with {error}")
        elif first.died_of_signal():
            hint = " (the out-of-memory killer or `kill -9`)" if code == -signal.SIGKILL else ""
            causes.append(f"rank {first.rank}{then} was {first.how_it_ended()}{hint}")
        else:
            causes.append(f"rank {first.rank}{then} ended with {first.how_it_ended()} and printed no error")
    if outcome == "timeout":
        running = [str(rk.rank) for rk in ranks if rk.state_at_end is not None and rk.state_at_end not in "Tt"]
        if running and not failed:
            causes.append(f"rank{'s' if len(running) > 1 else ''} {', '.join(running)} still running (where: below)")
        head = f"the run exceeded its time limit ({timeout_s:g} s, --timeout)"
    else:
        head = "the run failed"
    lines = [f"{head}: {'; '.join(causes)}." if causes else f"{head}."]
    rows = [["rank", "pid", "how it ended", "first error / where it was"]]
    for rk in ranks:
        detail = rk.first_error() if rk.failed_at is not None else None
        if detail is None and rk.state_at_end is not None and rk.state_at_end not in "Tt":
            detail = _where(rk.lines)
        detail = detail or "-"
        rows.append([str(rk.rank), str(rk.proc.pid), rk.how_it_ended(), detail[:117] + "..." if len(detail) > 120 else detail])
    lines += ["", format_table(rows, "rrll"), "",
              f"Every rank was ended (SIGTERM, then SIGKILL after {grace_s:g} s), with anything it started."]
    if first is not None and first.lines:
        tail = [x.rstrip("\n") for x in first.lines[-_TAIL:]]
        lines += [f"Last lines of rank {first.rank}'s output:", *(f"  {x}" for x in tail)]
    return "\n".join(lines)

