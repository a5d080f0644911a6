"""A small GPT (nanoGPT's shape: token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, the output layer tied to the token embedding), trained with AdamW and
a one-cycle schedule over ``trainer.estimated_stepping_batches``, one optimizer step at a time."""

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning_exact import Batch, shard
from torch import Tensor, nn
from torchmetrics import Metric


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)  # a key bias gets no gradient
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        # nanoGPT's attention dropout: exact on any number of ranks (strategy.exact)
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, width: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT and most language models do
        for embedding in (self.wte, self.wpe):
            nn.init.normal_(embedding.weight, std=0.02)  # nanoGPT's: logits start near uniform

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# strategy=fsdp: each block, layer norm and embedding is a unit, and the token embedding shards
# together with the output layer that shares its weight.
SHARDED_BLOCKS = (Block, nn.LayerNorm, nn.Embedding, ("wte", "lm_head"))


class TokenLoss(Metric):
    """Per-token mean cross-entropy from two sums: exact over any number of ranks."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, losses: Tensor) -> None:
        self.loss_sum.add_(losses.sum())
        self.tokens.add_(losses.numel())

    def compute(self) -> Tensor:
        return self.loss_sum / self.tokens


class CharGPT(L.LightningModule):
    SET_BY_DATA = ("vocab_size", "block_size")

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        width: int = 32,
        layers: int = 2,
        heads: int = 2,
        dropout: float = 0.0,
        lr: float = 0.003,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = GPT(vocab_size, block_size, width, layers, heads, dropout)
        self.train_loss = TokenLoss()
        self.val_loss = TokenLoss()
        self.test_loss = TokenLoss()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # strategy=fsdp
            shard(self.net, self.device_mesh, SHARDED_BLOCKS)

    def _step(self, batch: Batch, stage: str) -> Tensor:
        logits = self(batch.inputs)
        losses = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
        metric = getattr(self, f"{stage}_loss")
        metric.update(losses.detach())
        self.log(f"{stage}/loss", metric, on_step=False, on_epoch=True)
        return losses.mean()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        steps = self.trainer.estimated_stepping_batches
        if math.isinf(steps):
            raise ValueError("the one-cycle schedule needs trainer.max_steps or max_epochs")
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=int(steps), pct_start=0.2
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def build(model: dict[str, Any], data: Any) -> CharGPT:
    return CharGPT(vocab_size=data.vocab_size, block_size=data.hparams.block_size, **model)


def config_targets(model: Mapping[str, Any]) -> dict[str, tuple[Any, tuple[str, ...]]]:
    return {"model": (CharGPT, CharGPT.SET_BY_DATA)}
