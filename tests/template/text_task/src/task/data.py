"""Character windows of a generated text: sentences of a small grammar drawn from ``data_seed``,
cut into ``block_size`` characters (inputs) and the same shifted by one (targets). Every rank
draws the same text; nothing is read from disk."""

import random

import torch
from lightning_exact import DataError, TensorDataModule
from torch import Tensor

ALPHABET = " .Rabcdefghijklmnopqrstuvwxyz"  # every character the grammar writes; token = index
SUBJECTS = ("the cat", "a dog", "the bird", "my friend", "the robot")
VERBS = ("sees", "likes", "returns", "finds", "reads")
OBJECTS = ("the ball", "a book", "the key", "a letter", "the map")


def sentences(n_chars: int, rng: random.Random) -> str:
    """At least ``n_chars`` characters of sentences such as "Return the key. a dog sees a book."."""
    parts: list[str] = []
    while sum(map(len, parts)) < n_chars:
        if rng.random() < 0.2:
            parts.append(f"Return {rng.choice(OBJECTS)}. ")
        else:
            parts.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}. ")
    return "".join(parts)


def encode(text: str) -> Tensor:
    if unknown := sorted(set(text) - set(ALPHABET)):
        raise DataError(
            f"characters this model does not know: {''.join(unknown)!r}; it knows {ALPHABET!r}"
        )
    return torch.tensor([ALPHABET.index(c) for c in text], dtype=torch.long)


class CharDataModule(TensorDataModule):
    CONTENT_KEYS = (
        "name",
        "val_size",
        "split_seed",
        "block_size",
        "n_train",
        "n_test",
        "data_seed",
    )

    def __init__(
        self,
        name: str,
        block_size: int,
        n_train: int,
        n_test: int,
        batch_size: int,
        val_size: int,
        data_seed: int = 0,
        split_seed: int = 12345,
        shuffle_seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        device_resident: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.source = f"generated://sentences?data_seed={data_seed}"
        self.vocab_size = len(ALPHABET)

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        h = self.hparams
        rng = random.Random(h.data_seed)
        windows = {}
        for name, n in (("train", h.n_train), ("test", h.n_test)):  # always both, in this order
            tokens = encode(sentences(n * h.block_size + 1, rng))
            starts = torch.arange(n) * h.block_size
            offsets = starts[:, None] + torch.arange(h.block_size)
            windows[name] = (tokens[offsets], tokens[offsets + 1])
        return windows[split]
