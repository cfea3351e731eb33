"""Kiln: Qwen3.5 LoRA SFT service."""
