"""LoRA wrappers for linear, embedding and head layers, and ``patch`` that puts them into a model.

Built on ``lorakit.ops``, with adapters read by ``lorakit.peft``; knows nothing of the engine.
"""

from lorakit.layers.context import LoraContext
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.linear import LoraLinear
from lorakit.layers.handle import LoraHandle
from lorakit.layers.patch import PatchConfig, patch
from lorakit.layers.quant import Fp8Linear, Int4Linear, QuantizedLinear, quantize
from lorakit.layers.slot_table import SlotTable

__all__ = ["Fp8Linear", "Int4Linear", "LoraContext", "LoraEmbedding", "LoraHandle", "LoraLinear", "PatchConfig",
           "QuantizedLinear", "SlotTable", "patch", "quantize"]
