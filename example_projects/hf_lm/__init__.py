"""A Hugging Face causal language model (built from a config, no download) trained with LightningCLI under
lightning_par strategies: the model is transformers' own, unchanged."""
