"""The DiT: config, packed layout, blocks, sampler, tensor/sequence parallel plans, checkpoints, LoRA."""
