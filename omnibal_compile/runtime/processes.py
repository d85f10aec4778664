"""Local rank processes on torch's elastic agent, and what the agent does not do: a time limit, a frozen rank,
leftovers.

The ranks are started by :func:`torch.distributed.launcher.api.elastic_launch` (``LocalElasticAgent``,
the engine ``torchrun`` runs), in an agent process of their own (``python -m
omnibal_compile.runtime.processes SPEC.json``): c10d rendezvous on loopback, the ranks' environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), each rank in its own session, its output and error file
(``TORCHELASTIC_ERROR_FILE``, written by ``@record``) under the run's folder, and on the first failure
every running rank's process group ended (SIGTERM, then SIGKILL after the grace period).

Torch-free at import, so the worker can set its side up before importing torch. Kept here, because
the agent does not do it:

    time limit    the agent has no whole-run limit: at ``timeout_s`` the launcher asks every running rank
                  for its Python stack (:data:`STACK_SIGNAL`, faulthandler in the worker: the report says
                  where each rank was), then SIGTERMs the agent, which ends its ranks.
    frozen rank   the agent does not see a stopped process (``/proc`` state ``T``: SIGSTOP, a debugger, job
                  control): the launcher watches the ranks' states, so the report names the stopped rank
                  (its peers fail in their next collective after its timeout, or the run hits its limit).
    leftovers     the agent signals a rank's process group only while the rank runs: what a finished or
                  failed rank started would outlive the run. After the agent, every process carrying the
                  run's ``TORCHELASTIC_RUN_ID`` is killed, on success too.
    launcher death  the agent process gets ``PR_SET_PDEATHSIG`` = SIGTERM (it then ends its ranks) and each
                  rank SIGKILL (:func:`die_with_parent`, in case the agent itself is killed), on Linux.
    the report    the agent's ``ChildFailedError`` picks its root cause by a time stamp in whole seconds and
                  counts the ranks it ended itself as failures; :class:`LaunchError` names the rank at
                  fault and its first error line: from its error file, else the first traceback in its
                  output, else how it ended (exit code, signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omnibal_compile._utils.tables import format_table
from omnibal_compile.errors import LaunchError

__all__ = ["GRACE_S", "STACK_SIGNAL", "die_with_parent", "first_error_line", "python_module", "run_ranks"]

GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL when the ranks are ended (the agent's ``shutdown_timeout``)."""
STACK_SIGNAL = signal.SIGUSR1
"""Signal on which a rank prints its Python stack (``faulthandler.register`` in the worker)."""
AGENT_PID_ENV = "OMNIBAL_AGENT_PID"
"""The agent process's pid, which its ranks check in :func:`die_with_parent`."""
_ROLE = "rank"
"""The agent's worker role."""
_TAIL = 15
"""Output lines of the failing rank shown in the report."""
_POLL_S = 0.05
AGENT_START_S = 120.0
"""Seconds the agent may take to start the ranks (importing torch, the rendezvous) beyond the time limit."""


def python_module(module: str, *args: str) -> list[str]:
    """The command ``python -m module args`` with Python's ``-P`` (3.11+): plain ``-m`` puts the current
    folder first on ``sys.path``, where any file (a stray ``torch.py``) would shadow an installed package."""
    return [sys.executable, *(("-P",) if sys.version_info >= (3, 11) else ()), "-m", module, *args]


# -- the rank's side -------------------------------------------------------------------------------


FINISHED_FILE = "finished"
"""Written by a rank beside its error file when it ends normally (:func:`mark_finished`)."""


def end_process_group() -> None:
    """End a rank's process group after it succeeded (after a failure this may wait on the others): the
    garbage freed first (DDP/FSDP state and gloo work holding tensors), every rank past its last collective,
    then the groups destroyed. A gloo thread still joinable at the interpreter's teardown aborted finished
    ranks ("terminate called without an active exception", SIGABRT), so callers then leave with
    :func:`exit_now`."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Leave the process at once, its output flushed, without the interpreter's teardown (see
    :func:`end_process_group`; after a failure the teardown can also wait on the other ranks)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def mark_finished() -> None:
    """Say that this rank ended normally (a file beside ``$TORCHELASTIC_ERROR_FILE``; nothing without one)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            (Path(error_file).parent / FINISHED_FILE).touch()


def die_with_parent() -> None:
    """Make this rank die (SIGKILL) when the process that started it dies (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.environ.get(AGENT_PID_ENV)
    if parent and os.getppid() != int(parent):  # the agent died before the line above
        os._exit(1)


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


def _error_file_line(path: Path | None) -> str | None:
    """The first line of the error ``@record`` wrote (``{"message": {"message": "Type: text", ...}}``)."""
    if path is None:
        return None
    try:
        message = json.loads(path.read_text())["message"]
        text = str(message["message"] if isinstance(message, dict) else message)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    kind, _, rest = text.partition(": ")
    first = next((x.strip() for x in rest.splitlines() if x.strip()), "")
    return f"{kind}: {first}" if first else kind.strip() or None


def _proc_state(pid: int) -> str | None:
    """``/proc`` state letter of ``pid`` (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z``...), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


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


# -- the agent process -----------------------------------------------------------------------------


def _agent_main(spec_path: str) -> int:
    """Run the ranks ``SPEC.json`` describes under torch's elastic agent; write what came of it to its ``result``."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # inherited by the ranks
    result: dict[str, object] = {}
    try:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=spec["nproc"], run_id=spec["run_id"], role=_ROLE,
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
            monitor_interval=0.1, start_method="spawn", shutdown_timeout=spec["grace_s"],
            logs_specs=DefaultLogsSpecs(log_dir=spec["log_dir"], redirects=Std.ALL),
        )
        try:
            elastic_launch(config, spec["argv"][0])(*spec["argv"][1:])
            result["outcome"] = "ok"
        except ChildFailedError as e:
            result["outcome"] = "failed"
            result["failures"] = {str(r): {"exitcode": f.exitcode, "pid": f.pid} for r, f in e.failures.items()}
        except SignalException as e:
            result["outcome"] = f"ended by {e.sigval.name}"
    except Exception as e:  # the agent could not run: say why
        import traceback

        result["outcome"] = "agent failed"
        result["error"] = "".join(traceback.format_exception(e))
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# -- the launcher's side ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Rank:
    rank: int
    pid: int
    log_dir: Path | None = None
    """Where the agent writes its ``stdout.log``, ``stderr.log`` and ``error.json``."""
    state: str | None = None
    """Its last ``/proc`` state seen while it ran."""
    stopped_at: float | None = None
    """When it was last seen stopped (``T``/``t``): a killed process shows ``R`` or ``D`` while it exits."""
    ended_at: float | None = None
    exitcode: int | None = None
    state_at_end: str | None = None
    """Its state when the launcher (or the agent, for a stopped rank) ended it; None: it ended by itself."""
    early_exit: bool = False
    """It exited with code 0 without writing :data:`FINISHED_FILE`: it left the run before its end."""
    lines: list[str] = field(default_factory=list)
    seen: int = 0
    """Bytes of its stdout already passed on (:meth:`pass_on`)."""

    def pass_on(self, on_line: Callable[[int, str], None] | None, *, final: bool = False) -> None:
        """Call ``on_line(rank, line)`` for each new complete line of its stdout (with ``final``, the rest too)."""
        if on_line is None or self.log_dir is None:
            return
        try:
            with open(self.log_dir / "stdout.log", "rb") as f:
                f.seek(self.seen)
                data = f.read()
        except OSError:
            return
        end = len(data) if final else data.rfind(b"\n") + 1
        self.seen += end
        for line in data[:end].decode(errors="replace").splitlines(keepends=True):
            on_line(self.rank, line)

    @property
    def error_file(self) -> Path | None:
        return self.log_dir / "error.json" if self.log_dir is not None else None

    def has_error_file(self) -> bool:
        return self.error_file is not None and self.error_file.exists()

    @property
    def failed_at(self) -> float | None:
        """When its failure was seen: its error file written, or its death when it ended with an error."""
        if self.has_error_file():
            assert self.error_file is not None
            with contextlib.suppress(OSError):
                return self.error_file.stat().st_mtime - time.time() + time.monotonic()
        if self.state_at_end is None and (self.exitcode or self.early_exit):
            return self.ended_at if self.ended_at is not None else time.monotonic()
        return None

    def read_output(self) -> None:
        self.lines = []
        for name in ("stdout.log", "stderr.log"):
            with contextlib.suppress(OSError):
                if self.log_dir is not None:
                    self.lines += (self.log_dir / name).read_text(errors="replace").splitlines(keepends=True)

    def died_of_signal(self) -> bool:
        code = self.exitcode
        return self.state_at_end is None and code is not None and code < 0 and not self.has_error_file()

    def first_error(self) -> str | None:
        line = _error_file_line(self.error_file) or first_error_line(self.lines)
        return _SOURCE_LOCATION.sub("", line) if line else None

    def how_it_ended(self) -> str:
        if self.state_at_end is not None:
            now = "stopped" if self.state_at_end in "Tt" else "failed" if self.failed_at is not None else "running"
            return f"{now}; ended by the launcher"
        code = self.exitcode
        if code is None:
            return "unknown"
        if code < 0:
            return f"killed by {_signal_name(-code)}"
        if code == 0:
            return "exit 0 before the end" if self.early_exit else "finished"
        return f"exit {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _pdeathsig(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that sends the child ``sig`` when the launcher dies (Linux), resolved before any fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, sig)  # PR_SET_PDEATHSIG
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
    finish_marker: bool = False,
) -> None:
    """Run ``argv`` as ranks 0..nproc-1 under torch's elastic agent; every rank process ends before this returns.

    The agent and its ranks get ``env``; the ranks also get torchrun's variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_ERROR_FILE``...). Their output goes to
    files in ``workdir``; each line a rank prints on stdout is also passed to ``on_line(rank, line)``.
    Raises :class:`LaunchError` when a rank fails (the agent then ends the others at once) or the run
    exceeds ``timeout_s``: the message names the rank at fault and its first error line. With
    ``finish_marker`` the ranks write :data:`FINISHED_FILE` at their normal end (:func:`mark_finished`), so
    a rank that exited with code 0 before it is named as having left early.
    """
    workdir = Path(workdir)
    run_id = uuid.uuid4().hex
    result_path = workdir / "agent-result.json"
    spec = {"argv": list(argv), "nproc": nproc, "run_id": run_id, "grace_s": max(1, round(grace_s)),
            "log_dir": str(workdir / "logs"), "result": str(result_path)}
    (workdir / "agent.json").write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    ranks: dict[int, _Rank] = {}
    outcome = "interrupted"
    agent: subprocess.Popen[bytes] | None = None
    with open(workdir / "agent.log", "wb") as agent_log:
        try:
            agent = subprocess.Popen(
                python_module("omnibal_compile.runtime.processes", str(workdir / "agent.json")),
                env=dict(env), stdin=subprocess.DEVNULL, stdout=agent_log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_pdeathsig(signal.SIGTERM),
            )
            outcome = _watch(agent, ranks, nproc, timeout_s, on_line)
            if outcome == "timeout":
                for rk in ranks.values():
                    if rk.ended_at is None:
                        rk.state_at_end = _proc_state(rk.pid) or "?"
                _dump_stacks(list(ranks.values()))
        finally:
            if agent is not None:
                _end_agent(agent, grace_s)
                _end_leftovers(run_id, ranks)
    if outcome == "interrupted":
        return  # an exception is on its way
    result: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        result = json.loads(result_path.read_text())
    if outcome != "timeout":
        outcome = str(result.get("outcome", "agent failed"))
    if outcome == "ok":
        return
    if outcome == "agent failed":
        tail = (workdir / "agent.log").read_text(errors="replace").strip().splitlines()[-_TAIL:]
        detail = str(result.get("error", "")).strip() or "\n".join(tail)
        raise LaunchError(f"the elastic agent that starts the ranks failed (exit {agent.returncode if agent else '?'}):"
                          f"\n{detail}")
    failures = result.get("failures", {})
    assert isinstance(failures, dict)
    for r in range(nproc):
        if r not in ranks:  # ended before it was seen
            pid = int(failures.get(str(r), {}).get("pid", 0))
            ranks[r] = _Rank(rank=r, pid=pid, ended_at=time.monotonic())
        rk = ranks[r]
        found = sorted((workdir / "logs").glob(f"{run_id}_*/attempt_0/{r}"))
        rk.log_dir = found[0] if found else None
        rk.pass_on(on_line, final=True)
        if str(r) in failures:
            rk.exitcode = int(failures[str(r)]["exitcode"])
        elif outcome == "failed":
            rk.exitcode = 0  # not among the failures: it finished, or left early (os._exit(0) in a model's code)
            rk.early_exit = finish_marker and rk.log_dir is not None and not (rk.log_dir / FINISHED_FILE).exists()
        rk.read_output()
    if outcome == "failed":
        for rk in ranks.values():
            _mark_ended_by_agent(rk, list(ranks.values()))
    how = "timeout" if outcome == "timeout" else "failed"
    raise LaunchError(_report(list(ranks.values()), how, timeout_s, grace_s))


def _mark_ended_by_agent(rk: _Rank, ranks: list[_Rank]) -> None:
    """Mark ``rk`` as ended by the agent (which counts those as failures too): it was last seen stopped, or
    it was killed by SIGTERM without an error of its own while another rank failed otherwise."""
    if rk.state_at_end is not None or rk.has_error_file() or rk.exitcode is None or rk.exitcode >= 0:
        return
    others = [o for o in ranks if o is not rk]
    if rk.state in ("T", "t"):
        rk.state_at_end = rk.state
    elif rk.stopped_at is not None and any(
        (failed := o.failed_at) is not None and failed <= rk.stopped_at for o in others
    ):  # still stopped when another rank failed: the agent's SIGTERM waited, its SIGKILL ended it
        rk.state_at_end = "T"
    elif rk.exitcode == -signal.SIGTERM and any(
        o.exitcode and (o.has_error_file() or o.exitcode != -signal.SIGTERM) for o in others
    ):
        rk.state_at_end = rk.state or "S"


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _watch(agent: subprocess.Popen[bytes], ranks: dict[int, _Rank], nproc: int, timeout_s: float | None,
           on_line: Callable[[int, str], None] | None) -> str:
    """Wait for the agent to end (``done``) or the time limit (``timeout``), watching its ranks meanwhile.

    The limit counts from the first rank's start (the agent's own start-up is the launcher's, like the
    pre-launch checks), and from the agent's start plus :data:`AGENT_START_S` while no rank has started.
    """
    start = time.monotonic()
    deadline = start + timeout_s + AGENT_START_S if timeout_s is not None else None
    while True:
        now = time.monotonic()
        if not ranks and timeout_s is not None and _children(agent.pid):
            deadline = now + timeout_s
        if len(ranks) < nproc:
            known = {rk.pid for rk in ranks.values()}
            for pid in _children(agent.pid):
                if pid not in known and "RANK" in (environ := _environ(pid)):
                    error_file = environ.get("TORCHELASTIC_ERROR_FILE")
                    rank = int(environ["RANK"])
                    ranks[rank] = _Rank(rank=rank, pid=pid, log_dir=Path(error_file).parent if error_file else None)
        for rk in ranks.values():
            rk.pass_on(on_line)
            if rk.ended_at is None:
                state = _proc_state(rk.pid)
                if state in (None, "Z", "X"):
                    rk.ended_at = now
                else:
                    rk.state = state
                    if state in ("T", "t"):
                        rk.stopped_at = now
        if agent.poll() is not None:
            return "done"
        if deadline is not None and now >= deadline:
            return "timeout"
        time.sleep(_POLL_S)


def _dump_stacks(ranks: list[_Rank], wait_s: float = 2.0) -> None:
    """Ask every running rank for its Python stack (:data:`STACK_SIGNAL`) and give them a moment to print it."""
    asked = []
    for rk in ranks:
        running = rk.ended_at is None and _proc_state(rk.pid) not in (None, "T", "t", "Z")
        if running and _catches(rk.pid, STACK_SIGNAL):  # not before the worker set its handler up
            with contextlib.suppress(ProcessLookupError):
                rk.read_output()
                os.kill(rk.pid, STACK_SIGNAL)
                asked.append((rk, len(rk.lines)))
    end = time.monotonic() + wait_s
    while asked and time.monotonic() < end:
        time.sleep(0.05)
        for rk, _ in asked:
            rk.read_output()
        if all(any(_frame(x) for x in rk.lines[n:]) for rk, n in asked):
            time.sleep(0.2)  # the rest of the dump
            break


def _end_agent(agent: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the agent if it still runs (it then ends its ranks, SIGKILL after ``grace_s``), SIGKILL it if it
    hangs."""
    if agent.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=grace_s + 10)
        except subprocess.TimeoutExpired:
            agent.kill()  # its ranks die with it (die_with_parent)
            agent.wait()


def _end_leftovers(run_id: str, ranks: dict[int, _Rank], wait_s: float = 5.0) -> None:
    """SIGKILL what the ranks left: their process groups and every process carrying the run's id; return
    once they are gone (a killed process lingers a moment before the kernel removes it)."""
    for rk in ranks.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rk.pid, signal.SIGKILL)  # each rank leads its own group (the agent's start_new_session)
    needle = f"TORCHELASTIC_RUN_ID={run_id}\0".encode()
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        with contextlib.suppress(OSError):
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) != os.getpid():
                    with contextlib.suppress(OSError):
                        if needle in (entry / "environ").read_bytes() and _proc_state(int(entry.name)) != "Z":
                            left.append(int(entry.name))
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(_POLL_S)


# -- the report ------------------------------------------------------------------------------------


def _report(ranks: list[_Rank], outcome: str, timeout_s: float | None, grace_s: float) -> str:
    ranks = sorted(ranks, key=lambda rk: rk.rank)
    stopped = [rk for rk in ranks if rk.state_at_end in ("T", "t")]
    # A rank that died of a signal without an error of its own (killed, out of memory, a crash) or left early
    # (exit 0 mid-run) is the cause: its peers fail next with closed connections, often within the same poll,
    # so their error files can predate the poll that saw it end. Otherwise the first to fail.
    failed = sorted((rk for rk in ranks if rk.failed_at is not None and rk.state_at_end is None),
                    key=lambda rk: (not (rk.died_of_signal() or rk.early_exit), rk.failed_at, rk.rank))
    causes = [f"rank {rk.rank} stopped responding (its process is stopped: SIGSTOP, a debugger or job control)"
              for rk in stopped]
    first = failed[0] if failed else None
    if first is not None:
        error, code = first.first_error(), first.exitcode
        then = " then" if stopped else ""
        if error:
            causes.append(f"rank {first.rank}{then} failed with {error}")
        elif first.early_exit:
            causes.append(f"rank {first.rank}{then} left the run early: it exited with code 0 before the end of "
                          "training (os._exit or sys.exit in the model's or the data's code?)")
        elif first.died_of_signal():
            hint = " (the out-of-memory killer or `kill -9`)" if code == -signal.SIGKILL else ""
            causes.append(f"rank {first.rank}{then} was {first.how_it_ended()}{hint}")
        else:
            causes.append(f"rank {first.rank}{then} ended with {first.how_it_ended()} and printed no error")
    if outcome != "timeout":  # ranks still running when another failed: where they were (their SIGTERM stack dump)
        for rk in ranks:
            where = _where(rk.lines) if rk.state_at_end is not None and rk.state_at_end not in "Tt" else None
            if where and rk.failed_at is None:
                causes.append(f"rank {rk.rank} was still running, {where}")
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
        shown = detail[:117] + "..." if len(detail) > 120 else detail
        rows.append([str(rk.rank), str(rk.pid), rk.how_it_ended(), shown])
    lines += ["", format_table(rows, "rrll"), "",
              f"Every rank was ended (SIGTERM, then SIGKILL after {grace_s:g} s), with anything it started."]
    if first is not None and first.lines:
        tail = [x.rstrip("\n") for x in first.lines[-_TAIL:]]
        lines += [f"Last lines of rank {first.rank}'s output:", *(f"  {x}" for x in tail)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_agent_main(sys.argv[1]))
