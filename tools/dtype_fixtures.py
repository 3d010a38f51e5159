#!/usr/bin/env python3
"""Writes tests/fixtures/dtype_round_trips.json: f32 values (as bits) chosen to cross every
rounding case of f32 -> float16 and f32 -> bfloat16 (ties both ways, subnormals, the edges of
float16's range, inf, NaN, f32 subnormals, random values over 60 binades), and torch's
`.half()` and `.bfloat16()` of each, as 16-bit patterns. tests/dtypes.rs checks wgrad's casts
against them bit for bit.

    pip install torch && python3 tools/dtype_fixtures.py
"""
import json
import pathlib
import struct

import torch

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dtype_round_trips.json"


def f32_bits(values):
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def main():
    bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
            0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000]
    specials = [65504.0, 65519.0, 65519.996, 65520.0, 65536.0, -65520.0, 1e10, 6.103515625e-05,
                6.097555e-05, 5.960464477539063e-08, 2.9802322387695312e-08, 2.98023259e-08,
                1e-8, -1e-8, 0.1, -0.1, 1.0 / 3.0, 3.14159265]
    bits += f32_bits(specials)
    # float16 ties: halfway between neighbouring halves, both parities, normal and subnormal.
    for h in [0x0001, 0x0002, 0x03FE, 0x03FF, 0x0400, 0x0401, 0x3C00, 0x3C01, 0x7BFE, 0x5555]:
        lo = torch.tensor([h], dtype=torch.int16).view(torch.float16).float().item()
        hi = torch.tensor([h + 1], dtype=torch.int16).view(torch.float16).float().item()
        bits += f32_bits([(lo + hi) / 2, -(lo + hi) / 2])
    # bfloat16 ties and near-ties.
    for b in [0x3F800000, 0x3F810000, 0x7F7F0000, 0x00010000, 0x40490000]:
        bits += [b | 0x8000, b | 0x7FFF, b | 0x8001, (b | 0x8000) ^ 0x80000000]
    gen = torch.Generator().manual_seed(0)
    for e in range(-40, 20):
        bits += f32_bits((torch.randn(6, generator=gen) * 2.0 ** e).tolist())
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    f16 = x.half().view(torch.int16).to(torch.int32) & 0xFFFF
    bf16 = x.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
    OUT.write_text(json.dumps({
        "torch": torch.__version__,
        "f32": bits,
        "f16": f16.tolist(),
        "bf16": bf16.tolist(),
    }) + "\n")
    print(f"wrote {OUT} ({len(bits)} values, torch {torch.__version__})")


if __name__ == "__main__":
    main()
