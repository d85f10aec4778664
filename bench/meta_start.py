"""Meta-device start: each rank's peak memory and the time to its first step, pp=1 vs pp=4.

A Llava is saved with ``save_pretrained`` into a temporary folder (by a child process), planned for 1 and for 4
pipeline stages, and trained ``--steps`` steps with AdamW by ``omnibal-compile run`` in a child process (its ranks
are the launcher's children). ``--size``:

- ``90m`` (default): a LlamaConfig LLM of hidden 512, 16 layers, a 32k vocabulary, untied head; a CLIP-like tower of
  hidden 384, 6 layers; parameter-balanced plans.
- ``0.6b`` (issue 28's acceptance model): a SigLIP-like tower (hidden 768, 12 layers, 384 px, patch 16: 576 image
  tokens) + a Qwen2-0.5B-like LLM (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary
  151,936, tied embeddings), 589M parameters; ILP plans under ``--budget`` per stage (recomputation where needed).

Each plan is made on the meta model, its costs modelled (roofline of an H200, fp32 parameters) for one micro-batch
(``rows / 4`` rows), so that its predicted stage peaks (``Plan.stage_peak_bytes``: parameter, gradient and AdamW
bytes + the peak activations of the schedule) are the issue's "planned" figures. Printed per run: each rank's peak
RSS (``ru_maxrss``, from the step log), its stages' parameter + gradient + AdamW bytes (4 x fp32, from the cut), the
planned peak activations (the plan's stage peak minus those), the issue's bound 1.2 x (both) + 1 GiB, the measured
peak live tensor bytes of step 0 (``--memory-steps 0``), the launcher's own peak RSS, the wall time from the launch to
the first step's log line and to the first step's start (that minus the step's time), and step 0's loss next to the
unsplit model's (the saved model loaded by ``from_pretrained`` in fp32, one forward of the same batch, in a child
process). The issue's targets: rank RSS <= the bound; launcher < 1.5 GiB; pp=4's time to the first step within 1.5x
pp=1's; step-0 loss within 1e-5 of the unsplit model's.

    python bench/meta_start.py                          # 90m, 2 steps per run
    nice python bench/meta_start.py --size 0.6b         # the acceptance run (~20 min on 2 cores, ~20 GiB)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20

_LAUNCHER = """
import resource, sys
from omnibal_compile.cli import main
rc = main(sys.argv[1:])
print("LAUNCHER_MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(rc)
"""


IMAGE_TOKENS = {"90m": 65, "0.6b": 576}
"""Image tokens per row of each size (one tile per row; CLIP keeps its CLS token, SigLIP has none)."""


def make_model(folder: Path, size: str) -> None:
    """The Llava of ``size``, saved by ``save_pretrained`` (seeded)."""
    import torch
    import transformers as tf

    if size == "90m":
        vision = tf.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                     num_attention_heads=6, image_size=64, patch_size=8, projection_dim=384)
        text = tf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=16,
                              num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                              tie_word_embeddings=False)
        image_token, tied = 31999, False
    else:
        vision = tf.SiglipVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, image_size=384, patch_size=16)
        text = tf.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                              tie_word_embeddings=True)
        image_token, tied = 151646, True
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                            image_seq_length=IMAGE_TOKENS[size], vision_feature_layer=-1,
                            vision_feature_select_strategy="full", tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(config)
    assert not tied or model.lm_head.weight is model.model.language_model.embed_tokens.weight
    model.save_pretrained(folder)


def unsplit_loss(spec: str, rows: int, text: int) -> float:
    """Step 0's loss of the unsplit model in fp32: the saved model as ``from_pretrained`` loads it, on the run's
    step-0 batch (the same seeded source the ranks draw from)."""
    import torch

    from omnibal_compile.runtime.batches import batch_source, build_model
    from omnibal_compile.runtime.settings import RunConfig

    config = RunConfig(plan="-", model=spec, batch_size=rows, text_tokens=text)
    model = build_model(config)
    torch.set_num_threads(2)
    with torch.no_grad():
        return float(model(**batch_source(config, model)(0)).loss)


def plan_for(spec: str, stages: int, out: Path, rows: int, text: int, *, planner: str,
             budget: str) -> tuple[dict[int, int], dict[int, int]]:
    """Write the plan for ``stages`` stages to ``out`` (see the module docstring); returns (rank -> its stages'
    parameter + grad + AdamW bytes (4 x the fp32 parameter bytes: weights, gradients, two moments) from the model cut
    on meta, rank -> its stages' planned peak bytes)."""
    import omnibal_compile as oc
    from omnibal_compile import progress
    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.ir.costs import precision_named
    from omnibal_compile.runtime.batches import batch_source
    from omnibal_compile.runtime.settings import RunConfig
    from omnibal_compile.runtime.weights import meta_model, on_meta

    micro = rows // 4  # the run's micro-batch: 4 micro-batches at pp=1 and pp=4 alike
    config = RunConfig(plan="-", model=spec, batch_size=micro, text_tokens=text)
    model = meta_model(config)
    assert model is not None
    batch = on_meta(batch_source(config, model)(0))
    with progress.quiet():
        plan = oc.optimize(model, batch, num_stages=stages, num_microbatches=4, planner=planner, device="h200",
                           memory_budget=budget, precision=precision_named("fp32")).plan
        whole = on_meta(batch_source(dataclasses.replace(config, batch_size=rows), model)(0))
        result = compile_for_microbatches(model, whole, plan)
    out.write_text(plan.to_json())
    held: dict[int, int] = {}
    planned: dict[int, int] = {}
    for s, stage in enumerate(result.stages):
        rank = s % plan.num_devices
        seen = {id(p): p for p in stage.parameters()}
        held[rank] = held.get(rank, 0) + 4 * sum(p.numel() * 4 for p in seen.values())
        planned[rank] = planned.get(rank, 0) + (plan.stage_peak_bytes[s] if plan.stage_peak_bytes else 0)
    return held, planned


def run(spec: str, plan: Path, log: Path, steps: int, rows: int, text: int, threads: int
        ) -> tuple[float, float, str]:
    """(seconds from the launch to the first step's log line, the launcher's peak RSS bytes, its output)."""
    argv = [sys.executable, "-c", _LAUNCHER, "run", "--plan", str(plan), "--model", spec, "--batch-size", str(rows),
            "--text-tokens", str(text), "--steps", str(steps), "--optimizer", "adamw", "--lr", "1e-4",
            "--memory-steps", "0", "--log", str(log), "--timeout", "3000", "--threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMNIBAL_QUIET": "1"})
    first = None
    while proc.poll() is None:
        if first is None and log.is_file() and log.read_text().strip():
            first = time.perf_counter() - start
        time.sleep(0.05)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{output[-4000:]}")
    if first is None:
        first = time.perf_counter() - start
    kib = next(int(line.split()[1]) for line in output.splitlines() if line.startswith("LAUNCHER_MAXRSS_KIB"))
    return first, kib * 1024.0, output


def _child(*args: str) -> str:
    """This script run with ``args`` in a child process (the model's weights never held here); its last line."""
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(IMAGE_TOKENS), default="90m", help="the model (module docstring)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per run")
    ap.add_argument("--rows", type=int, default=4, help="rows per step (a multiple of 4: 4 micro-batches)")
    ap.add_argument("--text", type=int, default=64, help="text tokens per row (after the image tokens)")
    ap.add_argument("--budget", default=None, help="memory budget per stage of the 0.6b plans (default 5GiB; "
                    "pp=1: 32GiB)")
    ap.add_argument("--pp", default="1,4", help="the pipeline sizes to run (comma-separated; the ratio needs 1 and 4)")
    ap.add_argument("--make", metavar="DIR", default=None, help=argparse.SUPPRESS)  # child: save the model
    ap.add_argument("--unsplit", metavar="SPEC", default=None, help=argparse.SUPPRESS)  # child: the unsplit loss
    args = ap.parse_args(argv)
    if args.make:
        make_model(Path(args.make), args.size)
        print("saved")
        return 0
    if args.unsplit:
        print(repr(unsplit_loss(args.unsplit, args.rows, args.text)))
        return 0
    if args.rows % 4:
        raise SystemExit(f"--rows must be a multiple of 4 (4 micro-batches), got {args.rows}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llava"
        _child("--make", str(folder), "--size", args.size)
        spec = f"hf:{folder}"
        firsts: dict[int, float] = {}
        print(f"{args.size} Llava saved in {folder}; {args.steps} steps of {args.rows} rows x "
              f"({IMAGE_TOKENS[args.size]} image + {args.text} text tokens), 4 micro-batches, AdamW, fp32, CPU gloo")
        losses: dict[int, float] = {}
        lines: dict[int, float] = {}
        for pp in (int(p) for p in args.pp.split(",")):
            plan, log = Path(tmp) / f"plan{pp}.json", Path(tmp) / f"log{pp}.jsonl"
            planner = "parameters" if args.size == "90m" else "ilp"
            budget = "64GiB" if args.size == "90m" else "32GiB" if pp == 1 else args.budget or "5GiB"
            held, planned = plan_for(spec, pp, plan, args.rows, args.text, planner=planner, budget=budget)
            threads = 2 if pp == 1 else 1  # the machine's 2 cores: one rank uses both, four share them
            first, launcher, _ = run(spec, plan, log, args.steps, args.rows, args.text, threads)
            entry = json.loads(log.read_text().splitlines()[0])
            print(f"pp={pp} step-0 log line: {json.dumps(entry)}", flush=True)
            firsts[pp], lines[pp] = first - entry["step_time_s"], first
            losses[pp] = entry["loss"]
            rss, live = entry["rank_memory_bytes"], entry["rank_peak_bytes"]
            print(f"\npp={pp} ({planner} plan, budget {budget}/stage, --threads {threads}): launch to first step "
                  f"log {first:.1f} s, to its start {firsts[pp]:.1f} s; launcher peak RSS {launcher / MIB:.0f} MiB "
                  f"(target < 1536); step-0 loss {entry['loss']:.6f}")
            print("  rank  peak RSS MiB  params+grads+AdamW MiB  planned act. MiB  bound MiB  RSS/bound  "
                  "peak live MiB")
            for r in range(pp):
                act = max(planned.get(r, 0) - held.get(r, 0), 0)
                bound = 1.2 * (held.get(r, 0) + act) + 1024 * MIB
                print(f"  {r:>4}  {rss[r] / MIB:>12.0f}  {held.get(r, 0) / MIB:>22.0f}  {act / MIB:>16.0f}  "
                      f"{bound / MIB:>9.0f}  {rss[r] / bound:>9.2f}  {live[r] / MIB:>13.0f}")
        ref = float(_child("--unsplit", spec, "--rows", str(args.rows), "--text", str(args.text)))
        print(f"\nunsplit model (from_pretrained, fp32) step-0 loss {ref:.7f}: "
              + ", ".join(f"|pp={pp} - it| {abs(loss - ref):.2e}" for pp, loss in losses.items()) + " (target <= 1e-5)")
        if 1 in firsts and 4 in firsts:
            print(f"time to the first step's start, pp=4 / pp=1: {firsts[4] / firsts[1]:.2f} (target <= 1.5); "
                  f"to its log line {lines[4] / lines[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
