"""A small decoder LLM of today's usual shape, annotated for ``fsdp`` x ``tensor`` inside a slice.

RMSNorm, rotary positions, a SwiGLU MLP and grouped-query attention; float32 master weights with
bfloat16 compute; every weight annotated with logical axis names (``embed``, ``mlp``, ``heads``,
``kv_heads``, ``vocab``) that :data:`LOGICAL_AXIS_RULES` maps to mesh axes, as MaxText does.
It trains on the standard library's sources, byte-level, and evaluates on held-out files::

    config = ElasticConfig(num_slices=2, global_batch_size=32, slice_mesh={"fsdp": -1, "tensor": 2},
                           logical_axis_rules=LOGICAL_AXIS_RULES, microbatch_size=4, eval_every=50)
    ElasticTrainer(DecoderLMTask(), config, run_dir="runs/llm").fit(500)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from ray_elastic.examples.char_transformer import CharWindows, stdlib_corpus
from ray_elastic.task import TrainTask

# Logical axis -> mesh axis: weights split over fsdp along the model dimension, over tensor along
# the MLP, head and vocabulary dimensions (Megatron-style tensor parallelism inside a slice).
LOGICAL_AXIS_RULES = (
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("norm", None),
)
VOCAB = 256  # bytes
# Activations (batch, seq, heads, head_dim): the batch over the data-parallel axes, heads over tensor.
HEADS_ACTIVATION = P(("replica", "fsdp"), None, "tensor", None)


def _init(names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


def rotary(x, positions, base: float = 10_000.0):
    """Rotary position embedding of ``x`` (..., seq, heads, head_dim) at ``positions`` (seq,)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (seq, half)
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: ``num_kv_heads`` key/value heads shared by ``num_heads`` query heads."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, dtype, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        kw = dict(use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.q = nnx.LinearGeneral(
            d_model, (num_heads, self.head_dim), kernel_init=_init(("embed", "heads", "head_dim")), **kw
        )
        self.k = nnx.LinearGeneral(
            d_model, (num_kv_heads, self.head_dim), kernel_init=_init(("embed", "kv_heads", "head_dim")), **kw
        )
        self.v = nnx.LinearGeneral(
            d_model, (num_kv_heads, self.head_dim), kernel_init=_init(("embed", "kv_heads", "head_dim")), **kw
        )
        self.o = nnx.LinearGeneral(
            (num_heads, self.head_dim), d_model, axis=(-2, -1), kernel_init=_init(("heads", "head_dim", "embed")), **kw
        )

    def __call__(self, x, positions):
        q, k, v = (
            jax.lax.with_sharding_constraint(a, HEADS_ACTIVATION)
            for a in (rotary(self.q(x), positions), rotary(self.k(x), positions), self.v(x))
        )
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # repeats kv heads for the groups
        return self.o(jax.lax.with_sharding_constraint(out, HEADS_ACTIVATION))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.gate = nnx.Linear(d_model, d_ff, kernel_init=_init(("embed", "mlp")), **kw)
        self.up = nnx.Linear(d_model, d_ff, kernel_init=_init(("embed", "mlp")), **kw)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=_init(("mlp", "embed")), **kw)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, d_model, num_heads, num_kv_heads, d_ff, dropout, *, dtype, rngs):
        self.attn_norm, self.mlp_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = Attention(d_model, num_heads, num_kv_heads, dtype=dtype, rngs=rngs)
        self.mlp = MLP(d_model, d_ff, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.dropout(self.attn(self.attn_norm(x), positions))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class DecoderLM(nnx.Module):
    def __init__(
        self,
        *,
        d_model: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        d_ff: int,
        dropout: float,
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.embed = nnx.Embed(
            VOCAB,
            d_model,
            param_dtype=jnp.float32,
            dtype=dtype,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        self.blocks = nnx.List(
            [Block(d_model, num_heads, num_kv_heads, d_ff, dropout, dtype=dtype, rngs=rngs) for _ in range(num_layers)]
        )
        self.norm = RMSNorm(d_model)
        self.head = nnx.Linear(
            d_model,
            VOCAB,
            use_bias=False,
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=_init(("embed", "vocab")),
            rngs=rngs,
        )

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[-1])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x)).astype(jnp.float32)


@dataclasses.dataclass
class DecoderLMTask(TrainTask):
    """Next-byte prediction on the standard library's sources; the last ``eval_fraction`` is held out."""

    seq_len: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 128
    dropout: float = 0.0
    compute_dtype: str = "bfloat16"  # activations and matmuls; the weights are float32 masters
    learning_rate: float = 3e-3
    max_chars: int = 400_000
    eval_fraction: float = 0.1

    def create_model(self, rngs):
        return DecoderLM(
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            d_ff=self.d_ff,
            dropout=self.dropout,
            dtype=jnp.dtype(self.compute_dtype),
            rngs=rngs,
        )

    def create_optimizer(self):
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(self.learning_rate, weight_decay=0.01))

    def loss(self, model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = (logits.argmax(-1) == batch["y"]).mean()
        return loss, {"accuracy": accuracy, "perplexity": jnp.exp(loss)}

    def _tokens(self) -> np.ndarray:
        return np.frombuffer(stdlib_corpus(self.max_chars).encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def _split(self) -> int:
        return int(len(self._tokens()) * (1 - self.eval_fraction))

    def dataset(self):
        return CharWindows(self._tokens()[: self._split()], self.seq_len)

    def eval_dataset(self):
        return CharWindows(self._tokens()[self._split() :], self.seq_len)
