"""The GPUs a deployment can be forecast on, at their published figures (dense tensor FLOP/s, no sparsity).

Sources (vendor datasheets): H100 / H800 / H200 — NVIDIA H100 and H200 Tensor Core GPU datasheets (SXM: 989 TFLOP/s
BF16, 1,979 FP8 dense; 3.35 TB/s HBM3 on 80 GB, 4.8 TB/s HBM3e on 141 GB; NVLink 900 GB/s, H800's cut to 400 GB/s);
B200 / B300 — the HGX B200 / B300 datasheets (B200: 180 GB HBM3e at 8 TB/s, 2.25 PFLOP/s BF16, 4.5 FP8, 9 FP4
dense; B300 (Blackwell Ultra): 288 GB, 8 TB/s, the same BF16 / FP8 and 1.5x the FP4, 13.5 dense; NVLink 5 at
1.8 TB/s); GB200 — the GB200 NVL72 datasheet per GPU (186 GB HBM3e at 8 TB/s, 2.5 PFLOP/s BF16, 5 FP8, 10 FP4 dense,
72 GPUs in one NVLink domain). NVLink figures are bidirectional; a transfer moves at half. Scale-out: one
ConnectX-7 400 Gb/s NIC per GPU (50 GB/s) on Hopper and HGX B200, ConnectX-8 800 Gb/s (100 GB/s) on B300 and GB200.
The datasheets themselves were not re-read here (assumed as recalled); what could be read agrees: DeepEP's README
puts H800's NVLink at ~160 GB/s achievable (docs/legacy.md), a 400 Gb/s CX7 at ~50 GB/s; third-party summaries of
the HGX B300 sheet (glennklockwood.com/garden/processors/B300; fibermall's HGX B300 / B200 table) give B300 288 GB,
8 TB/s, 2.25 PFLOP/s BF16 dense, ~13 PFLOP/s FP4 dense (13.5 taken) against B200's 9.
"""

from __future__ import annotations

from dataclasses import dataclass

TB = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    flops: dict[str, float]  # compute dtype → dense FLOP/s ("fp4" only where tensor cores run it)
    nvlink_bytes_per_s: float  # bidirectional, per GPU
    network_bytes_per_s: float  # scale-out NIC per GPU, one direction
    gpus_per_node: int  # the unit "per node" figures are quoted in
    nvlink_domain: int  # GPUs one NVLink fabric joins

    @property
    def nvlink_one_way(self) -> float:
        return self.nvlink_bytes_per_s / 2

    def peak(self, dtype: str) -> float:
        """FLOP/s for a compute dtype; fp4 falls back to fp8 where the tensor cores have no FP4 (Hopper)."""
        if dtype == "fp4" and "fp4" not in self.flops:
            dtype = "fp8"
        return self.flops[dtype]


def _hopper(name: str, hbm_gb: float, tbps: float, nvlink_gbps: float) -> GPU:
    return GPU(name, hbm_gb * 1e9, tbps * TB, {"bf16": 989e12, "fp8": 1979e12}, nvlink_gbps * 1e9, 50e9, 8, 8)


GPUS: dict[str, GPU] = {
    "h800": _hopper("h800", 80, 3.35, 400),
    "h100": _hopper("h100", 80, 3.35, 900),
    "h200": _hopper("h200", 141, 4.8, 900),
    "b200": GPU("b200", 180e9, 8 * TB, {"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12}, 1800e9, 50e9, 8, 8),
    "b300": GPU("b300", 288e9, 8 * TB, {"bf16": 2250e12, "fp8": 4500e12, "fp4": 13500e12}, 1800e9, 100e9, 8, 8),
    "gb200": GPU("gb200", 186e9, 8 * TB, {"bf16": 2500e12, "fp8": 5000e12, "fp4": 10000e12}, 1800e9, 100e9, 4, 72),
}
GPU_NAMES = tuple(GPUS)


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"--gpu {name!r}: expected one of {', '.join(GPU_NAMES)}") from None
