"""float8 training: the blocks' linear layers in float8 through torchao (``float8_layers``, plain torch + torchao);
and the technique object with its option (``float8_training``)."""
