"""Device specs for the roofline model: names, datasheet figures, roofline arithmetic, errors."""

from __future__ import annotations

import dataclasses

import pytest

from omnibal_compile.costs.devices import (
    A100_80G,
    DEVICES,
    H100_80G,
    H200,
    OP_CLASSES,
    DeviceSpec,
    get_device,
    known_devices,
)
from omnibal_compile.errors import InputError


@pytest.mark.parametrize(
    ("name", "spec"),
    [("a100-80gb", A100_80G), ("A100", A100_80G), (" h100-sxm ", H100_80G), ("H100-80GB", H100_80G), ("h200", H200)],
)
def test_names_and_aliases(name, spec):
    assert get_device(name) is spec
    assert get_device(spec) is spec


def test_datasheet_figures():
    assert A100_80G.peak_flops == 312e12 and A100_80G.memory_bandwidth == 2.039e12
    assert H100_80G.peak_flops == H200.peak_flops == 989.5e12
    assert H200.memory_bandwidth > H100_80G.memory_bandwidth > A100_80G.memory_bandwidth
    assert H200.memory_bytes == 141e9 and H100_80G.memory_bytes == A100_80G.memory_bytes == 80 * 2**30
    assert A100_80G.link_bandwidth("nvlink") == 300e9 and H100_80G.link_bandwidth("infiniband") == 50e9


def test_unknown_name_lists_known_ones():
    with pytest.raises(InputError) as e:
        get_device("v100")
    for name in known_devices():
        assert name in str(e.value)
    assert set(DEVICES) <= set(known_devices())


def test_op_time_is_a_calibrated_roofline():
    spec = dataclasses.replace(A100_80G, calibration={c: 1.0 for c in OP_CLASSES})
    assert spec.op_time("matmul", 312e12, 0) == pytest.approx(1.0)  # compute-bound
    assert spec.op_time("memory", 1.0, 2.039e12) == pytest.approx(1.0)  # memory-bound
    assert A100_80G.op_time("matmul", 312e12, 0) == pytest.approx(1 / A100_80G.calibration["matmul"])


def test_bad_specs():
    with pytest.raises(InputError, match="calibration"):
        dataclasses.replace(A100_80G, calibration={"matmul": 0.5})
    with pytest.raises(InputError, match=r"\(0, 1\]"):
        dataclasses.replace(A100_80G, calibration={"matmul": 1.5, "attention": 0.5, "memory": 0.5})
    with pytest.raises(InputError, match="positive"):
        DeviceSpec(
            name="x", peak_flops=0, memory_bandwidth=1, memory_bytes=1, nvlink_bandwidth=1, infiniband_bandwidth=1
        )
    with pytest.raises(InputError, match="link"):
        A100_80G.link_bandwidth("ethernet")
