"""The cpu engine's weights in memory of their own: the file's bytes, in a private anonymous
mapping (a shared one is shmem, which takes no transparent huge pages: the same qwen2-1.5B-shaped
decode ran 69-76 ms a token there against 48-50 in a private one)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from cudarun.hostweights import file_in_memory


def mapping_of(address: int) -> str:
    """The /proc/self/smaps header line of the mapping that holds `address`."""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= address < hi:
                return line
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_file_is_read_into_a_private_anonymous_mapping(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "w.bin"
    path.write_bytes(data.tobytes())
    got = file_in_memory(path)
    assert np.array_equal(got, data)
    mapping = mapping_of(got.ctypes.data)
    perms, inode = mapping.split()[1], mapping.split()[4]
    assert perms.endswith("p") and inode == "0", mapping
