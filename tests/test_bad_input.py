"""Bad configuration is refused in Trainer(...) itself: on every rank (each runs this code), before any process
group exists, naming the parameter, the value and the fix. Errors that need the model are in test_reliability."""

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_par import AutoParallelStrategy, FSDP2Strategy, NDParallelStrategy


def _trainer(strategy, **kwargs):
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, **kwargs)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: _trainer(FSDP2Strategy(dp_shard=3)), ValueError,
         r"layout dp_shard=3 multiplies to 3 processes, but the world size is 2"),
        (lambda: _trainer(FSDP2Strategy(dp_replicate=4, dp_shard=-1)), ValueError,
         r"cannot fill `dp_shard=-1`: the other sizes .*dp_replicate=4.* multiply to 4"),
        (lambda: FSDP2Strategy(dp_replicate=-1, dp_shard=-1), ValueError, r"only one dimension may be -1"),
        (lambda: FSDP2Strategy(dp_shard=0), ValueError, r"`dp_shard=0` is not a valid size"),
        (lambda: FSDP2Strategy(dp_replicate=-3), ValueError, r"`dp_replicate=-3` is not a valid size"),
        (lambda: _trainer(FSDP2Strategy(process_group_backend="nccl")), ValueError,
         r"process_group_backend='nccl' needs CUDA devices, but the accelerator is 'cpu'"),
        (lambda: FSDP2Strategy(process_group_backend="nccl2"), ValueError, r"'nccl2' is not a torch.distributed"),
        (lambda: _trainer(FSDP2Strategy(), precision="16-true"), ValueError,
         r"precision='16-true' .* not supported .* 'bf16-true' instead of '16-true'"),
        (lambda: _trainer(FSDP2Strategy(), precision="64-true"), ValueError, r"precision='64-true'"),
        (lambda: FSDP2Strategy(timeout=-5), ValueError, r"timeout=-5 must be a positive number of seconds"),
        (lambda: FSDP2Strategy(reshard_after_forward="yes"), TypeError, r"reshard_after_forward='yes' must be True"),
        (lambda: FSDP2Strategy(shard_units="Block"), TypeError, r"shard_units='Block' must be a list"),
        (lambda: FSDP2Strategy(tp=2), ValueError, r"FSDP2Strategy does not take tp=2: it sets only dp_replicate, "
                                                   r"dp_shard\. Use NDParallelStrategy"),
        (lambda: NDParallelStrategy(pp=2, pp_schedule="pipedream"), ValueError,
         r"pp_schedule='pipedream' is not a pipeline schedule; choose one of \['1f1b', 'gpipe'"),
        (lambda: NDParallelStrategy(pp=2, pp_microbatches=0), ValueError, r"pp_microbatches=0 must be a positive"),
        (lambda: FSDP2Strategy(accumulate_unsharded=True, cpu_offload=True), ValueError,
         r"accumulate_unsharded=True with cpu_offload=True: .* Choose one"),
        (lambda: FSDP2Strategy(accumulate_unsharded="yes"), TypeError, r"accumulate_unsharded"),
        (lambda: NDParallelStrategy(tp=2, regather_sequence=True), ValueError,
         r"regather_sequence=True with sequence_parallel=False: .* Pass sequence_parallel=True too"),
        (lambda: NDParallelStrategy(tp=2, sequence_parallel=True, regather_sequence=True, compile=True), ValueError,
         r"regather_sequence=True with compile=True: .* Turn one of them off"),
        (lambda: NDParallelStrategy(regather_sequence="yes"), TypeError, r"regather_sequence='yes' must be True"),
        (lambda: NDParallelStrategy(tp=2, async_tp=True, compile=True), ValueError,
         r"async_tp=True with sequence_parallel=False: .* Pass sequence_parallel=True too"),
        (lambda: NDParallelStrategy(tp=2, sequence_parallel=True, async_tp=True), ValueError,
         r"async_tp=True with compile=False: .* Pass compile=True too"),
        (lambda: NDParallelStrategy(tp=1, sequence_parallel=True, async_tp=True, compile=True), ValueError,
         r"async_tp=True with tp=1: .* Set tp > 1"),
        (lambda: _trainer(NDParallelStrategy(dp_shard=1, tp=2, sequence_parallel=True, async_tp=True, compile=True)),
         ValueError, r"async_tp=True on accelerator 'cpu': .* Run with accelerator='cuda'"),
        (lambda: NDParallelStrategy(async_tp="yes"), TypeError, r"async_tp='yes' must be True"),
        (lambda: AutoParallelStrategy(async_tp=True), ValueError, r"async_tp=True with compile=False"),
        (lambda: _trainer(AutoParallelStrategy(async_tp=True, compile=True)), ValueError,
         r"async_tp=True on accelerator 'cpu'"),
        (lambda: AutoParallelStrategy(regather_sequence=True, compile=True), ValueError,
         r"regather_sequence=True with compile=True"),
        (lambda: NDParallelStrategy(pp=2, pp_split_points="model.blocks.2"), TypeError,
         r"pp_split_points='model.blocks.2' must be a list of block FQNs"),
        (lambda: Trainer(accelerator="cpu", devices=4, logger=False,
                         strategy=NDParallelStrategy(pp=2, dp_shard=2, pp_schedule="zbv")), ValueError,
         r"pp_schedule='zbv' with dp_shard=2, dp_replicate=1: zero-bubble .* use pp_schedule='1f1b'"),
    ],
)
def test_bad_configuration_is_refused_before_launch(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_half_precision_choices():
    """16-mixed is accepted with a scaler that agrees across ranks (its parity: test_precision16.py); what truly
    cannot work is refused with the reason: 16-true (fp16 weights, no master copy, no loss scaling), and a
    GradScaler subclass whose own logic the conversion would drop."""
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_par.strategies.precision import ParallelGradScaler, ParallelMixedPrecision, to_parallel_precision

    plugin = _trainer(FSDP2Strategy(), plugins=[MixedPrecision("16-mixed", "cpu")]).precision_plugin
    assert type(plugin) is ParallelMixedPrecision and type(plugin.scaler) is ParallelGradScaler
    with pytest.raises(ValueError, match=r"precision='16-true' .* no fp32 master copy and no loss scaling.* Use "
                                         r"'16-mixed'"):
        _trainer(FSDP2Strategy(), precision="16-true")

    class MyScaler(torch.amp.GradScaler):
        pass

    with pytest.raises(TypeError, match=r"scaler=MyScaler\(...\)\): lightning_par replaces the scaler"):
        to_parallel_precision(MixedPrecision("16-mixed", "cpu", scaler=MyScaler("cpu")), "cpu")
    with pytest.raises(TypeError, match=r"scaler=GradScaler: a plain GradScaler does not agree across ranks"):
        ParallelMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_strategies_are_registered_by_name():
    assert {"fsdp2", "nd_parallel"} <= set(StrategyRegistry)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="fsdp2", logger=False)
    assert type(trainer.strategy) is FSDP2Strategy
    assert trainer.strategy.dims.dp_shard == 2
    assert trainer.precision_plugin.precision == "32-true"
    assert type(trainer.precision_plugin).__name__ == "ParallelPrecision"
