"""Helpers to go between padded batches ``(batch, seqlen, ...)`` and the packed ("unpadded")
layout ``(total_nnz, ...)`` used by the varlen functions."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
    "pad_input",
]


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along the first axis; the backward scatters into zeros."""

    @staticmethod
    def forward(ctx, input: Tensor, indices: Tensor) -> Tensor:
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        # index_select on a 2-D view is faster than advanced indexing with trailing dims.
        flat = input.reshape(input.shape[0], -1)
        out = torch.index_select(flat, 0, indices)
        return out.reshape(indices.shape[0], *input.shape[1:])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (indices,) = ctx.saved_tensors
        rest = grad_output.shape[1:]
        grad_flat = grad_output.reshape(grad_output.shape[0], -1)
        grad_input = grad_flat.new_zeros(ctx.first_axis_dim, grad_flat.shape[1])
        grad_input.index_copy_(0, indices, grad_flat)
        return grad_input.reshape(ctx.first_axis_dim, *rest), None


index_first_axis = IndexFirstAxis.apply


class IndexPutFirstAxis(torch.autograd.Function):
    """``out = zeros(first_axis_dim, ...); out[indices] = values``; the backward gathers."""

    @staticmethod
    def forward(ctx, values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
        ctx.save_for_backward(indices)
        if indices.dim() != 1:
            raise ValueError(f"index_put_first_axis: indices must be 1-D, got {indices.dim()}-D")
        out = values.new_zeros(first_axis_dim, *values.shape[1:])
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


index_put_first_axis = IndexPutFirstAxis.apply


class IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input.detach())``: the gathered rows and the whole input as a
    residual. The backward adds the gathered rows' gradient into the residual's gradient at
    their indices (a residual branch that keeps every row while the rest of a layer runs on
    the selected ones)."""

    @staticmethod
    def forward(ctx, input: Tensor, indices: Tensor):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        # Indexing rather than a flattening gather: input may be non-contiguous (e.g. channels
        # last), and a reshape would copy it.
        output = input[indices]
        # The residual is detached so that autograd sees a fresh output, not a view of the
        # input that later in-place ops could invalidate; its gradient comes back through this
        # Function's backward.
        return output, input.detach()

    @staticmethod
    def backward(ctx, grad_output: Tensor, grad_residual: Tensor):
        (indices,) = ctx.saved_tensors
        if grad_residual.shape[1:] != grad_output.shape[1:]:
            raise ValueError(
                f"index_first_axis_residual: gradients of shapes {tuple(grad_output.shape)} and "
                f"{tuple(grad_residual.shape)} differ past the first axis")
        # Out of place: grad_residual may be shared with other consumers.
        grad_input = grad_residual.index_add(0, indices, grad_output)
        return grad_input, None


index_first_axis_residual = IndexFirstAxisResidual.apply


def unpad_input(
    hidden_states: Tensor, attention_mask: Tensor, unused_mask: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """
    Arguments:
        hidden_states: (batch, seqlen, ...)
        attention_mask: (batch, seqlen), bool / int, 1 means valid and 0 means not valid.
        unused_mask: (batch, seqlen), bool / int, 1 means the element is allocated but unused.
    Return:
        hidden_states: (total_nnz, ...), where total_nnz = number of tokens selected in
            attention_mask + unused_mask.
        indices: (total_nnz), the indices of the selected tokens in the flattened
            (batch * seqlen) input sequence.
        cu_seqlens: (batch + 1), int32, the cumulative sequence lengths, used to index into
            hidden_states.
        max_seqlen_in_batch: int
        seqused: (batch), int32, the number of tokens selected in attention_mask (without the
            unused tokens).
    """
    selected = attention_mask.bool()
    if unused_mask is not None:
        selected = selected | unused_mask.bool()
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens.max().item()) if seqlens.numel() > 0 else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return (
        index_first_axis(flat, indices),
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
        seqused,
    )


def unpad_input_for_concatenated_sequences(
    hidden_states: Tensor, attention_mask_in_length: Tensor
) -> Tuple[Tensor, Tensor, Tensor, int]:
    """Unpad a batch whose rows each hold several short samples packed one after the other
    from the row's start (supervised fine-tuning with packing): each sample becomes its own
    varlen sequence, so attention does not cross samples.

    attention_mask_in_length row b lists the lengths of row b's samples, in order, then zeros.
    With batch = 3 and seqlen = 6::

        [[2, 3, 0, 0, 0, 0],    row 0: samples of 2 and 3 tokens, then 1 padding token
         [3, 2, 0, 0, 0, 0],    row 1: samples of 3 and 2 tokens, then 1 padding token
         [6, 0, 0, 0, 0, 0]]    row 2: one sample of 6 tokens

    gives the 5 sequences of lengths 2, 3, 3, 2, 6: cu_seqlens = [0, 2, 5, 8, 10, 16].

    Arguments:
        hidden_states: (batch, seqlen, ...)
        attention_mask_in_length: (batch, seqlen), int: the lengths of each row's samples
            (nonzero entries, in order), zeros elsewhere. Row b's samples cover its first
            sum(attention_mask_in_length[b]) tokens.
    Return:
        hidden_states: (total_nnz, ...), the tokens of all samples, total_nnz =
            attention_mask_in_length.sum().
        indices: (total_nnz), the indices of those tokens in the flattened (batch * seqlen)
            input sequence.
        cu_seqlens: (num_samples + 1), int32, the cumulative sample lengths.
        max_seqlen_in_batch: int, the longest sample.
    """
    seqlen = attention_mask_in_length.shape[-1]
    row_lengths = attention_mask_in_length.sum(dim=-1)
    positions = torch.arange(seqlen, device=attention_mask_in_length.device)
    covered = positions[None, :] < row_lengths[:, None]
    flat_lengths = attention_mask_in_length.flatten()
    seqlens = flat_lengths[torch.nonzero(flat_lengths, as_tuple=False).flatten()]
    indices = torch.nonzero(covered.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens.max().item()) if seqlens.numel() > 0 else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """
    Arguments:
        hidden_states: (total_nnz, ...), where total_nnz = number of tokens selected in
            attention_mask.
        indices: (total_nnz), the indices that represent the non-masked tokens of the original
            padded input sequence.
        batch: int, batch size for the padded sequence.
        seqlen: int, maximum sequence length for the padded sequence.
    Return:
        hidden_states: (batch, seqlen, ...), zeros at the padded positions.
    """
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
