"""Accelerator presets for planning and cost models.

Device memory, peak memory bandwidth and dense bf16 peak from the vendors' data sheets; ``cpu`` is
a nominal preset for the reference engine on a small x86 machine.
See docs/LIBRARY.md, "Models, presets and GPUs".
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.errors import InvalidInputError

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One accelerator."""

    id: str
    name: str
    memory_bytes: int
    bandwidth: float
    bf16_flops: float
    """Peak FLOP/s of the dtype the engine computes in (bf16 on the GPUs, fp32 on ``cpu``)."""


HARDWARE: dict[str, Hardware] = {
    h.id: h
    for h in (
        Hardware("h100-80gb", "NVIDIA H100 SXM 80GB", 81559 * MiB, 3.35e12, 989e12),
        Hardware("h200-141gb", "NVIDIA H200 SXM 141GB", 143771 * MiB, 4.8e12, 989e12),
        Hardware("a100-40gb", "NVIDIA A100 SXM 40GB", 40960 * MiB, 1.555e12, 312e12),
        Hardware("a100-80gb", "NVIDIA A100 SXM 80GB", 81920 * MiB, 2.039e12, 312e12),
        Hardware("l4-24gb", "NVIDIA L4 24GB", 23034 * MiB, 0.3e12, 121e12),
        Hardware("rtx4090-24gb", "NVIDIA GeForce RTX 4090 24GB", 24564 * MiB, 1.008e12, 165e12),
        Hardware("b200-192gb", "NVIDIA B200 192GB", 183359 * MiB, 8.0e12, 2250e12),
        Hardware("cpu", "x86 CPU, 2 cores AVX2 (nominal peaks, fp32)", 16 * GiB, 40e9, 160e9),
    )
}


def get_hardware(name: str) -> Hardware:
    """A preset by id; the error lists the known ids."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise InvalidInputError(f"unknown GPU {name!r}; known: {', '.join(HARDWARE)}") from None
