"""QLoRA's 4-bit base weights: the blocks' frozen linear weights as torchao NF4 (``nf4_weights``, plain torch +
torchao); and the technique object with its option (``quantize_base``)."""
