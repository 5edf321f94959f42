"""The GPUs vapo-plan's step-time model knows (sizing/step_time.py): datasheet rates, and the links
between GPUs. Pure Python; nothing here was measured.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- the GPUs --------------------------------------------------------------------------------------
# Rates per GPU, one direction, bytes/s and FLOP/s. NVIDIA quotes tensor FLOP/s "with sparsity"
# (2:4) as the headline; the dense rate, used here, is half of it. Link rates are quoted
# bidirectional; one direction is half.


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense BF16 tensor-core peak
    hbm_bytes_s: float  # memory bandwidth
    nvlink_bytes_s: float  # NVLink, per GPU, one direction
    network_bytes_s: float  # the inter-node fabric, per GPU, one direction
    host_bytes_s: float  # host <-> device, one direction (PCIe; NVLink-C2C on GB200)
    memory_gib: float  # vapo-plan's default --gpu-memory-gib with --gpu
    # GPUs one NVLink domain spans; None: the node (--gpus-per-node). GB200 NVL72: a rack of 72.
    nvlink_domain: int | None = None


GPUS = {
    # H100 SXM5 80GB. NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 TFLOPS
    # with sparsity, 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both bidirectional). Network:
    # DGX H100 user guide, 8 x ConnectX-7 400 Gb/s (one per GPU) for the compute fabric.
    "h100": GPU("H100 SXM 80GB", 989e12, 3.35e12, 450e9, 50e9, 64e9, 80.0),
    # H200 SXM 141GB. NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 1,979 TFLOPS
    # with sparsity, 4.8 TB/s HBM3e, NVLink 900 GB/s, PCIe Gen5 128 GB/s. DGX H200: 8 x ConnectX-7
    # 400 Gb/s. Memory: 141 GB = 131.3 GiB (the datasheet's GB; --gpu-memory-gib gives the exact one).
    "h200": GPU("H200 SXM 141GB", 989e12, 4.8e12, 450e9, 50e9, 64e9, 131.3),
    # A100 SXM4 80GB. NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS
    # dense (624 with sparsity), 2,039 GB/s HBM2e, NVLink 600 GB/s, PCIe Gen4 64 GB/s. DGX A100 user
    # guide: 8 x ConnectX-6 200 Gb/s for the compute fabric.
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 300e9, 25e9, 32e9, 80.0),
    # B200 (HGX/DGX B200). NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx): per
    # 8 GPUs FP16/BF16 36 PFLOPS with sparsity, 64 TB/s HBM3e and 1.44 TB of it, NVLink 5 at
    # 1.8 TB/s per GPU. DGX B200 datasheet: 8 x ConnectX-7 400 Gb/s, PCIe Gen5 hosts.
    # Memory: 180 GB = 167.6 GiB.
    "b200": GPU("B200 180GB", 2.25e15, 8.0e12, 900e9, 50e9, 64e9, 167.6),
    # GB200 NVL72. NVIDIA GB200 NVL72 specifications (nvidia.com/en-us/data-center/gb200-nvl72): per
    # 72 GPUs FP16/BF16 360 PFLOPS with sparsity, 576 TB/s and 13.4 TB HBM3e, NVLink 130 TB/s
    # (1.8 TB/s per GPU) across the whole rack; NVLink-C2C 900 GB/s bidirectional between one Grace
    # CPU and its two GPUs (225 GB/s per GPU one way). One ConnectX-7 400 Gb/s per GPU for the
    # fabric between racks. Memory: 186 GB = 173.2 GiB.
    "gb200": GPU("GB200 NVL72", 2.5e15, 8.0e12, 900e9, 50e9, 225e9, 173.2, nvlink_domain=72),
}

# Achieved share of a link's rate by NCCL collectives and of the host link by pinned copies.
LINK_EFFICIENCY = 0.8


# ---- links --------------------------------------------------------------------------------------------


def on_nvlink(gpu: GPU, span: int, gpus_per_node: int, world: int) -> bool:
    """Whether every group of ranks `span` consecutive global ranks wide (megatron's order: TP
    fastest, then DP, then PP), of `world` ranks, stays within one NVLink domain.

    The groups are the blocks [k * span, (k + 1) * span) and a domain holds D consecutive ranks (D:
    the GPU's NVLink domain, else the node). A block fits one domain only when no domain boundary
    falls inside it: span <= D is not enough, because with D not a multiple of span some block
    straddles two domains once there are ranks past the first (7 GPUs per node: the TP=2 group of
    ranks 6 and 7 spans two nodes). So: span divides D, or all `world` ranks sit in one domain."""
    domain = gpu.nvlink_domain or gpus_per_node
    return span <= domain and (domain % span == 0 or world <= domain)


def link_bytes_s(gpu: GPU, span: int, gpus_per_node: int, world: int) -> float:
    """What a collective over such a group achieves per GPU: NVLink inside the domain, else the network."""
    rate = gpu.nvlink_bytes_s if on_nvlink(gpu, span, gpus_per_node, world) else gpu.network_bytes_s
    return rate * LINK_EFFICIENCY


def host_copy_s(gpu: GPU, nbytes: float) -> float:
    """Pinned copies between host and device memory, one direction."""
    return nbytes / (gpu.host_bytes_s * LINK_EFFICIENCY)


def gpu_from_device_name(name: str) -> GPU | None:
    """The GPU of torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3", "NVIDIA GB200", ...), None when
    this model has no rates for it."""
    upper = name.upper()
    for key in ("gb200", "b200", "h200", "h100", "a100"):  # GB200 before B200: the longer name first
        if key.upper() in upper:
            if key == "a100" and "40GB" in upper:
                return None  # the 40 GB part has less memory bandwidth
            return GPUS[key]
    return None


__all__ = ["GPU", "GPUS", "LINK_EFFICIENCY", "gpu_from_device_name", "host_copy_s", "link_bytes_s", "on_nvlink"]
