"""Meta-device start: each rank's peak memory and the time to its first step, pp=1 vs pp=4.

A mid-size Llava (a LlamaConfig LLM of hidden 512, 16 layers, a 32k vocabulary, untied head; a CLIP-like tower of
hidden 384, 6 layers) is saved with ``save_pretrained`` into a temporary folder, planned for 1 and for 4 pipeline
stages (parameter-balanced), and trained ``--steps`` steps with AdamW by ``omnibal-compile run`` in a child process
(its ranks are the launcher's children). Printed per run: each rank's peak RSS (``ru_maxrss``, from the step log),
its stages' parameter + gradient + AdamW bytes, its peak live tensor bytes in step 0 (``--memory-steps 0``: weights,
gradients, optimizer states and activations), the launcher's own peak RSS, and the wall time from the launch to
the first step's log line. The issue's targets: rank RSS <= 1.2 x the peak live bytes + 1 GiB; launcher < 1.5 GiB;
pp=4's time to the first step within 1.5x pp=1's.

    python bench/meta_start.py             # 2 steps per run
"""

from __future__ import annotations

import argparse
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


def make_model(folder: Path) -> None:
    """The mid-size Llava, saved by ``save_pretrained`` (seeded)."""
    import torch
    import transformers as tf

    vision = tf.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                                 image_size=64, patch_size=8, projection_dim=384)
    text = tf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=16,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                          tie_word_embeddings=False)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=31999, image_seq_length=65,
                            vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(config).save_pretrained(folder)


def plan_for(spec: str, stages: int, out: Path, rows: int, text: int) -> dict[int, int]:
    """Write the plan for ``stages`` stages to ``out``; returns rank -> its stages' parameter + grad + AdamW bytes
    (4 x the fp32 parameter bytes: weights, gradients, two moments), from the model cut on meta."""
    import omnibal_compile as oc
    from omnibal_compile import progress
    from omnibal_compile.api import compile_for_microbatches
    from omnibal_compile.runtime.batches import batch_source
    from omnibal_compile.runtime.settings import RunConfig
    from omnibal_compile.runtime.weights import meta_model, on_meta

    config = RunConfig(plan="-", model=spec, batch_size=rows, text_tokens=text, num_microbatches=max(stages, 1))
    model = meta_model(config)
    assert model is not None
    batch = on_meta(batch_source(config, model)(0))
    with progress.quiet():
        plan = oc.optimize(model, batch, num_stages=stages, num_microbatches=rows, planner="parameters").plan
        result = compile_for_microbatches(model, batch, plan)
    out.write_text(plan.to_json())
    held: dict[int, int] = {}
    for s, stage in enumerate(result.stages):
        seen = {id(p): p for p in stage.parameters()}
        held[s % plan.num_devices] = held.get(s % plan.num_devices, 0) + 4 * sum(
            p.numel() * 4 for p in seen.values())
    return held


def run(spec: str, plan: Path, log: Path, steps: int, rows: int, text: int) -> tuple[float, float, str]:
    """(seconds from the launch to the first step's log line, the launcher's peak RSS bytes, its output)."""
    argv = [sys.executable, "-c", _LAUNCHER, "run", "--plan", str(plan), "--model", spec, "--batch-size", str(rows),
            "--text-tokens", str(text), "--steps", str(steps), "--optimizer", "adamw", "--lr", "1e-4",
            "--memory-steps", "0", "--log", str(log), "--timeout", "900"]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="training steps per run")
    ap.add_argument("--rows", type=int, default=4, help="rows per step (a multiple of 4: micro-batches = rows)")
    ap.add_argument("--text", type=int, default=64, help="text tokens per row (after the 65 image tokens)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llava"
        make_model(folder)
        spec = f"hf:{folder}"
        firsts: dict[int, float] = {}
        print(f"mid-size Llava saved in {folder}; {args.steps} steps of {args.rows} rows x ({65 + args.text} tokens), "
              "AdamW, fp32, CPU gloo")
        for pp in (1, 4):
            plan, log = Path(tmp) / f"plan{pp}.json", Path(tmp) / f"log{pp}.jsonl"
            held = plan_for(spec, pp, plan, args.rows, args.text)
            first, launcher, _ = run(spec, plan, log, args.steps, args.rows, args.text)
            firsts[pp] = first
            entry = json.loads(log.read_text().splitlines()[0])
            rss, live = entry["rank_memory_bytes"], entry["rank_peak_bytes"]
            print(f"\npp={pp}: launch to first step {first:.1f} s; launcher peak RSS {launcher / MIB:.0f} MiB "
                  f"(target < 1536); step-0 loss {entry['loss']:.6f}")
            print("  rank  peak RSS MiB  params+grads+AdamW MiB  peak live MiB  RSS / (1.2 x live + 1 GiB)")
            for r in range(pp):
                bound = 1.2 * live[r] + 1024 * MIB
                print(f"  {r:>4}  {rss[r] / MIB:>12.0f}  {held.get(r, 0) / MIB:>22.0f}  {live[r] / MIB:>13.0f}  "
                      f"{rss[r] / bound:>26.2f}")
        print(f"\ntime to first step, pp=4 / pp=1: {firsts[4] / firsts[1]:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
