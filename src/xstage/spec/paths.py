"""Store paths: where a kernel's remote stores go.

- `hbm`: local device memory (a loopback group's stand-in for peers, and the control run of a probe);
- `host`: pinned host memory over PCIe, a path with a finite drain rate;
- `peer`: another GPU over NVLink (a real torch.distributed group's symmetric memory).
"""

PATHS = ("hbm", "host", "peer")

__all__ = ["PATHS"]
