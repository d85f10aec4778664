"""Qwen2-VL captured once takes packs of other per-image grids with the same tensor shapes
(omnibal_compile/integrations/hf/grids.py): outputs, loss and gradients equal the unmodified model's."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_packing import IMG, _qwen2_vl  # noqa: E402
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids  # noqa: E402

from omnibal_compile import optimize  # noqa: E402
from omnibal_compile.compile.capture import capture, is_data_dependent  # noqa: E402
from omnibal_compile.integrations.hf.grids import _cu_seqlens, patch_positions, segment_ids  # noqa: E402

Grids = list[tuple[int, int, int]]


@pytest.mark.parametrize("grids", [[(1, 4, 4)], [(1, 2, 4), (1, 4, 2), (2, 6, 4)], [(3, 2, 8), (1, 8, 2)]])
def test_positions_and_segments_equal_hugging_faces(grids: Grids) -> None:
    grid = torch.tensor(grids)
    n = int(grid.prod(-1).sum())
    assert torch.equal(patch_positions(grid, 2, n), get_vision_position_ids(grid, 2))
    ref = get_vision_cu_seqlens(grid)
    cu = _cu_seqlens(segment_ids(grid, n)[0])
    assert cu.shape == (n + 1,)
    assert torch.equal(cu[:len(ref)], ref) and bool((cu[len(ref):] == n).all())


def _pack(model, grids: Grids, seed: int, *, video: bool = False) -> dict[str, torch.Tensor]:
    """One processor-style row: text, then each image (or video) as vision_start, placeholders, vision_end;
    M-RoPE positions."""
    token, kind = (92, "video") if video else (IMG, "image")
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 90, (2,), generator=g)]
    for t, h, w in grids:
        ids += [torch.tensor([93]), torch.full((t * h * w // 4,), token), torch.tensor([94]),
                torch.randint(0, 90, (1,), generator=g)]
    ids.append(torch.randint(0, 90, (4,), generator=g))
    row = torch.cat(ids)[None]
    grid = torch.tensor(grids)
    positions, _ = model.model.get_rope_index(row, (row == token).int() * (2 if video else 1),
                                              **{f"{kind}_grid_thw": grid})
    n = int(grid.prod(-1).sum())
    pixels = "pixel_values_videos" if video else "pixel_values"
    return {"input_ids": row, "position_ids": positions, pixels: torch.randn(n, 96, generator=g),
            f"{kind}_grid_thw": grid, "labels": row.clone()}


PAIRS = {  # (example grids, other grids): same patches, images and placeholders; other sizes per image, which
    # Hugging Face's code, captured on the example, refuses (its per-image split sizes are asserted)
    "two images": ([(1, 4, 4), (1, 4, 8)], [(1, 2, 4), (1, 4, 10)]),
    "frames": ([(1, 4, 4), (2, 4, 4)], [(2, 2, 4), (1, 8, 4)]),
    "videos": ([(2, 4, 4), (1, 4, 8)], [(3, 2, 4), (1, 4, 10)]),
}


@pytest.mark.parametrize(("pair", "impl"), [("two images", "sdpa"), ("frames", "eager"), ("videos", "sdpa")])
def test_graph_captured_on_one_pack_takes_other_grids(pair: str, impl: str) -> None:
    model = _qwen2_vl(impl)
    kind = "video" if pair == "videos" else "image"
    example, other = (_pack(model, grids, seed, video=kind == "video") for seed, grids in enumerate(PAIRS[pair]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, example)
    patched = ("forward", "get_image_features", "get_video_features")
    assert not any(k in vars(m) for m in model.modules() for k in patched), "the model is left patched"
    gm = captured.graph_module
    # What still follows the grids: the per-image split of the image features the model returns next to the loss
    # (returned as None), and transformers' check that the placeholders match the features. No size in the graph.
    assert captured.dropped_outputs == (f"{kind}_outputs.pooler_output[0]", f"{kind}_outputs.pooler_output[1]")
    assert not any(is_data_dependent(d) for n in gm.graph.nodes
                   for d in (n.meta["val"].shape if isinstance(n.meta.get("val"), torch.Tensor) else ()))
    assert not captured.data_dependent
    checks = set(re.findall(r"in a value its code decided on \(([^\n]*?)\): the captured graph", gm.code))
    assert checks == {"Eq(u0, 1)", "u0 <= 1", "u0 >= 1"}, checks  # u0: the placeholder check, true or false
    for batch in (example, other):
        captured.flatten_inputs(**batch)
        with torch.no_grad():
            ref, got = model(**batch), gm(**batch)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)
        assert float(got.loss) == pytest.approx(float(ref.loss), abs=1e-5)
    result = optimize(model, example, num_stages=2, device="cpu")
    for batch in (example, other):
        report = result.check_parity(batch, tolerance=1e-5)
        assert report.ok, report


def test_qwen2_5_vl_is_left_as_it_is_and_said_so(capsys, monkeypatch) -> None:
    """Its window attention (get_vision_window_index) is not replaced: nothing is patched, and the user is told."""
    import hf_families as H

    from omnibal_compile.integrations.hf import grids
    from omnibal_compile.integrations.hf.grids import grid_free_capture

    monkeypatch.setattr(grids, "_TOLD", set())  # said once per process: another test may have captured one

    model, _ = H.qwen2_5_vl()
    with grid_free_capture(model) as returned_none:
        assert not any("forward" in vars(m) or "get_image_features" in vars(m) for m in model.modules())
    assert returned_none == set()
    assert "window attention is captured for the example's image grids" in capsys.readouterr().err
