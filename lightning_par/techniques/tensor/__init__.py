"""Tensor parallelism: the style registry and plans (``tensor_styles``, ``tensor_plan``), applying them
(``tensor``), sequence parallelism's regathering (``sequence_regather``), the replicated-parameter check
(``tensor_check``), all plain torch; and its technique object with its cost account (``tensor_parallel``)."""
