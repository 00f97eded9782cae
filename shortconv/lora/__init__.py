"""Multi-LoRA: PEFT adapters read from their files, held in per-layer slots, applied per row."""
