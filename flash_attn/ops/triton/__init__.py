"""FlashAttention-2's ``flash_attn.ops.triton`` namespace. Of its modules only
:mod:`flash_attn.ops.triton.rotary` is provided, written in plain PyTorch (no Triton needed)."""
