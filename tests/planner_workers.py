"""What tests/test_planner.py runs in each process: one training step per layout, measuring the model state each rank
holds and the peak bytes autograd saves, for the planner's predictions to be compared with."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler
from workers import GLOBAL_BATCH, GPTModule, fit, token_dataset

from lightning_par import NDParallelStrategy
from lightning_par.planner.measure import probe_callback


def measure(layouts: dict[str, dict[str, Any]], world: int, module_cls: type,
            model_kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, kwargs in layouts.items():
        kwargs = dict(kwargs)
        model = {**model_kwargs, **kwargs.pop("model", {})}  # a layout's own model options (experts)
        probe = probe_callback(1, live=bool(kwargs.get("activation_checkpointing") or kwargs.get("regather_sequence")))
        dp = kwargs.get("dp_replicate", 1) * kwargs.get("dp_shard", 1)
        fit(NDParallelStrategy(**kwargs), devices=world, dp_size=dp, max_steps=2, callbacks=[probe],
            module_cls=module_cls, **model)
        out[name] = {"state": probe.state, "activations": probe.activation_bytes, "live": probe.live_bytes}
    return out


class OwnSamplerGPT(GPTModule):
    """A user's module that builds its own ``DistributedSampler`` from the strategy's sampler arguments (as a
    Llama-style client does): under auto_parallel they are read before any layout exists."""

    def train_dataloader(self) -> DataLoader:
        data = token_dataset(96, 16)
        sampler = DistributedSampler(data, **self.trainer.strategy.distributed_sampler_kwargs, shuffle=True, seed=7)
        return DataLoader(data, batch_size=GLOBAL_BATCH // 2, sampler=sampler)


def auto_then_by_hand(tmp: str) -> dict[str, Any]:
    """AutoParallelStrategy on the tiny GPT (4 blocks), then the layout it chose, by hand: the same run."""
    from lightning_par import AutoParallelStrategy

    auto = AutoParallelStrategy(plot_dir=f"{tmp}/plan")
    run = dict(devices=2, dp_size=2, max_steps=4, n_layer=4, module_cls=OwnSamplerGPT, module_loader=True)
    out = {"auto": fit(auto, **run)}
    chosen = auto.plan.best.layout
    out["chosen"] = str(chosen)
    out["by_hand"] = fit(NDParallelStrategy(**chosen.strategy_kwargs()), **run)
    # a mixture of experts, told to use expert parallelism: the layout carries ep to the engine
    moe = dict(devices=2, dp_size=2, max_steps=4, n_layer=2, n_experts=4, moe_top_k=2)
    auto = AutoParallelStrategy(restrict={"ep": [2]})
    out["moe_auto"] = fit(auto, **moe)
    out["moe_chosen"] = auto.plan.best.layout
    out["moe_by_hand"] = fit(NDParallelStrategy(**auto.plan.best.layout.strategy_kwargs()), **moe)
    return out
