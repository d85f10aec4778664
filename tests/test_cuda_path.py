"""What of the CUDA path can be checked without a GPU: stages captured on cpu name cuda in their ops once built
for a cuda rank, and each rank picks its GPU by its rank on the node."""

from __future__ import annotations

import torch
from torch import nn

from omnibal_compile.runtime.settings import local_device
from omnibal_compile.runtime.weights import retarget_meta


class _Positions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)  # a device baked in at capture


def test_a_graph_captured_on_cpu_is_pointed_at_the_ranks_gpu():
    gm = torch.export.export(_Positions(), (torch.zeros(2, 3),), strict=False).module()
    named = [a for n in gm.graph.nodes for a in n.kwargs.values() if isinstance(a, torch.device)]
    assert named and all(d.type == "cpu" for d in named)
    assert retarget_meta(gm, torch.device("cuda:1"), source="cpu") >= 1
    named = [a for n in gm.graph.nodes for a in n.kwargs.values() if isinstance(a, torch.device)]
    assert named and all(d == torch.device("cuda:1") for d in named)
    assert "cuda" in gm.code
    assert retarget_meta(gm, torch.device("cuda:1")) == 0  # meta (the default source): nothing named it


def test_each_rank_takes_the_gpu_of_its_rank_on_the_node():
    assert local_device({"LOCAL_RANK": "1", "RANK": "9"}) == 1  # the second node's second rank: GPU 1, not 9
    assert local_device({"RANK": "2"}) == 2 and local_device({}) == 0
