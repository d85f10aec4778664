"""Specs of target accelerators for the roofline cost model. Torch-free.

Glossary:
    peak FLOP/s      dense (no structured sparsity) bf16 tensor-core throughput from the datasheet;
                     datasheets print the 2:4-sparse figure first, which is twice the dense one.
    HBM bandwidth    device memory bandwidth, bytes/s.
    NVLink           GPU-to-GPU bandwidth inside a node; datasheets give the sum of both directions.
    InfiniBand       one NIC port per GPU (DGX/HGX layout), per direction.
    op class         ``matmul`` (mm, addmm, bmm, convolution), ``attention`` (fused scaled dot
                     product attention) or ``memory`` (everything else: bound by HBM bandwidth).
    calibration      fraction of the roofline an op class reaches in practice, per class, in (0, 1];
                     modelled time = roofline time / calibration. Measure and override with
                     ``dataclasses.replace(spec, calibration={...})``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from omnibal_compile.errors import InputError

__all__ = [
    "OP_CLASSES",
    "DeviceSpec",
    "A100_80G",
    "H100_80G",
    "H200",
    "DEVICES",
    "PROFILED_DEVICES",
    "known_devices",
    "get_device",
    "spec_for_gpu_name",
]

OP_CLASSES: tuple[str, ...] = ("matmul", "attention", "memory")

# Typical achieved fractions of peak: large bf16 GEMMs reach ~70-80% of the tensor-core peak,
# flash attention ~50-60%, elementwise/normalisation kernels ~70-80% of HBM bandwidth.
DEFAULT_CALIBRATION: Mapping[str, float] = {"matmul": 0.7, "attention": 0.5, "memory": 0.7}

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator model, as the roofline cost model sees it."""

    name: str
    """Canonical lower-case name, e.g. ``a100-80gb``."""
    peak_flops: float
    """Peak dense bf16 FLOP/s."""
    memory_bandwidth: float
    """HBM bandwidth, bytes/s."""
    memory_bytes: int
    """Device memory, bytes."""
    nvlink_bandwidth: float
    """NVLink bandwidth per GPU, bytes/s, both directions summed (datasheet figure)."""
    infiniband_bandwidth: float
    """InfiniBand bandwidth per GPU (one NIC port), bytes/s, per direction."""
    calibration: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_CALIBRATION))
    """Achieved fraction of the roofline per op class (keys: OP_CLASSES)."""
    aliases: tuple[str, ...] = ()
    """Other accepted names."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "calibration", dict(self.calibration))
        missing = [c for c in OP_CLASSES if c not in self.calibration]
        if missing:
            raise InputError(f"device '{self.name}': calibration lacks op classes {missing}")
        bad = {c: v for c, v in self.calibration.items() if not 0 < v <= 1}
        if bad:
            raise InputError(f"device '{self.name}': calibration factors must lie in (0, 1], got {bad}")
        if min(self.peak_flops, self.memory_bandwidth, self.nvlink_bandwidth, self.infiniband_bandwidth) <= 0:
            raise InputError(f"device '{self.name}': FLOP/s and bandwidths must be positive")

    def op_time(self, op_class: str, flops: float, nbytes: float) -> float:
        """Roofline seconds of one op: the slower of compute and memory traffic, calibrated."""
        ideal = max(flops / self.peak_flops, nbytes / self.memory_bandwidth)
        return ideal / self.calibration[op_class]

    def link_bandwidth(self, link: str = "nvlink") -> float:
        """Bytes/s one way between adjacent pipeline stages over ``nvlink`` or ``infiniband``."""
        if link == "nvlink":
            return self.nvlink_bandwidth / 2
        if link == "infiniband":
            return self.infiniband_bandwidth
        raise InputError(f"link must be 'nvlink' or 'infiniband', got {link!r}")


# NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 tensor core 312 TFLOPS (624 sparse),
# 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s. DGX A100: one 200 Gb/s HDR InfiniBand port per GPU.
# The datasheet's "80 GB" of HBM is binary: nvidia-smi reports 81920 MiB, i.e. 80 GiB.
A100_80G = DeviceSpec(
    name="a100-80gb",
    peak_flops=312e12,
    memory_bandwidth=2039 * GB,
    memory_bytes=80 * 2**30,
    nvlink_bandwidth=600 * GB,
    infiniband_bandwidth=200e9 / 8,
    aliases=("a100", "a100-80g", "a100_80gb", "a100-sxm-80gb"),
)

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 tensor core 1,979 TFLOPS with sparsity
# (989.5 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s. DGX H100: one 400 Gb/s NDR port per GPU.
H100_80G = DeviceSpec(
    name="h100-80gb",
    peak_flops=989.5e12,
    memory_bandwidth=3.35e12,
    memory_bytes=80 * 2**30,  # binary, as for the A100 (nvidia-smi: 81559 MiB, 79.6 GiB)
    nvlink_bandwidth=900 * GB,
    infiniband_bandwidth=400e9 / 8,
    aliases=("h100", "h100-sxm", "h100-80g", "h100_80gb"),
)

# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 tensor core 1,979 TFLOPS with sparsity
# (989.5 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; 400 Gb/s NDR InfiniBand per GPU.
H200 = DeviceSpec(
    name="h200",
    peak_flops=989.5e12,
    memory_bandwidth=4.8e12,
    memory_bytes=141 * 10**9,
    nvlink_bandwidth=900 * GB,
    infiniband_bandwidth=400e9 / 8,
    aliases=("h200-141gb", "h200-sxm"),
)

DEVICES: Mapping[str, DeviceSpec] = {d.name: d for d in (A100_80G, H100_80G, H200)}
"""Built-in roofline targets by canonical name."""

PROFILED_DEVICES: tuple[str, ...] = ("cpu", "cuda")
"""Names that mean: measure on this machine instead of modelling."""


def known_devices() -> list[str]:
    """Every accepted device name: profiled ones first, then roofline targets."""
    return [*PROFILED_DEVICES, *DEVICES]


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """The roofline spec called ``name`` (case-insensitive, aliases accepted), or the spec itself."""
    if isinstance(name, DeviceSpec):
        return name
    key = str(name).strip().lower()
    for spec in DEVICES.values():
        if key == spec.name or key in spec.aliases:
            return spec
    raise InputError(
        f"unknown device {name!r}; known devices: {known_devices()} "
        "('cpu'/'cuda' profile on this machine, the others use the roofline model), or pass a DeviceSpec"
    )


def spec_for_gpu_name(gpu_name: str) -> DeviceSpec | None:
    """The built-in spec of a GPU as ``torch.cuda.get_device_name`` calls it (``NVIDIA H100 80GB HBM3``), or None."""
    words = gpu_name.lower().replace("-", " ").split()
    for spec in DEVICES.values():
        if spec.name.split("-")[0] in words:
            return spec
    return None
