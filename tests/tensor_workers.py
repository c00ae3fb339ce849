"""Worker functions for tests/test_tensor_parallel_core.py (module level, so spawned ranks can import them).

Plain torch.distributed, no Lightning: each rank builds the model, keeps an untouched copy as the one-process
reference (it sees the same batches and trains alone, no communication), applies ``apply_tp`` to the other and
trains both for a few steps. Ranks return plain numbers and error messages; the parent asserts.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

from example_projects.gpt.model import GPT, GPT_TP_PLAN, GPTConfig
from lightning_par.techniques.tensor.sequence_regather import gathered_again, regathered_sequence
from lightning_par.techniques.tensor.tensor import apply_tp, prefix_plan, resolve_tp_plan

BATCH, SEQ = 4, 16


def tiny_gpt(**overrides) -> GPT:
    cfg = dict(vocab_size=32, block_size=16, n_layer=3, n_head=4, n_embd=32, dropout=0.0)
    return GPT(GPTConfig(**{**cfg, **overrides}))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Wrapper(nn.Module):
    """Stands in for a LightningModule: holds the model as ``self.model`` and a plan relative to itself."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.tp_plan = prefix_plan(GPT_TP_PLAN, "model")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


@dataclass(frozen=True)
class Case:
    name: str
    model: str = "gpt"  # gpt | wrapped | llama | gpt_style_objects
    sequence_parallel: bool = False
    loss_parallel: bool = False
    regather_sequence: bool = False  # trained inside ``regathered_sequence()``
    optimizer: str = "adamw"
    steps: int = 3
    overrides: dict = field(default_factory=dict, hash=False)


def gpt_cases() -> list[Case]:
    return [
        Case(f"gpt sp={sp} lp={lp} {opt}", sequence_parallel=sp, loss_parallel=lp, optimizer=opt)
        for sp in (False, True)
        for lp in (False, True)
        for opt in ("sgd", "adamw")
    ]


def extra_cases() -> list[Case]:
    return [
        Case("wrapped tp_plan attribute sp", model="wrapped", sequence_parallel=True),
        Case("gpt ParallelStyle objects in plan", model="gpt_style_objects"),
        Case("llama hf plan", model="llama"),
        Case("llama hf plan sp", model="llama", sequence_parallel=True),
        Case("llama hf plan sp lp (lm_head overridden)", model="llama", sequence_parallel=True, loss_parallel=True),
        Case("gpt sp lp regather", sequence_parallel=True, loss_parallel=True, regather_sequence=True),
        Case("llama hf plan sp regather", model="llama", sequence_parallel=True, regather_sequence=True),
    ]


def _build(case: Case) -> tuple[nn.Module, dict, int]:
    """(model, plan, vocab). The plan comes through resolve_tp_plan as the strategy will call it."""
    if case.model == "llama":
        model = tiny_llama()
        plan = resolve_tp_plan(model, None)
        if case.loss_parallel:
            plan = {**plan, "lm_head": "vocab_parallel_head"}
        return model, plan, 64
    if case.model == "wrapped":
        model = Wrapper(tiny_gpt(**case.overrides))
        return model, resolve_tp_plan(model, None), 32
    model = tiny_gpt(**case.overrides)
    plan = dict(GPT_TP_PLAN)
    if case.model == "gpt_style_objects":
        plan["blocks.*.mlp.fc"] = ColwiseParallel()
    return model, resolve_tp_plan(model, plan), 32


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _train(model: nn.Module, batches: list, optimizer: str, use_loss_parallel: bool,
           regather: bool = False) -> list[float]:
    opt = (torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    losses = []
    for x, y in batches:
        with regathered_sequence() if regather else nullcontext():
            losses.append(_train_step(model, x, y, opt, use_loss_parallel))
    return losses


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer,
                use_loss_parallel: bool) -> float:
    opt.zero_grad()
    logits = _logits(model, x)
    if use_loss_parallel:
        assert isinstance(logits, DTensor), f"loss_parallel: logits are {type(logits).__name__}, not a DTensor"
        with loss_parallel():
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
        loss = loss.full_tensor()
    else:
        assert not isinstance(logits, DTensor)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
    opt.step()
    return float(loss.detach())


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def run_case(case: Case, mesh) -> dict:
    torch.manual_seed(0)
    model, plan, vocab = _build(case)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g))
        for _ in range(case.steps)
    ]
    apply_tp(model, mesh, plan, sequence_parallel=case.sequence_parallel, loss_parallel=case.loss_parallel,
             regather_sequence=case.regather_sequence)
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.to_local().numel()
                     < p.numel())
    # the residual stream leaving the first block: this rank's sequence chunk under SP, the full sequence without
    first_block = next(m for n, m in model.named_modules() if n.endswith(("blocks.0", "layers.0")))
    seen: list[tuple] = []
    first_block.register_forward_hook(lambda _m, _a, out: seen.append(tuple((out[0] if isinstance(out, tuple)
                                                                              else out).shape)))
    before = gathered_again()
    losses = _train(model, batches, case.optimizer, case.loss_parallel, case.regather_sequence)
    gathered = gathered_again() - before
    ref_losses = _train(reference, batches, case.optimizer, False)
    got, want = _full_weights(model), _full_weights(reference)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weight_diff": max(float((got[k] - want[k]).abs().max()) for k in got),
        "num_sharded": len(sharded),
        "block_output_shape": seen[0],
        "loss_decreased": ref_losses[-1] < ref_losses[0],
        "gathered_again": gathered,
    }


def _error(fn) -> str:
    """The message of the ValueError/TypeError ``fn`` raises ('' if none): collected on every rank."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def distributed_errors(mesh) -> dict[str, str]:
    """Bad inputs that need a mesh or a forward; each must raise on every rank alike, before any collective (the
    job would hang otherwise). Runs before the parity cases, which then prove the process group is still in step."""
    errors = {}
    errors["bad plan"] = _error(lambda: apply_tp(tiny_gpt(), mesh, {"blocks.*.atn.q": "colwise"}))
    model = tiny_gpt()
    apply_tp(model, mesh, GPT_TP_PLAN)
    errors["applied twice"] = _error(lambda: apply_tp(model, mesh, GPT_TP_PLAN))
    sp_model = tiny_gpt()
    apply_tp(sp_model, mesh, GPT_TP_PLAN, sequence_parallel=True)
    errors["sp uneven sequence"] = _error(lambda: sp_model(torch.zeros(2, SEQ - 1, dtype=torch.long)))  # 15
    tied = tiny_llama()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    errors["tied weights"] = _error(lambda: apply_tp(tied, mesh, resolve_tp_plan(tied, None)))
    if dist.get_world_size() == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        errors["2-D mesh"] = _error(lambda: apply_tp(tiny_gpt(), mesh2d, GPT_TP_PLAN))
    return errors


def run_all(tp: int, cases: list[Case]) -> dict:
    """One launch: the error checks, then every parity case on a 1-D mesh of the whole world."""
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        out = {"errors": distributed_errors(mesh)}
        for case in cases:
            out[case.name] = run_case(case, mesh)
        out["regather"] = regather_evidence(mesh)
        out["async_tp"] = async_tp_evidence(tp)
        return out
    finally:
        dist.destroy_process_group()


def async_tp_evidence(tp: int) -> dict:
    """What ``TensorParallel(async_tp=True).apply`` switches on for the tp group (Inductor's pass and symmetric
    memory; compiling and running it needs CUDA), and that eager steps are unchanged by it."""
    import torch._inductor.config as inductor_config

    from lightning_par._compat import symmetric_memory_enabled
    from lightning_par.dims import ParallelDims
    from lightning_par.techniques import Target, TensorParallel

    before = inductor_config._micro_pipeline_tp
    inductor_config._micro_pipeline_tp = False
    try:
        dims = ParallelDims(dp_shard=1, tp=tp).resolve(tp)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        model = tiny_gpt()
        TensorParallel(GPT_TP_PLAN, sequence_parallel=True, async_tp=True).apply(
            Target(model, torch.device("cpu"), "32-true"), dims)
        group = dims.mesh("tp").get_group().group_name
        return {"inductor_pass": bool(inductor_config._micro_pipeline_tp),
                "symmetric_memory": symmetric_memory_enabled(group)}
    finally:
        inductor_config._micro_pipeline_tp = before


class _InPlaceAfterGather(nn.Module):
    """A norm on the sequence chunks, a column-parallel layer that gathers its output, then the chunk scaled in
    place: what backward would gather again is no longer what forward gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) * 1.0  # (torch's SequenceParallel output is a view autograd keeps from in-place ops)
        out = self.down(F.gelu(self.up(h)))
        h.mul_(2.0)
        return out + h


def regather_evidence(mesh) -> dict:
    """What ``regather_sequence`` changes in one step of the tiny GPT (fp32, SP, tp over ``mesh``): the all-gathers
    (CommDebugMode), the bytes alive at the end of forward (autograd's saved tensors held by Python objects in both
    runs, so a scan sees them), the gradients; and the error for a chunk modified in place."""
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_par.planner.measure import live_storages

    def step(regather: bool) -> dict:
        torch.manual_seed(0)
        model = tiny_gpt()
        apply_tp(model, mesh, GPT_TP_PLAN, sequence_parallel=True, regather_sequence=regather)
        x = torch.randint(0, 32, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        passthrough = torch.autograd.graph.saved_tensors_hooks(lambda t: [t], lambda held: held[0])
        comm = CommDebugMode()
        before = live_storages()
        with regathered_sequence() if regather else passthrough, comm:
            loss = F.cross_entropy(_logits(model, x).flatten(0, 1), x.flatten())
            alive = sum(nbytes for ptr, (nbytes, _) in live_storages().items() if ptr not in before)
            forward = dict(comm.get_comm_counts())
            loss.backward()
        total = dict(comm.get_comm_counts())
        all_gathers = {k: v for k, v in total.items() if "all_gather" in str(k)}
        return {"alive": alive, "forward_gathers": sum(v for k, v in forward.items() if "all_gather" in str(k)),
                "gathers": sum(all_gathers.values()),
                "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                          for n, p in model.named_parameters()}}

    plain, regathered = step(False), step(True)
    model = _InPlaceAfterGather()
    apply_tp(model, mesh, {"norm": "sequence_parallel", "up": "colwise", "down": "rowwise"}, sequence_parallel=True,
             regather_sequence=True, whole_model=False)
    chunk = torch.randn(BATCH, SEQ // mesh.size(), 32)
    with regathered_sequence():
        in_place = _error_of_run(lambda: model(chunk).sum().backward())
        # any other saved tensor: sigmoid saves its output, changed in place before backward (autograd, which does
        # not check under saved-tensor hooks, would compute a wrong gradient)
        x = torch.randn(3, requires_grad=True)

        def sigmoid_then_in_place() -> None:
            y = torch.sigmoid(x)
            y.mul_(2.0)
            y.sum().backward()

        saved_in_place = _error_of_run(sigmoid_then_in_place)
    return {
        "alive": (plain["alive"], regathered["alive"]),
        "forward_gathers": (plain["forward_gathers"], regathered["forward_gathers"]),
        "gathers": (plain["gathers"], regathered["gathers"]),
        "grad_diff": max(float((plain["grads"][k] - regathered["grads"][k]).abs().max()) for k in plain["grads"]),
        "in_place": in_place,
        "saved_in_place": saved_in_place,
    }


def _error_of_run(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return ""
