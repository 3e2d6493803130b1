"""PEFT LoRA adapter folders: read, checked against the model's modules, and normalized to what lorakit serves.

The ground floor: nothing here imports the rest of lorakit. A file lorakit cannot serve exactly as PEFT would is
refused with ``AdapterError``, the one adapter error type, naming the adapter, the module and the fix.
"""

from lorakit.peft.adapter import AdapterInfo, BaseModule, ModuleLora, ModuleTokens, PeftAdapter, activation_start
from lorakit.peft.config import CONFIG_NAME, WEIGHTS_NAME, AdapterError, read_adapter_config
from lorakit.peft.read import (check_values, inspect_peft_adapter, load_peft_adapter, plan_state_dict,
                               read_state_dict, take_state_dict, weights_file)

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "AdapterError", "AdapterInfo", "BaseModule", "ModuleLora", "ModuleTokens",
           "PeftAdapter", "activation_start", "inspect_peft_adapter", "load_peft_adapter", "read_adapter_config",
           "check_values", "plan_state_dict", "read_state_dict", "take_state_dict", "weights_file"]
