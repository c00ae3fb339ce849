"""Expert parallelism: finding experts modules and dispatching tokens to them (``experts``, plain torch); and its
technique object with its cost account (``expert_parallel``)."""
