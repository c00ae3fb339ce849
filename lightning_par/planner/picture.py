"""The plan as a picture: per-device memory by component against the budget, and each layout's predicted step split
into compute, exposed communication and pipeline bubble, for the top layouts side by side."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from lightning_par.planner.search import Plan

_MEMORY = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
           ("activations", "activations"), ("buffers", "transient buffers"))


def draw_plan(plan: Plan, top: int = 12) -> Any:
    """A matplotlib figure of the ``top`` layouts (fitting ones first, as ranked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shown = plan.predictions[:top]
    names = [str(p.layout) for p in shown][::-1]
    y = np.arange(len(shown))
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(15, 0.45 * len(shown) + 2.0), sharey=True)
    left = np.zeros(len(shown))
    for attr, label in _MEMORY:
        values = np.array([getattr(p, attr) for p in shown][::-1]) / 2**30
        mem_ax.barh(y, values, left=left, label=label)
        left += values
    if shown and shown[0].budget is not None:
        mem_ax.axvline(shown[0].budget / 2**30, color="black", linestyle="--", label="budget")
    mem_ax.set_xlabel("GiB per device (the largest rank)")
    mem_ax.set_yticks(y, names, fontsize=8)
    mem_ax.legend(fontsize=7, loc="lower right")
    left = np.zeros(len(shown))
    parts = [("compute", [p.compute_s for p in shown])]
    kinds = sorted({k for p in shown for k in p.comm_s})
    parts += [(f"exposed {k}", [p.comm_s.get(k, 0.0) for p in shown]) for k in kinds]
    parts.append(("pipeline bubble", [p.bubble_s for p in shown]))
    for label, values in parts:
        arr = np.array(values[::-1]) * 1e3
        if arr.any():
            time_ax.barh(y, arr, left=left, label=label)
            left += arr
    for i, p in enumerate(shown[::-1]):
        if not p.fits:
            time_ax.text(left[i], i, "  does not fit", va="center", fontsize=7, color="red")
    time_ax.set_xlabel("predicted ms per step")
    time_ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{plan.profile.name} on {plan.world_size} x {plan.hardware.device} ({plan.precision}); "
                 f"hardware: {plan.hardware.source}", fontsize=9)
    fig.tight_layout()
    return fig


def save_plan_picture(plan: Plan, directory: str | Path, trainer: Any | None = None) -> Path | None:
    """Write ``plan.png`` into ``directory`` on rank 0 (returns its path there); under a Trainer with a TensorBoard
    logger, also log it as the image ``plan/layouts``."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    import matplotlib.pyplot as plt

    fig = draw_plan(plan)
    path = Path(directory) / "plan.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    experiment = getattr(getattr(trainer, "logger", None), "experiment", None)
    if experiment is not None and hasattr(experiment, "add_image"):
        import numpy as np
        from PIL import Image

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        image = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
        experiment.add_image("plan/layouts", image, dataformats="HWC")
    plt.close(fig)
    return path
