"""The text encoder: Qwen3-VL conditioner, its vision tower, tokenizer and checkpoints."""
