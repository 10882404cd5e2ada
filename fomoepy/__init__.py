"""fomoepy: Mixture-of-Experts inference with experts streamed from NVMe through DRAM and VRAM caches."""

__version__ = "0.1.0"
