"""Activation checkpointing: full and selective recomputation of the blocks (``recompute``, plain torch); and the
technique objects with their cost accounts (``activation_checkpointing``: checkpointing, and ``torch.compile``)."""
