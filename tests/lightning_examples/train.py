"""Lightning's two ModelParallelStrategy examples, written as a user keeps them, shrunk for CPU.

* ``Llama3``: ``examples/pytorch/tensor_parallel/train.py`` (its LightningModule unchanged but for a tiny
  ``ModelArgs``, a 16-token dataset and ``num_workers=0``); its ``RandomTokenDataset`` from ``data.py``.
* ``LitModel``: the full example of the docs page ``advanced/model_parallel/tp_fsdp.rst`` (``FeedForward(64, 64)``
  where the page has 8192).

Nothing here knows lightning_par: the tests run these under Lightning's strategy and under lightning_par's with
only the strategy changed.
"""

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch.distributed._composable.fsdp.fully_shard import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.utils.data import DataLoader, Dataset

from lightning_examples.model import ModelArgs, Transformer
from lightning_examples.parallelism import parallelize


class RandomTokenDataset(Dataset):
    def __init__(self, vocab_size: int, seq_length: int):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.tokens = torch.randint(
            self.vocab_size,
            size=(len(self), self.seq_length + 1),
            # Set a seed to make this toy dataset the same on each rank
            # Fabric will add a `DistributedSampler` to shard the data correctly
            generator=torch.Generator().manual_seed(42),
        )

    def __len__(self) -> int:
        return 128

    def __getitem__(self, item: int):
        return self.tokens[item]


class Llama3(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model_args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16)
        self.model = Transformer(self.model_args)

    def configure_model(self):
        # User-defined function that applies the desired parallelizations specific to the model
        # (TP, FSDP2, activation checkpointing, ...)
        parallelize(self.model, device_mesh=self.device_mesh, param_dtype=None)

    def on_train_start(self) -> None:
        self.model.init_weights()

    def training_step(self, batch):
        inputs = batch[:, :-1]
        labels = batch[:, 1:]
        output = self.model(inputs)
        # Optional: Parallelize loss computation across class dimension (see parallelism.py)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs):
        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self):
        dataset = RandomTokenDataset(vocab_size=self.model_args.vocab_size, seq_length=16)
        # Trainer configures the sampler automatically for you such that
        # all batches in a tensor-parallel group are identical
        return DataLoader(dataset, batch_size=8, num_workers=0)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = FeedForward(64, 64)

    def configure_model(self):
        if self.device_mesh is None:
            return
        # Lightning will set up a `self.device_mesh` for you
        # Here, it is 2-dimensional
        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]

        if tp_mesh.size() > 1:
            # Use PyTorch's distributed tensor APIs to parallelize the model
            plan = {
                "w1": ColwiseParallel(),
                "w2": RowwiseParallel(),
                "w3": ColwiseParallel(),
            }
            parallelize_module(self.model, tp_mesh, plan)

        if dp_mesh.size() > 1:
            # Use PyTorch's FSDP2 APIs to parallelize the model
            fully_shard(self.model.w1, mesh=dp_mesh)
            fully_shard(self.model.w2, mesh=dp_mesh)
            fully_shard(self.model.w3, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def training_step(self, batch):
        output = self.model(batch)
        loss = output.sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def train_dataloader(self):
        # Trainer configures the sampler automatically for you such that
        # all batches in a tensor-parallel group are identical
        dataset = RandomDataset(64, 64)
        return torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=0)
