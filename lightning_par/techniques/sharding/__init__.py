"""Fully sharded data parallelism (FSDP2): sharding the model and holding its reductions (``fsdp``), clipping
gradients over every mesh (``grad_norm``), all plain torch; and its technique object with its cost account
(``fully_sharded``)."""
