"""transformers.Trainer on balanced packs: the batches it trains on are the sampler's packs, collated."""

from __future__ import annotations

import pytest
import torch

from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.errors import InputError
from omnibal_compile.integrations.hf.collate import HFPackingCollator, hf_lengths

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

IMG = 95


def _llava():
    torch.manual_seed(0)
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             image_size=16, patch_size=4, projection_dim=32)
    tc = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=512, use_cache=False)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMG, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    return tf.LlavaForConditionalGeneration(cfg)


def _dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    """Conversations with 0-2 images, one <image> placeholder per image (the collator expands each to 16)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        images = int(torch.randint(0, 3, (1,), generator=g))
        text = torch.randint(0, 90, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g)
        s = {"input_ids": torch.cat([torch.full((images,), IMG), text])}
        if images:
            s["pixel_values"] = torch.randn(images, 3, 16, 16, generator=g)
        out.append(s)
    return out


def _args(tmp_path, **kw):
    return tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=1e-2, logging_steps=1,
                                save_strategy="no", report_to=[], use_cpu=True, seed=3, disable_tqdm=True, **kw)


def test_trainer_trains_two_steps_on_the_balanced_packs(tmp_path) -> None:
    from omnibal_compile.integrations.hf.trainer import BalancedTrainer

    model = _llava()
    collator = HFPackingCollator.for_model(model)
    dataset = _dataset()
    trainer = BalancedTrainer(model=model, args=_args(tmp_path), train_dataset=dataset, data_collator=collator,
                              samples_per_pack=3)
    assert trainer.lengths.tokens.tolist() == [collator.sample_lengths(s)[1] for s in dataset]
    sampler = trainer.balanced_sampler()
    packs = list(sampler)[:2]
    assert sum(len(p) for p in packs) > 2  # packs of several samples
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    with torch.no_grad():
        first_loss = float(model(**collator([dataset[i] for i in packs[0]])).loss)
    seen.clear()
    trainer.train()
    assert trainer.state.global_step == 2
    for got, pack in zip(seen, packs, strict=True):
        assert torch.equal(got, collator([dataset[i] for i in pack])["input_ids"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[0] == pytest.approx(first_loss, abs=1e-3)
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    assert any("vision_tower" in k for k in changed) and any("language_model" in k for k in changed)


def test_lengths_must_match_the_dataset(tmp_path) -> None:
    from omnibal_compile.integrations.hf.trainer import BalancedTrainer

    model = _llava()
    with pytest.raises(InputError, match="lengths has 3 samples but train_dataset 16"):
        BalancedTrainer(model=model, args=_args(tmp_path), train_dataset=_dataset(),
                        data_collator=HFPackingCollator.for_model(model),
                        lengths=LengthStats.from_arrays([0, 1, 2], [5, 6, 7]))
    with pytest.raises(InputError, match="give BalancedTrainer lengths="):
        BalancedTrainer(model=model, args=_args(tmp_path), train_dataset=_dataset(), data_collator=lambda b: b)


_DP_SCRIPT = r'''
import json, os, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, os.environ["TEST_DIR"])
from test_hf_trainer import _args, _dataset, _llava
from omnibal_compile.integrations.hf.collate import HFPackingCollator
from omnibal_compile.integrations.hf.trainer import BalancedTrainer
import pathlib
out = pathlib.Path(os.environ["OUT_DIR"])
model = _llava()
collator = HFPackingCollator.for_model(model)
trainer = BalancedTrainer(model=model, args=_args(out / "run"), train_dataset=_dataset(), data_collator=collator,
                          samples_per_pack=3)
seen = []
model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"][0].tolist()), with_kwargs=True)
trainer.train()
rank = trainer.args.process_index
total = sum(float(p.detach().double().sum()) for p in model.parameters())
(out / f"rank{rank}.json").write_text(json.dumps({"world": trainer.args.world_size, "seen": seen, "params": total}))
# end the process group before exit: gloo's threads torn down at interpreter exit can abort a rank
# ("terminate called without an active exception", SIGABRT) after training finished
import torch.distributed as dist
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
'''


def test_two_ranks_each_train_on_their_own_packs_of_each_step(tmp_path) -> None:
    """torchrun, 2 gloo ranks: rank r trains on column r of the balanced steps; DDP keeps the weights equal."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from omnibal_compile.integrations.hf.trainer import balanced_sampler

    script = tmp_path / "train.py"
    script.write_text(_DP_SCRIPT)
    env = {**os.environ, "TEST_DIR": str(Path(__file__).parent), "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                             "--nproc-per-node", "2", str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # never leave ranks behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    model = _llava()
    collator = HFPackingCollator.for_model(model)
    dataset = _dataset()
    lengths = hf_lengths(dataset, collator)
    for r, got in enumerate(ranks):
        packs = list(balanced_sampler(lengths, rank=r, world_size=2, samples_per_pack=3, seed=3))[:2]
        want = [collator([dataset[i] for i in p])["input_ids"][0].tolist() for p in packs]
        assert got["seen"] == want
    assert ranks[0]["seen"] != ranks[1]["seen"]
    assert ranks[0]["params"] == pytest.approx(ranks[1]["params"], abs=1e-9)
