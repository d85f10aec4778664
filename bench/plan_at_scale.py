"""Plan real-size VLMs from this CPU host: Hugging Face models built on ``meta`` (no weights), costed for an A100.

For LLaVA-1.5-7B/13B-shaped models and a 6B ViT (48 layers) in front of a 20B- or 70B-shaped LLM,
all ``LlavaForConditionalGeneration`` built from configs this script writes, it prints the time of
capture, costing and planning, the peak memory of the process (each model in a fresh one), the plan
summary, and the compiler's per-layer-type costs next to the analytic formulas of
``omnibal_compile.costs.analytic`` (with ``kernels="eager"``, the formulas for Hugging Face's
unfused code, and the default ``fused`` ones, Megatron's kernels).

    python bench/plan_at_scale.py                  # every model (a few minutes)
    python bench/plan_at_scale.py --models llava-1.5-7b
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS: dict[str, dict] = {
    # vision: CLIP-style encoder; llm: Llama-style decoder; plan: stages, dp, micro-batches.
    "llava-1.5-7b": dict(vision=dict(layers=24, width=1024, mlp=4096, heads=16, image=336, act="quick_gelu"),
                         llm=dict(layers=32, width=4096, mlp=11008, heads=32, kv_heads=32, vocab=32000),
                         text=1472, stages=4, dp=1, microbatches=8),
    "llava-1.5-13b": dict(vision=dict(layers=24, width=1024, mlp=4096, heads=16, image=336, act="quick_gelu"),
                          llm=dict(layers=40, width=5120, mlp=13824, heads=40, kv_heads=40, vocab=32000),
                          text=1472, stages=4, dp=1, microbatches=8),
    "vit6b-llm20b": dict(vision=dict(layers=48, width=3200, mlp=12800, heads=25, image=448, act="gelu"),
                         llm=dict(layers=48, width=6144, mlp=16384, heads=48, kv_heads=8, vocab=92544),
                         text=1024, stages=4, dp=8, microbatches=16),
    "vit6b-llm70b": dict(vision=dict(layers=48, width=3200, mlp=12800, heads=25, image=448, act="gelu"),
                         llm=dict(layers=80, width=8192, mlp=28672, heads=64, kv_heads=8, vocab=32000),
                         text=1024, stages=8, dp=8, microbatches=16),
}
DEVICE = "a100-80gb"
BUDGET = "80GiB"
MIB = 2**20


def write_config(name: str, folder: Path) -> Path:
    import transformers as tf

    m = MODELS[name]
    v, t = m["vision"], m["llm"]
    vc = tf.CLIPVisionConfig(hidden_size=v["width"], intermediate_size=v["mlp"], num_hidden_layers=v["layers"],
                             num_attention_heads=v["heads"], image_size=v["image"], patch_size=14, hidden_act=v["act"])
    tc = tf.LlamaConfig(hidden_size=t["width"], intermediate_size=t["mlp"], num_hidden_layers=t["layers"],
                        num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"], vocab_size=t["vocab"],
                        max_position_embeddings=4096, use_cache=False)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=t["vocab"] - 1, vision_feature_layer=-2)
    path = folder / f"{name}.json"
    cfg.to_json_file(str(path))
    return path


def analytic_spec(name: str, kernels: str):
    from omnibal_compile.models import analytic as an

    m = MODELS[name]
    v, t = m["vision"], m["llm"]
    grid = v["image"] // 14
    vision = an.VisionSpec(name=name + "-vit", layers=v["layers"], width=v["width"], mlp=v["mlp"], heads=v["heads"],
                           patch_size=14, tokens_per_tile=grid * grid + 1, activation=v["act"])
    llm = an.LLMSpec(name=name + "-llm", layers=t["layers"], width=t["width"], mlp=t["mlp"], heads=t["heads"],
                     kv_heads=t["kv_heads"], vocab=t["vocab"])
    proj = an.ProjectorSpec(in_width=v["width"], hidden=t["width"], out_width=t["width"], norm=False)
    return an.VLMSpec(
        name=name, vision=vision, projector=proj, llm=llm, image_tokens_per_tile=grid * grid, kernels=kernels
    )


def block_type(name: str, after_head: bool) -> str:
    """The analytic block type a compiled block belongs to ('' for glue the analytic model has no type for)."""
    if "vision_tower.encoder.layers." in name:
        return "vision.layer"
    if "vision_tower.embeddings" in name or "pre_layrnorm" in name:
        return "vision.embed"
    if "multi_modal_projector" in name:
        return "projector"
    if "embed_tokens" in name:
        return "llm.embed"
    if "language_model.layers." in name:
        return "llm.layer"
    if "language_model.norm" in name or "lm_head" in name or after_head:
        return "llm.head"
    return ""


NAMED = {
    "vision.embed": "CLIP's pre-LayerNorm keeps its input (2w per token); the analytic embedding has no norm",
    "vision.layer": "fused vs eager: QuickGELU keeps its sigmoid and product (+4f per token; GELU: none)",
    "projector": "-",
    "llm.embed": "-",
    "llm.layer": "fused vs eager: RMSNorm fp32 copies + normalised outputs (+10w), silu(gate) (+2f), k and v "
                 "repeated to every head under the mask (+4(w - kvd)); FLOPs: "
                 "HF's explicit causal mask makes the kernel compute all s^2 pairs (analytic fused: s(s+1)/2)",
    "llm.head": "fused vs eager: the final RMSNorm's fp32 copy and normalised output (+6w); full: the compiler "
                "has three blocks here (norm, lm_head, loss), each keeping its own input",
}


def run_one(name: str) -> dict:
    import numpy as np
    import torch

    import omnibal_compile as oc
    from omnibal_compile.cli.plan import load_model
    from omnibal_compile.models import analytic as an

    m = MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(name, Path(tmp))
        start = time.perf_counter()
        model, batch, _ = load_model(f"hf:LlavaForConditionalGeneration:{path}", batch=1, tiles=1, text=m["text"],
                                     seed=0, meta=True)
        build_s = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    tokens = int(batch["input_ids"].shape[1])
    result = oc.optimize(model, batch, num_stages=m["stages"], num_microbatches=m["microbatches"], device=DEVICE,
                         memory_budget=BUDGET, dp=m["dp"], dp_shard="fsdp")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu_s = time.process_time()
    costs = result.costs
    # Compiled per layer type: one block of each stack (all alike), the sum of the others of a type.
    compiled: dict[str, dict] = {}
    seen_head = False
    for b in costs.blocks:
        seen_head = seen_head or "lm_head" in b.name
        kind = block_type(b.name, seen_head)
        key = kind or "glue"
        entry = compiled.setdefault(key, {"flops": 0.0, "none": 0, "selective": 0, "full": 0, "n": 0, "names": []})
        if kind.endswith(".layer") and entry["n"] >= 1:
            continue  # layers are identical: compare one (the second: its input needs a gradient, as the rest)
        if kind.endswith(".layer") and b.name.endswith(".layers.0"):
            continue
        entry["flops"] += b.flops
        for o in ("none", "selective", "full"):
            entry[o] += b.activation_bytes[o]
        entry["n"] += 1
        entry["names"].append(b.name)
    pairs = tokens * (tokens + 1) / 2
    analytic = {}
    for kernels in ("eager", "fused"):
        tc = an.type_costs(analytic_spec(name, kernels), np.array([1.0]), np.array([float(tokens)]), np.array([pairs]),
                           device=oc.devices.get_device(DEVICE))
        analytic[kernels] = {t: {"flops": float(tc.flops[t][0]),
                                 **{o: float(tc.activation_bytes[t][o][0]) for o in ("none", "selective", "full")}}
                             for t in an.BLOCK_TYPES}
    del model
    return {
        "name": name, "tokens": tokens, "blocks": len(costs.blocks), "build_s": build_s,
        "timings": result.timings, "peak_mib": peak_mib, "cpu_s": cpu_s, "plan": result.plan.summary(),
        "cost_notes": f"activations in {costs.activation_dtype}; attention: {costs.attention}",
        "compiled": compiled, "analytic": analytic, "torch": torch.__version__,
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:6.3f}" if b else ("   =  " if a == 0 else "   -  ")


def report(r: dict) -> str:
    t = r["timings"]
    lines = [
        f"== {r['name']}: {r['blocks']} blocks, {r['tokens']} LLM tokens per micro-batch (1 image), {DEVICE}, budget "
        f"{BUDGET}",
        f"build {r['build_s']:.1f} s | capture {t.get('capture', 0):.1f} s | blocks {t.get('blocks', 0):.1f} s | "
        f"cost {t.get('cost', 0):.1f} s | plan {t.get('plan', 0):.1f} s | codegen {t.get('codegen', 0):.1f} s | "
        f"total {r['build_s'] + sum(t.values()):.1f} s wall, {r['cpu_s']:.1f} s CPU (incl. imports) | "
        f"peak memory {r['peak_mib']:.0f} MiB",
        r["cost_notes"],
        r["plan"],
        "",
        "compiled (HF code on meta, bf16) vs analytic formulas, per layer type (ratio compiled / analytic):",
        f"{'type':<13} {'GFLOP':>10} {'/eager':>7} {'/fused':>7} {'act none MiB':>13} {'/eager':>7} {'/fused':>7} "
        f"{'sel /eager':>10} {'full /eager':>11}  named difference",
    ]
    for kind in ("vision.embed", "vision.layer", "projector", "llm.embed", "llm.layer", "llm.head"):
        c = r["compiled"].get(kind)
        if c is None:
            continue
        e, f = r["analytic"]["eager"][kind], r["analytic"]["fused"][kind]
        lines.append(
            f"{kind:<13} {c['flops'] / 1e9:10.1f} {_ratio(c['flops'], e['flops']):>7} "
            f"{_ratio(c['flops'], f['flops']):>7} "
            f"{c['none'] / MIB:13.2f} {_ratio(c['none'], e['none']):>7} {_ratio(c['none'], f['none']):>7} "
            f"{_ratio(c['selective'], e['selective']):>10} {_ratio(c['full'], e['full']):>11}  {NAMED[kind]}"
        )
    g = r["compiled"].get("glue")
    if g:
        lines.append(f"{'glue':<13} {g['flops'] / 1e9:10.1f} {'':>7} {'':>7} {g['none'] / MIB:13.2f}   (no analytic "
                     "type: splicing image features keeps masked_scatter's boolean mask; the 4-D causal mask)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return 0
    for name in args.models:  # a fresh process each: the peak memory is the model's own
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"== {name}: failed\n{done.stderr[-3000:]}")
            continue
        print(report(json.loads(done.stdout.strip().splitlines()[-1])))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

