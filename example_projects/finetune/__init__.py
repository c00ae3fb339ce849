"""Fine-tuning a Hugging Face causal LM with PEFT LoRA under lightning_par strategies: a base model pre-trained on
Python code (``prepare.py``), adapted to Python's reference documentation (``train.py`` and its YAML configs)."""
