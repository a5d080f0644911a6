"""``python -m src.predict ckpt_path=PATH 'inputs="Return the "'``: the text a checkpoint writes
after a prompt (greedy, ``characters`` of it), as a CSV row: prompt, continuation."""

import csv
from pathlib import Path

import torch
from lightning_exact import Task, model_from_checkpoint, read_checkpoint

from .data import ALPHABET, encode


def continue_text(ckpt_path: str, prompt: str, out: Path, task: Task, characters: int = 24) -> Path:
    saved = read_checkpoint(ckpt_path)
    model = model_from_checkpoint(saved, Path(ckpt_path).name, task).eval()
    tokens = encode(prompt)[None]
    block_size = model.hparams.block_size
    with torch.no_grad():
        for _ in range(characters):
            logits = model(tokens[:, -block_size:])
            tokens = torch.cat([tokens, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    continuation = "".join(ALPHABET[t] for t in tokens[0, len(prompt) :].tolist())
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as file:
        csv.writer(file).writerows([["prompt", "continuation"], [prompt, continuation]])
    print(f"{prompt!r} continues {continuation!r}: {out}")
    return out
