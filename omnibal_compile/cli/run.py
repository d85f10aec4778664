"""``omnibal-compile run``: train from a saved plan on N local processes (gloo on CPU, NCCL on GPU).

Its flags are the fields of :class:`omnibal_compile.runtime.settings.RunConfig` (generated, see
:mod:`omnibal_compile.cli._settings`).
"""

from __future__ import annotations

import argparse

from omnibal_compile.cli._settings import add_settings, settings_from_args

NAME = "run"
HELP = "train a model from a saved plan on local ranks (dp pipelines x plan devices)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    # RunConfig imports only the torch-free config sections; --batching and --dp-shard choices are
    # the fields', and the run's other checks happen before launch (runtime.launch.precheck).
    from omnibal_compile.runtime.settings import RunConfig

    add_settings(p, RunConfig, required=("plan",))


def run(args: argparse.Namespace) -> int:
    from omnibal_compile.runtime.launch import launch
    from omnibal_compile.runtime.settings import RunConfig

    config = settings_from_args(args, RunConfig)
    logs = launch(config, timeout_s=config.timeout)
    if logs:
        times = sorted(s.step_time_s for s in logs[1:]) or [logs[0].step_time_s]
        print(
            f"{len(logs)} steps: loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f}, "
            f"median step {times[len(times) // 2] * 1e3:.1f} ms"
        )
    if config.save:
        print(f"checkpoint written to {config.save}")
    return 0
