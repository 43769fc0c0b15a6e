"""A stand-in for vLLM's paged KV in the staging tests that run a real
LMCache engine without vLLM: a store writes a pattern derived from the
chunk's token start (the reference a load is compared with), a load records
the bytes it was given."""

from __future__ import annotations

import torch

from lmcache_ascend.planning.groups import ChunkRequest


def pattern(start: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(start + 1)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


class PatternKV:
    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.loaded: dict[int, torch.Tensor] = {}

    def pattern(self, start: int) -> torch.Tensor:
        return pattern(start, self.chunk_bytes)

    def store(self, buf: torch.Tensor, req: ChunkRequest) -> None:
        buf[: self.chunk_bytes].copy_(self.pattern(req.start))

    def load(self, buf: torch.Tensor, req: ChunkRequest) -> None:
        self.loaded[req.start] = buf[: self.chunk_bytes].clone()
