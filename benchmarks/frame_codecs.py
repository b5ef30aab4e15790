"""Lossless codecs on pixel observations (issue 70: frames compressed between nodes): the ratio and the speed of
Zstandard (m2flow's, `cluster.compress_frames`), LZ4 (if installed) and zlib on the packed observation rows of a pixel
demonstration dataset, one core, medians of `--reps`. Prints a table; asserts nothing.

    m2flow demos PickCube-v1 -n 60 --pixels --wrist-camera --out D
    python benchmarks/frame_codecs.py D [--rows 800] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib

import numpy as np
import zstandard


def codecs() -> dict:
    out = {f"zstd {level}": (zstandard.ZstdCompressor(level=level).compress, zstandard.ZstdDecompressor().decompress)
           for level in (1, 3)}
    try:
        import lz4.frame

        out["lz4"] = (lambda b: lz4.frame.compress(b, compression_level=0), lz4.frame.decompress)
    except ImportError:
        pass
    out["zlib 1"] = (lambda b: zlib.compress(b, 1), zlib.decompress)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("demos", help="an `m2flow demos --pixels` directory")
    p.add_argument("--rows", type=int, default=800)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    data = np.ascontiguousarray(np.load(os.path.join(args.demos, "demos.npz"))["obs"][:args.rows]).tobytes()
    mb = len(data) / 1e6
    print(f"{args.rows} rows, {mb:.1f} MB, load {os.getloadavg()[0]:.1f}\n")
    print("| codec | ratio | compress MB/s | decompress MB/s |\n| --- | ---: | ---: | ---: |")
    for name, (compress, decompress) in codecs().items():
        seconds = {"c": [], "d": []}
        for _ in range(args.reps):
            t = time.perf_counter()
            packed = compress(data)
            seconds["c"].append(time.perf_counter() - t)
            t = time.perf_counter()
            back = decompress(packed)
            seconds["d"].append(time.perf_counter() - t)
            assert back == data, name
        print(f"| {name} | {len(data) / len(packed):.2f}x | {mb / statistics.median(seconds['c']):.0f} | "
              f"{mb / statistics.median(seconds['d']):.0f} |")


if __name__ == "__main__":
    main()
