"""KV cells: llama.cpp pads a cache's cells to a multiple of 256 (docs/llamacpp.md, Memory terms),
and our runtime lays out its cache and its workspace's position buffers the same way."""

CELL_PAD = 256


def pad_cells(n: int) -> int:
    return -(-n // CELL_PAD) * CELL_PAD
