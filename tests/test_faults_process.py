"""Process faults: a frozen, killed, failing or slow rank ends the whole run with a message naming it.

Every test tags the processes it causes with an environment variable and checks afterwards that
none of them, ranks or what the ranks started, is still alive. The first tests run the process
machinery (torch's elastic agent and what is kept around it) on tiny Python ranks (no torch in the
ranks: fast); the last ones run the real launcher on a 2-stage TinyVLM plan with gloo, a fault planted
in rank 1 by the test worker ``tests/fault_worker.py`` (``_OMNIBAL_TEST_FAULT``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import SMALL_VLM

from omnibal_compile.errors import InputError, LaunchError
from omnibal_compile.runtime.processes import first_error_line, run_ranks

REPO = Path(__file__).resolve().parents[1]

# A stand-in rank: starts a child that would sleep 10 minutes (as a data loader worker would), then
# does what argv[1] says in rank 1 while rank 0 waits for it.
_RANK = textwrap.dedent("""
    import faulthandler, os, signal, subprocess, sys, time
    from omnibal_compile.runtime.processes import STACK_SIGNAL, die_with_parent
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    die_with_parent()
    rank, mode = int(os.environ["RANK"]), sys.argv[1]
    if mode != "alone":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"rank {rank} started", flush=True)

    def wait_for_peers():
        time.sleep(600)

    if mode == "finish":
        sys.exit(0)
    if rank == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "raise":  # an error written to the error file by torch's @record, as the worker does
            from torch.distributed.elastic.multiprocessing.errors import record

            @record
            def fail():
                raise ValueError("bad value in rank 1")

            fail()
        if mode == "traceback":  # an error only in the output (no error file)
            raise KeyError("missing key")
    wait_for_peers()
""")


def _tagged_env(tag: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "_FAULT_TEST_TAG": tag}


def _survivors(tag: str) -> list[int]:
    """Processes (other than this one) whose environment carries ``tag``: the ranks and all they started."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"_FAULT_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile, or not ours
    return found


def _run(tmp_path: Path, mode: str, **kw) -> tuple[str | None, str]:
    """Run two stand-in ranks; returns (the LaunchError's message or None, the tag)."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    tag = uuid.uuid4().hex
    try:
        run_ranks(
            [sys.executable, str(script), mode], nproc=2, env=_tagged_env(tag), workdir=tmp_path, grace_s=1.0, **kw
        )
    except LaunchError as e:
        return str(e), tag
    return None, tag


# -- the process machinery, on stand-in ranks ------------------------------------------------------


def test_a_finished_run_leaves_nothing_behind(tmp_path):
    message, tag = _run(tmp_path, "finish")
    assert message is None
    assert _survivors(tag) == []  # the children the ranks started are ended too


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    message, tag = _run(tmp_path, "kill", timeout_s=60)
    assert message is not None and message.startswith("the run failed: rank 1 was killed by SIGKILL"), message
    assert "rank 1 started" in message  # the end of its output
    assert _survivors(tag) == []


def test_a_failing_rank_is_named_with_its_first_error_line(tmp_path):
    message, tag = _run(tmp_path, "raise", timeout_s=60)
    assert message is not None and "rank 1 failed with ValueError: bad value in rank 1" in message, message
    assert _survivors(tag) == []
    message, tag = _run(tmp_path, "traceback", timeout_s=60)  # from the output when there is no error file
    assert message is not None and "rank 1 failed with KeyError: 'missing key'" in message, message
    assert _survivors(tag) == []


def test_a_frozen_rank_is_named_when_the_time_limit_ends_the_run(tmp_path):
    message, tag = _run(tmp_path, "stop", timeout_s=4)
    assert message is not None and message.startswith("the run exceeded its time limit (4 s, --timeout)"), message
    assert "rank 1 stopped responding (its process is stopped" in message
    assert "waiting in wait_for_peers" in message  # where rank 0 was, from its stack dump
    assert _survivors(tag) == []  # the stopped rank and its child too


def test_the_time_limit_says_where_each_rank_was(tmp_path):
    message, tag = _run(tmp_path, "hang", timeout_s=3)
    assert message is not None and "ranks 0, 1 still running" in message, message
    assert message.count("waiting in wait_for_peers") == 2
    assert _survivors(tag) == []


def test_ranks_die_with_a_killed_launcher(tmp_path):
    # The launcher itself killed (no chance to clean up): its ranks die with it (PR_SET_PDEATHSIG).
    import signal
    import subprocess
    import time

    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    launcher = textwrap.dedent(f"""
        import sys
        from omnibal_compile.runtime.processes import run_ranks
        run_ranks([sys.executable, {str(script)!r}, "alone"], nproc=2, env=dict(__import__("os").environ),
                  workdir={str(tmp_path)!r}, on_line=lambda r, line: print(line, end="", flush=True))
    """)
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=_tagged_env(tag), stdout=subprocess.PIPE, text=True)
    try:
        started = [proc.stdout.readline() for _ in range(2)]
        assert sorted(started) == ["rank 0 started\n", "rank 1 started\n"], started
        assert len(_survivors(tag)) == 4  # the launcher, its elastic agent and the two ranks
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for _ in range(100):
        if not _survivors(tag):
            break
        time.sleep(0.1)
    assert _survivors(tag) == []


def test_a_stopped_rank_seen_exiting_is_still_named_stopped():
    # CI, loaded: the stopped rank 1 showed R while its SIGKILL took effect, and the report blamed it
    # ("rank 1 was killed by SIGKILL") instead of naming it stopped and rank 0's timeout after it.
    import signal

    from omnibal_compile.runtime.processes import _mark_ended_by_agent, _Rank, _report

    timed_out = _Rank(rank=0, pid=10, ended_at=20.0, exitcode=1, state="S")
    stopped = _Rank(rank=1, pid=11, ended_at=24.0, exitcode=-signal.SIGKILL, state="R", stopped_at=23.0)
    ranks = [timed_out, stopped]
    for rk in ranks:
        _mark_ended_by_agent(rk, ranks)
    assert stopped.state_at_end == "T" and timed_out.state_at_end is None
    assert _report(ranks, "failed", None, 3).startswith(
        "the run failed: rank 1 stopped responding (its process is stopped"), _report(ranks, "failed", None, 3)
    # stopped once, running again and killed before rank 0 failed: its kill is the cause
    resumed = _Rank(rank=1, pid=11, ended_at=19.0, exitcode=-signal.SIGKILL, state="R", stopped_at=5.0)
    for rk in (timed_out, resumed):
        _mark_ended_by_agent(rk, [timed_out, resumed])
    assert resumed.state_at_end is None
    assert _report([timed_out, resumed], "failed", None, 3).startswith("the run failed: rank 1 was killed by SIGKILL")


def test_a_rank_that_left_early_is_the_cause_though_its_peer_failed_within_the_poll():
    # CI: rank 1 called os._exit(0); rank 0 failed at once with "Connection reset by peer" and wrote its error
    # file before the watcher's next poll saw rank 1 gone, so the first to fail by the clock was rank 0.
    from omnibal_compile.runtime.processes import _Rank, _report

    peer = _Rank(rank=0, pid=10, ended_at=19.0, exitcode=1, state="S",
                 lines=["Traceback (most recent call last):\n", "RuntimeError: Connection reset by peer\n"])
    left = _Rank(rank=1, pid=11, ended_at=20.0, exitcode=0, state="S", early_exit=True)
    assert peer.failed_at is not None and left.failed_at is not None and peer.failed_at < left.failed_at
    ranks = [peer, left]
    assert _report(ranks, "failed", None, 3).startswith("the run failed: rank 1 left the run early"), \
        _report(ranks, "failed", None, 3)


def test_first_error_line_reads_torch_prefixed_tracebacks():
    out = ["[omnibal run] step 0\n", "[rank1]: Traceback (most recent call last):\n",
           '[rank1]:   File "x.py", line 3, in f\n', "[rank1]:     g()\n", "[rank1]: RuntimeError: boom\n",
           "Traceback (most recent call last):\n", "OSError: later\n"]
    assert first_error_line(out) == "RuntimeError: boom"
    assert first_error_line(["no traceback\n"]) is None


# -- the launcher, on real ranks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    import omnibal_compile as oc
    from omnibal_compile.models import make_example_batch
    from omnibal_compile.runtime.batches import build_model
    from omnibal_compile.runtime.settings import RunConfig

    fields = dataclasses.asdict(SMALL_VLM)
    model = build_model(RunConfig(plan="-", model_config=fields))
    batch = make_example_batch(SMALL_VLM, batch=2, tiles_per_sample=1, text_tokens=12)
    plan_path = tmp_path_factory.mktemp("faults") / "plan.json"
    plan_path.write_text(oc.optimize(model, batch, num_stages=2, planner="uniform").plan.to_json())
    return RunConfig(plan=str(plan_path), model_config=fields, batch_size=4, tiles_per_sample=1, text_tokens=12,
                     steps=3, optimizer="sgd", schedule="1f1b", num_microbatches=2)


def _launch_with_fault(
    run_config, monkeypatch, fault: str, timeout_s: float | None = None, **changes
) -> tuple[str, str]:
    from omnibal_compile.runtime.launch import launch

    tag = uuid.uuid4().hex
    monkeypatch.setenv("_FAULT_TEST_TAG", tag)
    monkeypatch.setenv("_OMNIBAL_TEST_FAULT", fault)
    path = [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    with pytest.raises(LaunchError) as info:
        launch(dataclasses.replace(run_config, **changes), timeout_s=timeout_s, quiet=True, _worker="fault_worker")
    return str(info.value), tag


@pytest.mark.slow
@pytest.mark.distributed
def test_a_frozen_rank_ends_the_run_after_the_collective_timeout(run_config, monkeypatch):
    # Rank 1 stops inside step 1, so rank 0 waits for it in the pipeline's exchanges (device-mesh
    # groups). The run's limit is far above the collective timeout: a broken timeout fails the
    # test instead of hanging it.
    message, tag = _launch_with_fault(run_config, monkeypatch, "1:1:stop", collective_timeout=10.0, timeout_s=150)
    assert "rank 1 stopped responding" in message, message
    assert "rank 0 then failed with RuntimeError: Timed out waiting 10000ms" in message, message
    assert _survivors(tag) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hung_rank_is_shown_where_it_was_when_the_collective_timeout_ends_the_run(run_config, monkeypatch):
    # Rank 1 sleeps inside step 1: rank 0 times out waiting for it, and the agent's SIGTERM makes rank 1 print
    # its stack (faulthandler) before it ends, so the report says where it hung.
    message, tag = _launch_with_fault(run_config, monkeypatch, "1:1:hang", collective_timeout=10.0, timeout_s=150)
    assert message.startswith("the run failed: rank 0 failed with RuntimeError: Timed out waiting 10000ms"), message
    assert "rank 1 was still running, waiting in _fire (" in message and "fault_worker.py:" in message, message
    assert _survivors(tag) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_exits_with_code_0_mid_run_is_named_as_leaving_early(run_config, monkeypatch):
    message, tag = _launch_with_fault(run_config, monkeypatch, "1:1:exit0", collective_timeout=20.0, timeout_s=150)
    assert message.startswith("the run failed: rank 1 left the run early: it exited with code 0 before the end"), \
        message
    assert "exit 0 before the end" in message and "finished" not in message, message
    assert _survivors(tag) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_ends_the_run(run_config, monkeypatch):
    message, tag = _launch_with_fault(run_config, monkeypatch, "1:1:kill")
    assert message.startswith("the run failed: rank 1 was killed by SIGKILL"), message
    assert _survivors(tag) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_the_run_command_timeout_ends_every_rank(run_config, monkeypatch, capsys):
    from omnibal_compile.cli import main

    tag = uuid.uuid4().hex
    monkeypatch.setenv("_FAULT_TEST_TAG", tag)
    argv = [
        "run",
        "--plan",
        run_config.plan,
        "--model-config",
        __import__("json").dumps(dict(run_config.model_config)),
        "--batch-size",
        "4",
        "--tiles-per-sample",
        "1",
        "--text-tokens",
        "12",
        "--num-microbatches",
        "2",
        "--timeout",
        "3",
        "--steps",
        "100000",
    ]  # far more than 3 s of work: a quiet machine finished the default steps in time
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: the run exceeded its time limit (3 s, --timeout)" in err, err
    assert "ranks 0, 1 still running" in err and err.count("running; ended by the launcher") == 2
    assert _survivors(tag) == []


_MESH_RANK = textwrap.dedent("""
    import types
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from omnibal_compile.runtime.train import _mesh_groups
    from omnibal_compile.runtime.worker import init_process_group
    init_process_group(types.SimpleNamespace(device="cpu", collective_timeout=7.0))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"), backend_override=_mesh_groups("cpu", 7.0))
    for dim in ("dp", "pp"):
        got = mesh[dim].get_group()._get_backend(torch.device("cpu")).options._timeout
        assert got.total_seconds() == 7.0, f"the {dim} group waits {got}"
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_device_mesh_groups_get_the_collective_timeout(tmp_path):
    # Groups smaller than the world are new process groups, which torch gives 30 minutes, not the
    # default group's timeout; with dp x pp = 2 x 2 both mesh dimensions are such groups.
    script = tmp_path / "mesh_rank.py"
    script.write_text(_MESH_RANK)
    tag = uuid.uuid4().hex
    run_ranks([sys.executable, str(script)], nproc=4, env=_tagged_env(tag), workdir=tmp_path, timeout_s=120)
    assert _survivors(tag) == []


def test_bad_timeouts_and_checkpoints_fail_before_any_rank_starts(run_config, tmp_path, monkeypatch):
    import omnibal_compile.runtime.processes as processes_mod
    from omnibal_compile.runtime.launch import launch

    def no_process(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(processes_mod.subprocess, "Popen", no_process)
    with pytest.raises(InputError, match=r"timeout \(--timeout\) must be a number of seconds > 0, got nan"):
        launch(run_config, timeout_s=float("nan"))
    with pytest.raises(
        InputError, match=r"collective_timeout .* got 0; setting collective_timeout \(--collective-timeout\)"
    ):
        launch(dataclasses.replace(run_config, collective_timeout=0))
    missing = tmp_path / "nowhere"
    with pytest.raises(InputError, match=rf"checkpoint {missing} does not exist"):
        launch(dataclasses.replace(run_config, resume=str(missing)))
    with pytest.raises(InputError, match=rf"no checkpoint under {tmp_path}"):
        launch(dataclasses.replace(run_config, resume=str(tmp_path)))
    step = tmp_path / "ckpt" / "step-000002"
    step.mkdir(parents=True)
    with pytest.raises(InputError, match="incomplete"):  # meta.json is written last
        launch(dataclasses.replace(run_config, resume=str(step.parent)))
    (step / "meta.json").write_text('{"format": 2, "step": 2}')  # and the data is missing
    with pytest.raises(InputError, match=rf"checkpoint {step}: \.metadata: DCP metadata is missing"):
        launch(dataclasses.replace(run_config, resume=str(step.parent)))
