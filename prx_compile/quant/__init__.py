"""Quantisation: ``fp8`` (``precision: fp8``) swaps the transformer blocks' linears for FP8 GEMMs before
export, and re-quantises them in place after their weights change (LoRA)."""
