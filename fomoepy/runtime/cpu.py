"""The CPU backend: numpy implementations of every op the forward pass uses.

This is the exact reference the GPU kernels are tested against, and a real (slow) backend: all of
fomoepy runs on it. Arithmetic is float32; the few places where the order of a sum matters for
"prefill == step-by-step decode" are written so both paths add in the same order.

Shapes: T tokens, D = n_embd, H heads of hd dims, E experts.
"""

from __future__ import annotations

import functools

import numpy as np

from fomoepy import quants
from fomoepy.experts.routing import GATING_FUNCTIONS, Routing
from fomoepy.model.gguf_file import GGUFFile, TensorInfo

F32 = np.float32


class CpuBackend:
    name = "cpu"
    # which routed-expert executor computes on it (backends.make_expert_device); a string, so that choosing
    # one imports no other backend's libraries (a GPU install need not have ggml)
    experts_kind = "reference"

    def __init__(self, threads: int | None = None):
        """threads: BLAS threads for every matmul of the process (None: leave BLAS's default).

        Small matrices run slower on several BLAS threads than on one (a 40-token prefill of a tiny
        model measured 10x slower with 2 threads on a busy 2-core machine), so the engine picks.
        """
        if threads is not None:
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=threads, user_api="blas")
        self.threads = threads

    # -- weights -----------------------------------------------------------------------------------
    def load_weight(self, gf: GGUFFile, info: TensorInfo) -> np.ndarray:
        """A dense weight in compute-ready form: dequantised float32 in numpy shape."""
        return quants.dequantize(gf.raw(info), info.qtype, info.shape, tensor_name=info.name)

    # -- elementwise and norms ---------------------------------------------------------------------
    @staticmethod
    def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x̂ · w over the last axis (weights used as stored: real files already hold 1 + w)."""
        ms = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True)
        return (x / np.sqrt(ms + F32(eps))) * w

    @staticmethod
    def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
        # ggml_l2_norm divides by max(‖x‖, eps), not by ‖x‖ + eps
        norm = np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True))
        return x / np.maximum(norm, F32(eps))

    @staticmethod
    def silu(x: np.ndarray) -> np.ndarray:
        return x / (F32(1) + np.exp(-x))

    @staticmethod
    def sigmoid(x: np.ndarray) -> np.ndarray:
        return F32(1) / (F32(1) + np.exp(-x))

    @staticmethod
    def softplus(x: np.ndarray) -> np.ndarray:
        return np.logaddexp(F32(0), x).astype(F32)

    @staticmethod
    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - np.max(x, axis=-1, keepdims=True))
        return e / np.sum(e, axis=-1, keepdims=True)

    # -- linear algebra ----------------------------------------------------------------------------
    @staticmethod
    def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x [T, K] · wᵀ for w [N, K] (GGUF row-major weights) → [T, N]."""
        return x @ w.T

    @staticmethod
    def linear_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """linear with each row's bits those it gets alone: one [1, K] product per row (a GEMV each,
        as `linear` does for one row), where a [B, K] GEMM would sum in another order."""
        return np.matmul(x[:, None, :], w.T)[:, 0]

    def swiglu_ffn(self, x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        return self.linear(self.silu(self.linear(x, gate)) * self.linear(x, up), down)

    def embed(self, table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return table[tokens]

    # -- routing -----------------------------------------------------------------------------------
    @staticmethod
    def route(logits: np.ndarray, gating: str, k: int) -> Routing:
        return GATING_FUNCTIONS[gating](logits, k)

    # -- rotary embedding --------------------------------------------------------------------------
    @staticmethod
    def rope_neox(x: np.ndarray, positions: np.ndarray, rotary_dim: int, base: float) -> np.ndarray:
        """NEOX rotation of the first rotary_dim dims of each head; x [T, H, hd], positions [T].

        Pairs are (i, i + rotary_dim/2); angle_i = pos · base^(−2i/rotary_dim). Angles are computed in
        float64 so that a position's rotation does not depend on how many tokens share the call.
        """
        half = rotary_dim // 2
        cos, sin = _rotations(np.asarray(positions, np.int64).tobytes(), rotary_dim, float(base))
        x1 = x[..., :half]
        x2 = x[..., half:rotary_dim]
        out = x.copy()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
        return out

    # -- attention ---------------------------------------------------------------------------------
    def attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int) -> np.ndarray:
        """Causal GQA attention of T new queries over the cache.

        q [T, H, hd] at positions n_past..n_past+T-1; k_cache, v_cache [≥ n_past+T, Hkv, hd] already
        hold the new keys. Returns [T, H, hd].
        """
        T, H, hd = q.shape
        n_kv = n_past + T
        Hkv = k_cache.shape[1]
        group = H // Hkv
        k = k_cache[:n_kv].transpose(1, 2, 0)  # [Hkv, hd, n_kv]
        v = v_cache[:n_kv].transpose(1, 0, 2)  # [Hkv, n_kv, hd]
        # kv head of q head h is h // group: view q as [Hkv, group·T, hd]
        qg = q.reshape(T, Hkv, group, hd).transpose(1, 2, 0, 3).reshape(Hkv, group * T, hd)
        scores = (qg @ k) * F32(1.0 / np.sqrt(hd))  # [Hkv, group·T, n_kv]
        scores = scores.reshape(Hkv, group, T, n_kv)
        if T > 1:  # one new row sees the whole cache: nothing to mask (a decode step's usual case)
            query_pos = n_past + np.arange(T)
            future = np.arange(n_kv)[None, :] > query_pos[:, None]  # [T, n_kv]
            scores[:, :, future] = -np.inf
        probs = self.softmax(scores).reshape(Hkv, group * T, n_kv)
        out = probs @ v  # [Hkv, group·T, hd]
        return out.reshape(Hkv, group, T, hd).transpose(2, 0, 1, 3).reshape(T, H, hd)

    # -- Gated DeltaNet ----------------------------------------------------------------------------
    @staticmethod
    def causal_conv1d(x: np.ndarray, conv_state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Depthwise causal convolution; x [T, C], conv_state [K-1, C] (the previous inputs), w [C, K].

        out[t] = Σ_j w[:, j] · xp[t + j] with xp = conv_state ‖ x, so the last tap meets the current token.
        Returns (out [T, C], new conv_state [K-1, C]).
        """
        K = w.shape[1]
        T = x.shape[0]
        xp = np.concatenate([conv_state, x], axis=0)  # [K-1+T, C]
        out = np.zeros_like(x)
        for j in range(K):
            out += xp[j : j + T] * w[:, j]
        return out, xp[T:].copy()

    @staticmethod
    def delta_rule(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The gated delta rule, one token at a time (exact, and the same steps for prefill and decode).

        q, k [T, Hv, dk] (already expanded to the v heads), v [T, Hv, dv], g (log-decay) and beta [T, Hv],
        state S [Hv, dk, dv]. Per step: S ← e^g S; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq.
        Returns (o [T, Hv, dv], new state).
        """
        S = state.copy()
        out = np.empty_like(v)
        decay = np.exp(g)
        for t in range(q.shape[0]):
            S *= decay[t][:, None, None]
            kt = k[t]  # [Hv, dk]
            recalled = np.einsum("hkv,hk->hv", S, kt)  # Sᵀk
            delta = (v[t] - recalled) * beta[t][:, None]  # [Hv, dv]
            S += kt[:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", S, q[t])
        return out, S


@functools.lru_cache(maxsize=64)
def _rotations(positions: bytes, rotary_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, 1, rotary_dim/2] float32 of the positions (int64 bytes): every layer of a step
    rotates at the same positions, so a decode step computes them once, not once per layer."""
    half = rotary_dim // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    angles = np.frombuffer(positions, np.int64).astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = np.cos(angles).astype(F32)[:, None, :], np.sin(angles).astype(F32)[:, None, :]
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin
