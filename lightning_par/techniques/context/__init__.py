"""Context parallelism: the distributed attention (``context``), how a sequence is split (``context_sharding``), the
scope that routes a model's attention to it (``context_routing``, ``context_hf``), all plain torch; and its technique
object with its cost account (``context_parallel``)."""
