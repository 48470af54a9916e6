"""A small decoder-only transformer, character-level, on the Python standard library's source.

The corpus is the ``.py`` files of the running Python's own standard library
(``sysconfig.get_paths()["stdlib"]``): real text that ships with every Python, so
nothing is downloaded. Files are read in sorted order up to ``max_chars``, so every
slice host builds the same corpus and the same vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sysconfig

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ray_elastic.task import TrainTask


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_chars: int) -> str:
    """Concatenated stdlib sources (no tests, no site-packages), at most ``max_chars``."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharWindows:
    """Random-access (input, target) windows over the encoded corpus."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict:
        s = i * self.seq_len
        w = self.tokens[s : s + self.seq_len + 1]
        return {"x": w[:-1], "y": w[1:]}


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=num_heads, in_features=d_model, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class CharTransformer(nnx.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, num_heads: int, num_layers: int, *, rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Embed(seq_len, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, num_heads, rngs=rngs) for _ in range(num_layers)])
        self.ln = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens):
        T = tokens.shape[-1]
        x = self.tok(tokens) + self.pos(jnp.arange(T))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


@dataclasses.dataclass
class CharTransformerTask(TrainTask):
    seq_len: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    learning_rate: float = 3e-3
    max_chars: int = 400_000

    def _vocab(self) -> list[str]:
        return sorted(set(stdlib_corpus(self.max_chars)))

    def create_model(self, rngs):
        return CharTransformer(
            len(self._vocab()), self.seq_len, self.d_model, self.num_heads, self.num_layers, rngs=rngs
        )

    def create_optimizer(self):
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(self.learning_rate, weight_decay=0.01))

    def loss(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def dataset(self):
        text = stdlib_corpus(self.max_chars)
        index = {c: i for i, c in enumerate(self._vocab())}
        tokens = np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))
        return CharWindows(tokens, self.seq_len)
