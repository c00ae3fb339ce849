"""The cost model: what a layout costs in memory and time, read from one traced step (below the techniques)."""
