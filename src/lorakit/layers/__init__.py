"""LoRA wrappers for linear, fused, embedding and head layers (built on lorakit.ops)."""
