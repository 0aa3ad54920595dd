"""LoRA adapters served beside their base model (S-LoRA / Punica's shape): PEFT folders read
and checked against the model (adapters.py), a few resident at once in per-layer slots, and
each step's rows grouped by adapter for two small matmuls per group (slots.py)."""
