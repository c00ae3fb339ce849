"""A small character-level GPT trained with LightningCLI under lightning_par strategies."""
