"""A small GPT-style language model and a synthetic token stream for the example scripts.

The autotuner needs a training script whose speed and memory depend on the
micro-batch size and ZeRO stage the way a real LLM's do, yet which runs in a
few seconds on a single CPU core.  This module is that workload: a decoder-only
transformer (token + position embeddings, pre-LayerNorm blocks with causal
multi-head self-attention and an MLP, a final LayerNorm and an untied LM head)
fed with random tokens.

The default sizes (16k vocabulary, 128 tokens, width 128, 2 layers; 4.6M
parameters, 2.5M of them outside the embeddings) are chosen so that activation
memory dominates at large micro-batches: the ``seq x vocab`` logits and their
log-softmax take 16 MiB per sample in the forward pass, about 27 MiB per sample
at the backward peak, against a fixed ~0.5 GiB for the interpreter, torch,
DeepSpeed, the weights and Adam.  A micro-batch of 8 then peaks at 0.65-0.9
GiB per rank (ZeRO 0-3) while 48 passes a 1.25 GiB cap during its first
forward pass, and training costs roughly 40-55 ms per sample on one core.  Attention is written out explicitly, as
in the classic GPT implementation, so its ``heads x seq x seq`` scores are
materialised too.

Only plain torch is used, so the DeepSpeed and the plain-torch script share it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes; the defaults are calibrated for the bundled examples/cfg.json."""

    vocab_size: int = 16384
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and the past."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model={config.d_model} is not divisible by n_heads={config.n_heads}")
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        future = torch.ones(config.seq_len, config.seq_len, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("future_mask", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.future_mask[:seq, :seq], float("-inf"))
        mixed = scores.softmax(dim=-1) @ v
        return self.out(mixed.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden), nn.GELU(), nn.Linear(hidden, config.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(tokens, targets)`` returns the mean cross-entropy loss.

    With ``checkpointing`` each transformer block keeps only its input in training and runs its
    forward again in the backward pass (``torch.utils.checkpoint``): less activation memory per
    sample for about a third more compute.
    """

    def __init__(self, config: GPTConfig, checkpointing: bool = False) -> None:
        super().__init__()
        self.config = config
        self.checkpointing = checkpointing
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        logits = self.lm_head(self.ln_final(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_parameters(self, include_embeddings: bool = True) -> int:
        total = sum(p.numel() for p in self.parameters())
        if include_embeddings:
            return total
        return total - self.token_embedding.weight.numel() - self.position_embedding.weight.numel()


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def training_flops_per_sample(model: GPT) -> float:
    """The standard 6 * N * tokens estimate of forward + backward FLOPs for one sample.

    N counts the non-embedding parameters (embedding lookups do no
    multiply-adds; the LM head does count): 2 FLOPs per parameter per token for
    the forward pass and 4 for the backward.  Attention's seq^2 term is ignored,
    as in the usual estimate.  It agrees within a few percent with what
    DeepSpeed's flops profiler reports for this model.
    """
    return 6.0 * model.num_parameters(include_embeddings=False) * model.config.seq_len


class SyntheticTokens:
    """Seeded random token sequences with next-token targets.

    Each rank passes its own seed so that data-parallel ranks see different data.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.randint(self.vocab_size, (batch_size, self.seq_len + 1), generator=self.generator)
        return stream[:, :-1], stream[:, 1:]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the model size flags shared by both training scripts."""
    defaults = GPTConfig()
    group = parser.add_argument_group("model size")
    group.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    group.add_argument("--seq-len", type=int, default=defaults.seq_len)
    group.add_argument("--d-model", type=int, default=defaults.d_model)
    group.add_argument("--n-layers", type=int, default=defaults.n_layers)
    group.add_argument("--n-heads", type=int, default=defaults.n_heads)


def config_from_arguments(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
    )
