"""Quantized collectives on torch.distributed process groups (through deepspeed.comm); no DeepSpeed engines."""
