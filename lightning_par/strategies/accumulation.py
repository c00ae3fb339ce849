"""Where a step stands in gradient accumulation, as the strategy learns it from Lightning's hooks.

Lightning runs each micro-batch of an accumulation but the last inside the strategy's ``block_backward_sync``,
and there calls ``training_step`` (the forward) and then ``backward``; the step's last micro-batch runs both
outside it. The call order is Lightning's; this one object holds what follows from it, changed only by its three
methods, each called from one hook of ``NDParallelStrategy``:

* ``accumulating`` (``block_backward_sync``, under every option): this micro-batch's backward is not the step's
  last;
* ``window_open`` (``training_step`` opens it, ``backward`` closes it): a window of micro-batches whose unused
  gradients are taken back together has begun; with ``accumulate_unsharded`` the micro-batches of one accumulation
  are one window, without it each micro-batch is its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class AccumulationWindow:
    accumulating: bool = False
    window_open: bool = False

    @contextmanager
    def holding_back(self) -> Iterator[None]:
        """Around a micro-batch whose gradients are not reduced yet (``block_backward_sync``)."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    def start_micro_batch(self, spans_accumulation: bool) -> bool:
        """A micro-batch's forward begins (``training_step``): whether it is the first of its window. The window
        stays open for the accumulation's next micro-batches when it ``spans_accumulation``."""
        first = not self.window_open
        self.window_open = spans_accumulation
        return first

    def end_backward(self) -> bool:
        """A micro-batch's backward ended (``backward``): whether it was the window's last (then closed)."""
        last = not (self.accumulating and self.window_open)
        self.window_open = self.window_open and not last
        return last
