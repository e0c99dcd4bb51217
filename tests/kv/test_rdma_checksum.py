"""The RDMA transport's per-block checksum against a plain-Python reference (no transfer engine needed)."""

import struct

import pytest
import torch

from engine.kv.rdma import BlockChecksum

def reference(rows: list[bytes]) -> int:
    """One block given as its row in each layer: a polynomial hash of the rows' signed 16-bit words (each
    row zero-padded to whole chunks) at each base modulo the prime, the bases' hashes side by side."""
    chunk_bytes = 2 * BlockChecksum.CHUNK
    data = b"".join(r + bytes(-len(r) % chunk_bytes) for r in rows)
    words = struct.unpack(f"<{len(data) // 2}h", data)
    p = BlockChecksum.PRIME
    lanes = [sum(w * pow(base, i + 1, p) for i, w in enumerate(words)) % p for base in BlockChecksum.BASES]
    return lanes[0] << 42 | lanes[1] << 21 | lanes[2]


@pytest.mark.parametrize("dtype, shape", [(torch.bfloat16, (4, 8)), (torch.float32, (2, 3)),
                                          (torch.float8_e4m3fn, (3, 3)),  # 9-byte rows: odd padding
                                          (torch.bfloat16, (40, 32))])  # rows of two chunks
def test_checksums_match_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    pulled = torch.randn(5, 3, *shape, generator=gen).to(dtype)  # [k, layers, ...]
    expected = [reference([bytes(pulled[i, layer].contiguous().view(torch.uint8).flatten().tolist())
                           for layer in range(3)]) for i in range(5)]
    assert BlockChecksum()(pulled) == expected
    assert len(set(expected)) == 5


def test_every_single_bit_flip_changes_the_checksum():
    gen = torch.Generator().manual_seed(2)
    block = torch.randn(1, 3, 2, 4, generator=gen)  # 96 bytes
    raw = block.view(torch.uint8).flatten()
    flipped = raw.repeat(raw.numel() * 8, 1)  # one copy per bit, that bit flipped
    bits = torch.arange(raw.numel() * 8)
    flipped[bits, bits // 8] ^= (1 << (bits % 8)).to(torch.uint8)
    variants = flipped.view(torch.float32).view(-1, *block.shape[1:])
    checksum = BlockChecksum()
    original = checksum(block)[0]
    assert original not in checksum(variants)


def test_large_pulls_are_hashed_in_chunks_with_the_same_result():
    gen = torch.Generator().manual_seed(3)
    pulled = torch.randn(9, 2, 40, 32, generator=gen)  # 5120-byte rows: 2.5 chunks, padded to 3
    whole, chunked = BlockChecksum(), BlockChecksum()
    chunked.STEP_BYTES = 2 * 2 * 5120  # two blocks per step
    assert whole(pulled) == chunked(pulled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checksums_on_the_gpu_equal_those_on_the_host():
    gen = torch.Generator().manual_seed(4)
    pulled = torch.randn(6, 5, 16, 576, generator=gen).to(torch.bfloat16)
    checksum = BlockChecksum()
    assert checksum(pulled.cuda()) == checksum(pulled)
