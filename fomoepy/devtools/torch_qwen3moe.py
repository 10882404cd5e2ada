"""qwen3moe in PyTorch, computing exactly what fomoepy's numpy forward computes (for training the demo model).

Dev-only: needs the `train` extra (CPU PyTorch). Shapes: B batch, T tokens, D = n_embd, H / Hkv heads of hd
dims, X experts, k = experts per token, F = expert_ff, N = B·T tokens flattened.

The forward is fomoepy/model/qwen3moe.py + attention.py + moe.py + runtime/cpu.py:
    x += attn(rmsnorm(x)·attn_norm)        GQA (kv head of q head h is h // (H/Hkv)), q/k RMSNorm per head
                                           before NEOX RoPE on the whole head, scale 1/√hd, causal
    x += moe(rmsnorm(x)·ffn_norm)          softmax router → top-k → weights renormalised to sum 1 →
                                           Σ w · down(silu(gate·h) ⊙ up·h)
    logits = output · (rmsnorm(x)·output_norm)
Parameters keep GGUF numpy shapes ([out, in]; experts [X, F, D] and [X, D, F]), so `gguf_weights()` is a
rename. The MoE also returns the Switch-Transformer load-balancing loss X · Σ_e f_e · P_e (f_e: share
of routed slots, P_e: mean router probability), and per-expert slot counts for usage statistics.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fomoepy.devtools.make_test_model import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(n_pos: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_pos, hd/2]; angles in float64 like the engine: pos · base^(−2i/hd)."""
    half = head_dim // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)
    angles = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return torch.from_numpy(np.cos(angles).astype(np.float32)), torch.from_numpy(np.sin(angles).astype(np.float32))


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]; pairs (i, i + hd/2) rotated by cos/sin [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        D, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
        self.H, self.Hkv, self.hd = H, Hkv, hd
        self.q = nn.Linear(D, H * hd, bias=False)
        self.k = nn.Linear(D, Hkv * hd, bias=False)
        self.v = nn.Linear(D, Hkv * hd, bias=False)
        self.o = nn.Linear(H * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, spec.rms_eps)
        self.k_norm = RMSNorm(hd, spec.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = rope_neox(self.q_norm(self.q(x).view(B, T, self.H, self.hd)), cos, sin).transpose(1, 2)  # [B, H, T, hd]
        k = rope_neox(self.k_norm(self.k(x).view(B, T, self.Hkv, self.hd)), cos, sin).transpose(1, 2)
        v = self.v(x).view(B, T, self.Hkv, self.hd).transpose(1, 2)  # [B, Hkv, T, hd]
        group = self.H // self.Hkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # q head h → kv head h // group
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/√hd
        return self.o(out.transpose(1, 2).reshape(B, T, self.H * self.hd))


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        X, Fd, D = spec.n_expert, spec.expert_ff, spec.n_embd
        self.k = spec.n_expert_used
        self.router = nn.Parameter(torch.empty(X, D))
        self.gate = nn.Parameter(torch.empty(X, Fd, D))
        self.up = nn.Parameter(torch.empty(X, Fd, D))
        self.down = nn.Parameter(torch.empty(X, D, Fd))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, D] → out [N, D], balance loss [], slot counts [X]."""
        N = h.shape[0]
        X, k = self.router.shape[0], self.k
        probs = torch.softmax(h @ self.router.T, dim=-1)  # [N, X]
        top_p, top_i = probs.topk(k, dim=-1)  # [N, k], [N, k]
        weights = top_p / top_p.sum(-1, keepdim=True)  # [N, k]
        flat = top_i.reshape(-1)  # [N·k]
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=X)  # [X]
        token = order // k  # [N·k] token of each sorted slot
        hs = h[token]  # [N·k, D]
        outs = []
        # unbind once: indexing self.gate[e] per expert would back-propagate X full-size zero tensors
        experts = zip(self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0))
        for chunk, (gate, up, down) in zip(torch.split(hs, counts.tolist()), experts):
            if chunk.shape[0]:
                outs.append((F.silu(chunk @ gate.T) * (chunk @ up.T)) @ down.T)
        y = torch.cat(outs) * weights.reshape(-1)[order, None]  # [N·k, D]
        out = torch.zeros_like(h).index_add_(0, token, y)
        share = counts.to(h.dtype) / (N * k)  # f_e
        balance = X * torch.sum(share * probs.mean(0))
        return out, balance, counts


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attn_norm = RMSNorm(spec.n_embd, spec.rms_eps)
        self.attn = Attention(spec)
        self.ffn_norm = RMSNorm(spec.n_embd, spec.rms_eps)
        self.moe = MoE(spec)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        moe_out, balance, counts = self.moe(self.ffn_norm(x).reshape(-1, x.shape[-1]))
        return x + moe_out.view_as(x), balance, counts


class Qwen3Moe(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.arch != "qwen3moe":
            raise ValueError(f"arch: expected 'qwen3moe', got {spec.arch!r}")
        self.spec = spec
        self.embed = nn.Embedding(spec.n_vocab, spec.n_embd)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layer))
        self.norm = RMSNorm(spec.n_embd, spec.rms_eps)
        self.output = nn.Linear(spec.n_embd, spec.n_vocab, bias=False)
        cos, sin = rope_tables(spec.context_length, spec.head_dim, spec.rope_freq_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """N(0, std²) matrices, residual outputs scaled by 1/√(2·n_layer), unit norms."""
        out_std = std / math.sqrt(2 * self.spec.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, out_std if name.endswith(("o.weight", "down")) else std, generator=generator)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, T] → logits [B, T, V], mean balance loss over layers [], slot counts [L, X]."""
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(tokens)
        balances, counts = [], []
        for block in self.blocks:
            x, balance, count = block(x, cos, sin)
            balances.append(balance)
            counts.append(count)
        return self.output(self.norm(x)), torch.stack(balances).mean(), torch.stack(counts)

    def gguf_weights(self) -> dict[str, np.ndarray]:
        """float32 arrays by GGUF tensor name (numpy shapes as make_test_model.tensor_plan lays them out)."""

        def a(t: torch.Tensor) -> np.ndarray:
            return t.detach().to(torch.float32).cpu().numpy().copy()

        out = {"token_embd.weight": a(self.embed.weight), "output_norm.weight": a(self.norm.weight), "output.weight": a(self.output.weight)}
        for il, b in enumerate(self.blocks):
            p = f"blk.{il}."
            out |= {
                p + "attn_norm.weight": a(b.attn_norm.weight),
                p + "attn_q.weight": a(b.attn.q.weight),
                p + "attn_k.weight": a(b.attn.k.weight),
                p + "attn_v.weight": a(b.attn.v.weight),
                p + "attn_output.weight": a(b.attn.o.weight),
                p + "attn_q_norm.weight": a(b.attn.q_norm.weight),
                p + "attn_k_norm.weight": a(b.attn.k_norm.weight),
                p + "ffn_norm.weight": a(b.ffn_norm.weight),
                p + "ffn_gate_inp.weight": a(b.moe.router),
                p + "ffn_gate_exps.weight": a(b.moe.gate),
                p + "ffn_up_exps.weight": a(b.moe.up),
                p + "ffn_down_exps.weight": a(b.moe.down),
            }
        return out
