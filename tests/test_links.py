"""Link speeds of local gloo ranks (runtime/links.py): measured, positive, sized from the model."""

from __future__ import annotations

import math

import pytest

from omnibal_compile.calibrate.links import LinkSpeed, effective_sizes, measure_links
from omnibal_compile.errors import InputError


@pytest.mark.distributed
def test_measure_links_on_two_ranks():
    speed = measure_links(send_bytes=1 << 16, collective_bytes=1 << 18, repeats=3)
    assert speed.ranks == 2 and speed.send_bytes == 1 << 16 and speed.collective_bytes == 1 << 18
    for bw in (speed.send_bytes_per_s, speed.collective_bytes_per_s):
        assert math.isfinite(bw) and 1e5 < bw < 1e12, speed  # loopback: far above 100 kB/s, below 1 TB/s
    # the median lies within the range of the repeats, which the summary prints with it
    assert speed.repeats == 3
    for (low, high), bw in ((speed.send_spread, speed.send_bytes_per_s),
                            (speed.collective_spread, speed.collective_bytes_per_s)):
        assert low <= bw <= high, speed
        assert f"(range {low / 1e9:.2f}-{high / 1e9:.2f})" in speed.summary()
    # FSDP2's fixed cost per collective on local gloo: tens of microseconds to tens of milliseconds
    assert 1e-5 < speed.collective_latency_s < 0.05, speed
    assert speed.tensor_parallel_latency_s is None  # measured only when asked for


@pytest.mark.distributed
def test_tensor_parallel_call_latency_on_two_ranks():
    speed = measure_links(send_bytes=1 << 12, collective_bytes=1 << 12, repeats=3, tensor_parallel=True)
    latency = speed.tensor_parallel_latency_s
    assert latency is not None and 1e-5 < latency < 0.05, speed  # a DTensor all-reduce and its hooks, per call
    assert f"tensor-parallel all-reduces {latency * 1e3:.2f} ms per call" in speed.summary()


def test_link_summary_is_one_line_with_each_median_and_its_range():
    speed = LinkSpeed(send_bytes_per_s=2.41e9, send_bytes=1 << 20, collective_bytes_per_s=0.43e9,
                      collective_bytes=3 << 20, ranks=2, collective_latency_s=0.00146, repeats=7,
                      send_spread=(2.1e9, 2.6e9), collective_spread=(0.37e9, 0.62e9))
    assert speed.summary() == ("sends 2.41 GB/s (range 2.10-2.60) at 1.0 MiB, all-gather and reduce-scatter 0.43 GB/s "
                               "(range 0.37-0.62) at 3.0 MiB plus 1.46 ms per call; medians of 7 repeats")


def test_effective_sizes_take_the_median_cut_and_the_block_with_the_median_weight_byte():
    # cuts 0 at both ends are left out; weights: 10 + 10 + 100 = 120, the 60th byte lies in the 100-byte block
    assert effective_sizes([0, 8, 32, 16, 0], [10, 0, 10, 100]) == (16, 100)
    assert effective_sizes([0, 0], []) == (1 << 20, 1 << 20)  # nothing to go by: 1 MiB


def test_measure_links_refuses_bad_sizes():
    with pytest.raises(InputError, match="send_bytes"):
        measure_links(send_bytes=0, collective_bytes=1 << 10)
    with pytest.raises(InputError, match="ranks"):
        measure_links(send_bytes=1 << 10, collective_bytes=1 << 10, ranks=1)
