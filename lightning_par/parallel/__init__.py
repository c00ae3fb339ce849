"""Parallel techniques on plain torch.distributed, one module each, usable without Lightning."""
