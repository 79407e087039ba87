"""FlashAttention-2's ``flash_attn.layers`` namespace. Of its modules only
:mod:`flash_attn.layers.rotary` is provided."""
