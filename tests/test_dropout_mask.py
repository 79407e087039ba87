"""The dropout-mask definition of flash_attn/dropout.py (CPU): Philox4x32-10 against the
known-answer vectors of its authors (Random123), the element -> (lane, half) map against the
accumulator fragment layout it is built for, the kept fraction and the independence of
neighbouring elements, and that an element's number depends only on its own coordinates and
the generator state.
"""

import math

import pytest
import torch

from flash_attn.dropout import (
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
