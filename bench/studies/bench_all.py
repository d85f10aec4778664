"""Run every benchmark script and write one results page (``omnibal-compile bench all``, ``python -m bench``).

Each script of the bench folder runs as its own subprocess (its own process group, killed whole on
timeout, so launched ranks go too), failures and timeouts are recorded and the run goes on. The
page lists, per script: the exact command, whether its figures are measured here or simulated,
its status and time, and everything it printed.

Glossary:
    kind       ``measured`` (timed or computed on this machine), ``simulated`` (predicted by a
               model: roofline costs, the pipeline simulator), or both, per script (:data:`KINDS`).
    quick      scripts that have a cheaper mode get its flags (:data:`QUICK_ARGS`); the page says so.
    skipped    a script that cannot run here (e.g. needs a GPU); listed with the reason.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BenchScript", "BenchResult", "KINDS", "QUICK_ARGS", "FULL_ARGS", "discover", "run_script", "run_all",
           "write_results", "default_bench_dir"]

KINDS: dict[str, str] = {
    "ablation_cpu.py": (
        "measured and simulated (the data/partition/memory ablation on local CPU ranks vs the simulator)"
    ),
    "cost_accuracy.py": "measured on this CPU (profiled block costs vs whole-model runs)",
    "cost_stability.py": "measured on this CPU (repeated cost passes: plan and predicted iteration time run to run)",
    "cut_bytes.py": "counted (bytes of the values crossing each cut of captured tiny Hugging Face VLMs; nothing run)",
    "gpu_check.sh": "measured on a GPU (kernels, cost pass vs roofline, optimize and parity on CUDA)",
    "data_balance.py": "measured (balance metrics on the real length statistics; balancer run times on this CPU)",
    "ilp_cold.py": "measured (the ILP without the DP's bound against the DP or brute force on drawn problems)",
    "lengths_speed.py": "measured on this CPU (the lengths command on a synthetic LLaVA-style dataset)",
    "mutation.py": "measured (mutation testing: planted bugs the covering tests catch; sampled modules only)",
    "pipeline_cpu.py": "measured (real pipeline runs on local CPU ranks)",
    "freeze_cpu.py": "planned and measured (a frozen vision tower: plans on profiled CPU costs, runs on 2 CPU ranks)",
    "precision_cpu.py": "measured (bf16 against fp32 losses of real runs on local CPU ranks)",
    "precision_memory.py": "measured (parameter + gradient bytes per rank and 20-step losses, bf16 vs fp32, CPU ranks)",
    "sim_vs_real.py": "measured and simulated (simulator vs real runs on local CPU ranks)",
    "zero_bubble_sim.py": "SIMULATED schedules (zero-bubble vs 1F1B) on block costs profiled on this CPU",
    "zero_bubble_cpu.py": (
        "measured and simulated (zero-bubble plans vs the best 1F1B plan under one memory budget, local CPU ranks)"
    ),
    "solver.py": "measured solve times; iteration times predicted by the planners' cost model",
    "paper_scale.py": "SIMULATED (analytic roofline costs, no model runs)",
    "layout.py": "SIMULATED layouts (analytic roofline costs); search times measured on this CPU",
    "tp_paper_scale.py": "SIMULATED (analytic roofline costs: TP cost rules side by side, the (dp, pp, tp) search)",
    "kernels": "measured on this machine (on CPU a correctness run; speed figures need a GPU)",
    "kernels_gpu.sh": "measured on a GPU",
}
"""What kind of figures each script prints, by file name."""

FULL_ARGS: dict[str, tuple[str, ...]] = {
    "data_balance.py": ("--no-progress",),
    "mutation.py": (
        "--module",
        "sampler",
        "--module",
        "metrics",
        "--module",
        "recompute",
        "--max-mutants",
        "8",
        "--sample",
    ),
    "sim_vs_real.py": ("--ranks", "2", "4"),
}
"""Flags every run passes (e.g. no progress bars in a log)."""

QUICK_ARGS: dict[str, tuple[str, ...]] = {
    "ablation_cpu.py": ("--quick",),
    "zero_bubble_sim.py": ("--repeats", "3", "--microbatches", "4"),
    "zero_bubble_cpu.py": ("--pp", "2", "--rounds", "1", "--steps", "3"),
    "cost_accuracy.py": ("--quick",),
    "cost_stability.py": ("--quick",),
    "cut_bytes.py": ("--tokens", "512"),
    "data_balance.py": ("--no-progress", "--scale", "300000"),
    "lengths_speed.py": ("--records", "20000"),
    "mutation.py": ("--module", "sampler", "--max-mutants", "4", "--sample"),
    "pipeline_cpu.py": ("--steps", "5"),
    "freeze_cpu.py": ("--steps", "6"),
    "precision_cpu.py": ("--steps", "5"),
    "precision_memory.py": ("--steps", "3"),
    "sim_vs_real.py": ("--steps", "4", "--rounds", "1"),
    "solver.py": ("--quick",),
    "paper_scale.py": ("--quick",),
    "layout.py": ("--quick",),
    "tp_paper_scale.py": ("--quick",),
}
"""Cheaper flags used with ``quick``, for scripts that have them."""

_MAX_LINES = 400
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass(frozen=True, kw_only=True)
class BenchScript:
    """One benchmark to run."""

    name: str
    """File name (or CLI target) it is listed under."""
    argv: tuple[str, ...]
    """The command, as run (the first item is the interpreter or program)."""
    display: str
    """The command as a reader would type it, from the repository root."""
    kind: str
    """Measured, simulated, or both (see :data:`KINDS`)."""
    quick: bool = False
    """Whether cheaper flags were used."""
    skip_reason: str = ""
    """Non-empty: not run here, and why."""


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """What one script did."""

    script: BenchScript
    """The script."""
    status: str
    """``ok``, ``failed (exit N)``, ``timed out after N s`` or ``skipped: reason``."""
    seconds: float
    """Wall time."""
    output: str
    """Everything it printed (stdout and stderr interleaved), ANSI codes removed."""


def default_bench_dir() -> Path:
    """The repository's bench folder (this module lives in it)."""
    return Path(__file__).resolve().parents[1]


def discover(bench_dir: Path, *, quick: bool = False, include_kernels: bool = False) -> list[BenchScript]:
    """Every ``*.py`` and ``*.sh`` bench script in ``bench_dir`` (sorted), plus the kernel bench target."""
    bench_dir = Path(bench_dir)
    scripts = []
    for path in sorted(bench_dir.iterdir()):
        if path.name.startswith("_") or path.suffix not in (".py", ".sh"):
            continue
        flags = QUICK_ARGS.get(path.name, FULL_ARGS.get(path.name, ())) if quick else FULL_ARGS.get(path.name, ())
        kind = KINDS.get(path.name, "see the script's output")
        rel = f"{bench_dir.name}/{path.name}"
        if path.suffix == ".py":
            scripts.append(BenchScript(name=path.name, argv=(sys.executable, str(path), *flags),
                                       display=" ".join(("python", rel, *flags)), kind=kind,
                                       quick=quick and path.name in QUICK_ARGS))
        else:
            gpu = shutil.which("nvidia-smi") is not None
            scripts.append(
                BenchScript(
                    name=path.name,
                    argv=("bash", str(path), *flags),
                    display=" ".join(("bash", rel)),
                    kind=kind,
                    skip_reason="" if gpu else "needs an NVIDIA GPU (no nvidia-smi here)",
                )
            )
    if include_kernels:
        scripts.append(
            BenchScript(
                name="kernels",
                argv=(sys.executable, "-m", "omnibal_compile.cli", "bench", "kernels"),
                display="omnibal-compile bench kernels",
                kind=KINDS["kernels"],
            )
        )
    return scripts


def run_script(script: BenchScript, *, cwd: Path, timeout: float) -> BenchResult:
    """Run one script in its own process group; never raises for the script's failures."""
    if script.skip_reason:
        return BenchResult(script=script, status=f"skipped: {script.skip_reason}", seconds=0.0, output="")
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(script.argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, text=True, errors="replace")
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and whatever it launched
        out, _ = proc.communicate()
        status = f"timed out after {timeout:.0f} s"
    return BenchResult(
        script=script, status=status, seconds=time.perf_counter() - start, output=_ANSI.sub("", out or "")
    )


def _machine() -> str:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"{platform.platform()}, {os.cpu_count()} CPUs (load average {load} at the end of the run), "
            f"Python {platform.python_version()}, torch {torch_version}")


def _commit(cwd: Path) -> str:
    """The checked-out commit, and whether tracked files differ from it (what actually ran)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=cwd, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    if rev.returncode or not rev.stdout.strip():
        return "unknown commit"
    return f"commit {rev.stdout.strip()}" + (" with uncommitted changes" if dirty.returncode == 1 else "")


GPU_SECTION = "## GPU check (bench/gpu_check.sh)"
"""Heading of the results page's section of the GPU check's figures: written by hand from a GPU run (the script
writes it as ``RESULTS_section.md`` in its output folder), kept as it is when the page is generated again."""
GPU_SECTION_TEMPLATE = f"""{GPU_SECTION}

Not yet run on a GPU. `bash bench/gpu_check.sh` (one CUDA GPU, <= 8 min; `--dry-run` checks the same steps on
the CPU at tiny sizes, in the test suite) writes `RESULTS_section.md` to its output folder: replace this section
with it. It holds the Triton kernels' forward+backward speed and memory vs eager torch (and vs Liger-Kernel when
installed), the cost pass on CUDA vs the h200 roofline with fitted calibration factors, optimize() parity on CUDA,
and a 1-rank `omnibal-compile run --device cuda` of a real-width VLM in bf16: --kernels triton vs eager losses
and gradient norms, step time, tokens/s, peak memory and MFU."""


def kept_gpu_section(path: Path) -> str:
    """The GPU check's section of the page at ``path`` (from its heading to the next ``## ``), else the template."""
    text = Path(path).read_text() if Path(path).is_file() else ""
    start = text.find(GPU_SECTION + "\n")
    if start < 0:
        return GPU_SECTION_TEMPLATE
    end = text.find("\n## ", start + len(GPU_SECTION))
    return text[start:end if end >= 0 else len(text)].rstrip()


def write_results(
    results: Sequence[BenchResult], path: Path, *, command: str, commit: str, started: dt.datetime
) -> None:
    """The results page: machine, date, a summary table, then each script's command, kind and output; the GPU
    check's section (:func:`kept_gpu_section`) as it was."""
    gpu = kept_gpu_section(path)
    quick = [r.script.name for r in results if r.script.quick]
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `{command}` ({commit} when it started), started {started:%Y-%m-%d %H:%M} UTC, "
        f"finished {dt.datetime.now(dt.timezone.utc):%H:%M} UTC.",
        f"Machine: {_machine()}.",
        "",
        "Every figure below is printed by the command above it, in this run. *Measured* figures were timed or "
        "computed on this machine; *simulated* ones are predictions of this library's models (roofline costs, "
        "the pipeline simulator) and say so in their own output.",
    ]
    if quick:
        lines += ["", f"Quick mode: {', '.join(quick)} ran with their cheaper flags (shown in each command) to keep "
                      "the whole run short on this shared machine."]
    lines += ["", "| script | command | figures | status | seconds |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.script.name} | `{r.script.display}` | {r.script.kind} | {r.status} | {r.seconds:.0f} |")
    for r in results:
        lines += ["", f"## {r.script.name}", "", f"- command: `{r.script.display}`", f"- figures: {r.script.kind}",
                  f"- status: {r.status}, {r.seconds:.0f} s"]
        if r.output.strip():
            out = r.output.rstrip().splitlines()
            if len(out) > _MAX_LINES:
                out = [f"... ({len(out) - _MAX_LINES} earlier lines left out)", *out[-_MAX_LINES:]]
            lines += ["", "```text", *out, "```"]
    lines += ["", gpu]
    Path(path).write_text("\n".join(lines) + "\n")


def run_all(
    bench_dir: Path | None = None, *, out: Path | None = None, quick: bool = False, timeout: float = 1200.0,
    include_kernels: bool = True, command: str = "omnibal-compile bench all", echo: bool = True,
) -> list[BenchResult]:
    """Run every bench script of ``bench_dir`` and write ``out`` (default ``<bench_dir>/RESULTS.md``)."""
    bench_dir = Path(bench_dir) if bench_dir is not None else default_bench_dir()
    if not bench_dir.is_dir():
        raise FileNotFoundError(f"no bench folder at {bench_dir}; run from a source checkout or pass the folder")
    out = Path(out) if out is not None else bench_dir / "RESULTS.md"
    cwd = bench_dir.resolve().parent
    started = dt.datetime.now(dt.timezone.utc)
    commit = _commit(cwd)
    results = []
    for script in discover(bench_dir, quick=quick, include_kernels=include_kernels):
        if echo:
            print(f"[bench all] {script.display} ...", flush=True)
        result = run_script(script, cwd=cwd, timeout=timeout)
        results.append(result)
        if echo:
            print(f"[bench all] {script.name}: {result.status} ({result.seconds:.0f} s)", flush=True)
        write_results(results, out, command=command, commit=commit, started=started)  # a partial page survives a crash
    write_results(results, out, command=command, commit=commit, started=started)
    if echo:
        print(f"[bench all] wrote {out}")
    return results
