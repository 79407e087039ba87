"""The dropout-mask definition of flash_attn/dropout.py (CPU): Philox4x32-10 against the
known-answer vectors of its authors (Random123), the element -> (lane, half) map against the
accumulator fragment layout it is built for, the kept fraction and the independence of
neighbouring elements, and that an element's number depends only on its own coordinates and
the generator state; a positioned state (seed, offset, entry0, row0, col0) draws a window of
the larger attention's mask.
"""

import math
import os

import pytest
import torch

from flash_attn.dropout import (
    at_positions,
    dropout_factor,
    dropout_keep_mask,
    dropout_random16,
    keep_threshold,
    philox4x32_10,
)

# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32_10(torch.tensor([counter], dtype=torch.int64), key)
    assert out[0].tolist() == list(expected)


def test_block_maps_onto_lanes_and_halves_of_the_fragment():
    """In a 16 x 16 block every (lane, half) pair holds exactly one element, and lane 4g + t
    holds rows g and g + 8 and columns 2t, 2t + 1 of each 8-column half (the m16n8 accumulator
    layout of mma.sync and WGMMA), in the order of its registers: (row g, 2t), (g, 2t + 1),
    (g + 8, 2t), (g + 8, 2t + 1), then the same in columns 8-15."""
    r = torch.arange(16).view(-1, 1).expand(16, 16)
    c = torch.arange(16).view(1, -1).expand(16, 16)
    lane = (r % 8) * 4 + (c % 8) // 2
    half = (c // 8) * 4 + (r // 8) * 2 + c % 2
    assert sorted((lane * 8 + half).flatten().tolist()) == list(range(256))
    for g in range(8):
        for t in range(4):
            regs = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
            regs += [(row, col + 8) for row, col in regs]
            for e, (row, col) in enumerate(regs):
                assert lane[row, col] == 4 * g + t and half[row, col] == e


def test_number_depends_on_the_element_only():
    """A sub-range computed on its own equals the same slice of a larger computation, so a
    kernel tile and the reference get the same numbers wherever their loops start."""
    seed, offset = 0x1234_5678_9ABC, 77
    bh = torch.arange(6).view(-1, 1, 1)
    full = dropout_random16(seed, offset, bh, torch.arange(70).view(1, -1, 1),
                            torch.arange(90).view(1, 1, -1))
    part = dropout_random16(seed, offset, bh[2:5], torch.arange(17, 53).view(1, -1, 1),
                            torch.arange(33, 81).view(1, 1, -1))
    assert torch.equal(part, full[2:5, 17:53, 33:81])
    assert full.min() >= 0 and full.max() < 65536


def test_state_and_coordinates_change_the_numbers():
    rows, cols = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    base = dropout_random16(5, 0, torch.tensor(0), rows, cols)
    for other in (dropout_random16(6, 0, torch.tensor(0), rows, cols),
                  dropout_random16(5, 1, torch.tensor(0), rows, cols),
                  dropout_random16(5 + (1 << 32), 0, torch.tensor(0), rows, cols),
                  dropout_random16(5, 0, torch.tensor(1), rows, cols)):
        assert (other != base).float().mean() > 0.99


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p):
    """Over 2 x 4 x 256 x 256 elements the kept fraction is within 5 standard deviations of
    1 - p (quantized to 2^-16)."""
    torch.manual_seed(0)
    mask = dropout_keep_mask(987654321, 3, 2, 4, 256, 256, p)
    n = mask.numel()
    keep = keep_threshold(p) / 65536
    assert abs(keep - (1 - p)) <= 2 ** -17
    sigma = math.sqrt(keep * (1 - keep) / n)
    assert abs(mask.float().mean().item() - keep) < 5 * sigma


def test_numbers_are_uniform_and_neighbours_independent():
    """The top 4 bits spread evenly over 16 bins (chi-square below its 0.999 quantile, 37.7 at
    15 degrees of freedom); neighbouring columns, rows, heads and blocks are uncorrelated."""
    x = dropout_random16(42, 9, torch.arange(4).view(-1, 1, 1), torch.arange(128).view(1, -1, 1),
                         torch.arange(128).view(1, 1, -1)).double()
    counts = torch.bincount((x.long() >> 12).flatten(), minlength=16).double()
    expected = x.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < 37.7
    u = x / 65536 - 0.5

    def corr(a, b):
        return ((a * b).mean() / math.sqrt((a * a).mean() * (b * b).mean())).item()

    limit = 5 / math.sqrt(u.numel() / 2)
    assert abs(corr(u[:, :, 1:], u[:, :, :-1])) < limit  # next column
    assert abs(corr(u[:, 1:], u[:, :-1])) < limit  # next row
    assert abs(corr(u[1:], u[:-1])) < limit  # next head
    assert abs(corr(u[:, :, 16:], u[:, :, :-16])) < limit  # next 16-column block


def _philox_scalar(counter, key):
    """Philox4x32-10 on Python ints, written from the paper's description (independent of the
    module's tensor code)."""
    m = 0xFFFFFFFF
    c, k = list(counter), list(key)
    for rnd in range(10):
        if rnd:
            k = [(k[0] + 0x9E3779B9) & m, (k[1] + 0xBB67AE85) & m]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & m, p1 & m, ((p0 >> 32) ^ c[3] ^ k[1]) & m, p0 & m]
    return c


def _number_scalar(seed, offset, bh, i, j):
    """The module docstring's definition, element by element."""
    r, c = i % 16, j % 16
    lane = (r % 8) * 4 + (c % 8) // 2
    half = (c // 8) * 4 + (r // 8) * 2 + c % 2
    words = _philox_scalar((32 * (j // 16) + lane, i // 16, bh, offset & 0xFFFFFFFF),
                           (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    return (words[half // 2] >> (16 * (half % 2))) & 0xFFFF


def test_tensor_code_matches_the_written_definition():
    """dropout_random16 and dropout_factor (one call per block and lane) against a scalar
    rendering of the docstring's definition at random elements, 62-bit seeds and offsets."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        seed, offset = rng.getrandbits(62), rng.getrandbits(62)
        bh, i, j = rng.randrange(64), rng.randrange(5000), rng.randrange(5000)
        want = _number_scalar(seed, offset, bh, i, j)
        got = dropout_random16(seed, offset, torch.tensor(bh), torch.tensor(i), torch.tensor(j))
        assert int(got) == want
    seed, offset, p = 0x2F00_1234_ABCD, 3, 0.4
    nheads, entry0 = 3, 2
    factor = dropout_factor(torch.tensor([seed, offset]), p, entry0, 2, nheads, 21, 35,
                            torch.float64)
    for _ in range(200):
        e, h, i, j = rng.randrange(2), rng.randrange(nheads), rng.randrange(21), rng.randrange(35)
        kept = _number_scalar(seed, offset, (entry0 + e) * nheads + h, i, j) < keep_threshold(p)
        assert factor[e, h, i, j].item() == (1 / (1 - p) if kept else 0.0)


def test_positioned_state_draws_a_window_of_the_larger_mask():
    # Fresh positions each run (row0, col0 multiples of 16): the call's factor must be the
    # slice of the larger call's at those positions.
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    entry0, row0, col0 = (int(torch.randint(0, 8, (1,), generator=gen)) * m for m in (1, 16, 16))
    state = torch.tensor([int(torch.randint(0, 2 ** 62, (1,), generator=gen)), 5])
    b, h, sq, sk, p = 2, 3, 37, 50, 0.35
    full = dropout_factor(state, p, 0, entry0 + b, h, row0 + sq, col0 + sk, torch.float64)
    part = dropout_factor(at_positions(state, entry0, row0, col0), p, 0, b, h, sq, sk,
                          torch.float64)
    assert torch.equal(part, full[entry0:, :, row0:, col0:])
    # Entry offsets add to the call's own entries (the reference's varlen sequences).
    one = dropout_factor(at_positions(state, entry0, row0, col0), p, 1, 1, h, sq, sk,
                         torch.float64)
    assert torch.equal(one, full[entry0 + 1:entry0 + 2, :, row0:, col0:])


@pytest.mark.parametrize("entry0,row0,col0", [(0, 8, 0), (0, 0, 24), (-1, 0, 0), (0, -16, 0)])
def test_positions_off_the_grid_are_rejected(entry0, row0, col0):
    with pytest.raises(ValueError, match="multiples of 16"):
        at_positions(torch.tensor([1, 2]), entry0, row0, col0)
    bad = torch.tensor([1, 2, entry0, row0, col0])
    with pytest.raises(ValueError, match="multiples of 16"):
        dropout_factor(bad, 0.1, 0, 1, 1, 16, 16, torch.float64)
