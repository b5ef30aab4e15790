"""Lossless compression of uint8 arrays (camera frames) for data that crosses nodes: Zstandard at level 1, through
the `zstandard` package (a binding of the reference C library; `zlib`, the standard library's, compressed the same
rows 1.8x at 44 MB/s, too slow to pay).

Measured on the ManiSkill3 pixel rows of both cameras at 64x64 (docs/results/vla.md, 2026-12-06): 2.15x, 306 MB/s
to compress and 613 MB/s to decompress on one core of this project's machine, so it pays where a link moves less than
about 2.5 Gb/s; on one node the object store shares memory and compressing would only cost time.

Two forms: `compress(array) -> Compressed` and `inflate(x)` for a message the receiver knows may carry one (the
env worker's observations in its requests to a policy worker on another node), and a channel created with
`compress=True`, which compresses every uint8 array or tensor of at least `MIN_BYTES` as it pickles an item and
inflates it on the other side (runtime/channel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_BYTES = 16 * 1024  # smaller arrays travel as they are (a 48x48 frame is 6.9 kB): the call costs more
LEVEL = 1


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # a dependency of m2flow: only a broken environment lacks it
        raise ImportError("compressing frames needs the zstandard package: pip install zstandard") from e
    return zstandard


@dataclass(frozen=True)
class Compressed:
    """An array's bytes, compressed: `inflate` gives the array back."""
    data: bytes
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        return len(self.data)


def compress(array: np.ndarray) -> Compressed:
    a = np.ascontiguousarray(array)
    return Compressed(_zstd().ZstdCompressor(level=LEVEL).compress(a.data), a.dtype.str, a.shape)


def unpack(data, dtype, shape: tuple) -> np.ndarray:
    """The array whose bytes `data` (any buffer) holds compressed: writable."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = _zstd().ZstdDecompressor().decompress(data, max_output_size=size)
    return np.frombuffer(bytearray(raw), dtype).reshape(shape)


def inflate(x):
    """The array of a `Compressed` (writable), anything else as it is."""
    return unpack(x.data, x.dtype, x.shape) if isinstance(x, Compressed) else x


def compressible(array) -> bool:
    """A uint8 numpy array or torch tensor of at least MIN_BYTES: what a compressing channel compresses."""
    return str(getattr(array, "dtype", "")) in ("uint8", "torch.uint8") and array.nbytes >= MIN_BYTES
