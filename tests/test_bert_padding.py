import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input


def random_mask(batch, seqlen, lengths=None):
    if lengths is None:
        lengths = torch.randint(0, seqlen + 1, (batch,))
    lengths = torch.as_tensor(lengths)
    return torch.arange(seqlen)[None, :] < lengths[:, None], lengths


@pytest.mark.parametrize("trailing", [(), (3,), (2, 4)])
def test_unpad_pad_round_trip(trailing):
    torch.manual_seed(0)
    b, s = 4, 7
    x = torch.randn(b, s, *trailing)
    mask, lengths = random_mask(b, s, [7, 0, 3, 5])
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert x_unpad.shape == (int(mask.sum()), *trailing)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 7, 7, 10, 15]
    assert isinstance(max_seqlen, int) and max_seqlen == 7
    assert seqused.dtype == torch.int32 and seqused.tolist() == [7, 0, 3, 5]
    assert indices.tolist() == torch.nonzero(mask.flatten()).flatten().tolist()
    torch.testing.assert_close(x_unpad, x[mask])
    y = pad_input(x_unpad, indices, b, s)
    assert y.shape == x.shape
    torch.testing.assert_close(y[mask], x[mask])
    assert torch.all(y[~mask] == 0)


def test_unpad_int_mask_and_unused_mask():
    torch.manual_seed(1)
    b, s = 3, 6
    x = torch.randn(b, s, 5)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    x_unpad, indices, cu, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 8, 9]
    assert max_seqlen == 4
    assert seqused.tolist() == [2, 4, 0]
    assert indices.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12]
    torch.testing.assert_close(x_unpad, x.reshape(-1, 5)[indices])


def test_gradients_flow():
    torch.manual_seed(2)
    b, s = 3, 5
    x = torch.randn(b, s, 4, requires_grad=True)
    mask, _ = random_mask(b, s, [5, 2, 4])
    x_unpad, indices, *_ = unpad_input(x, mask)
    g = torch.randn_like(x_unpad)
    x_unpad.backward(g)
    expected = torch.zeros_like(x)
    expected[mask] = g
    torch.testing.assert_close(x.grad, expected)

    h = torch.randn(int(mask.sum()), 4, requires_grad=True)
    y = pad_input(h, indices, b, s)
    gy = torch.randn_like(y)
    y.backward(gy)
    torch.testing.assert_close(h.grad, gy[mask])


def test_gradcheck_index_functions():
    torch.manual_seed(3)
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, idx), (x,))
    vals = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, idx, 6), (vals,))
    out = index_put_first_axis(vals, idx, 6)
    assert out.shape == (6, 2) and torch.all(out[[1, 3, 5]] == 0)
    torch.testing.assert_close(out[idx], vals)


def test_unpad_varlen_attention_matches_padded():
    """End to end: varlen attention on unpadded tokens == per-sequence batched attention."""
    torch.manual_seed(4)
    b, s, h, d = 3, 6, 2, 8
    mask, lengths = random_mask(b, s, [6, 3, 1])
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    q_u, idx, cu, max_s, _ = unpad_input(q, mask)
    k_u, _, _, _, _ = unpad_input(k, mask)
    v_u, _, _, _, _ = unpad_input(v, mask)
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True)
    out = pad_input(out_u, idx, b, s)
    for i, n in enumerate(lengths.tolist()):
        ref = flash_attn_func(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], causal=True)
        torch.testing.assert_close(out[i:i + 1, :n], ref)
        assert torch.all(out[i, n:] == 0)
