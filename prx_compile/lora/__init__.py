"""LoRA: adapters fused into the transformer's weights, eager or compiled, exact to unload
(``adapters``: reading PEFT and kohya files, fuse/unfuse, engine refit, the saved LoRA state;
``diffusers``: diffusers' LoRA methods on a compiled transformer, over those adapters)."""

from .adapters import (
    Adapter,
    LoRALayer,
    LoRAState,
    export_state,
    load_lora,
    make_random_lora,
    parse_lora,
    read_lora_file,
    restore_state,
    set_lora,
    summary,
    unload_lora,
)

__all__ = [
    "Adapter",
    "LoRALayer",
    "LoRAState",
    "export_state",
    "load_lora",
    "make_random_lora",
    "parse_lora",
    "read_lora_file",
    "restore_state",
    "set_lora",
    "summary",
    "unload_lora",
]
