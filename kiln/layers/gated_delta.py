"""The ops of a gated DeltaNet linear-attention layer (Qwen3-Next): the causal depthwise conv1d over the mixed
q/k/v channels, and the gated delta rule that folds each token into a per-request recurrent state.

They compute what transformers' torch fallbacks compute (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d_fn / causal_conv1d_update), so that Kiln's greedy tokens are the
reference's: the prefill goes through the chunked form (a UT transform per chunk, then a scan over chunks), the
decode through one recurrent step (delta_rule_step) over the whole batch. Unlike the reference, every form
continues from a saved state, which is what chunked prefill and decode need, and the conv state keeps only the
(kernel - 1) input columns the next token reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # transformers' torch fallback's chunk: other sizes change the float rounding, not the result


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim, as the FLA library and transformers compute it (rsqrt of the sum + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------- conv1d
def causal_conv1d_extend(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new tokens through the causal depthwise conv, then SiLU.

    x: [T, C] (tokens, channels); weight: [C, K]; conv_state: [C, K - 1], the last K - 1 inputs before these
    tokens (None: the request starts here, and the inputs before it are zeros, as the reference's left padding).
    Returns (out [T, C], the new conv state [C, K - 1]), the state taken before the activation (inputs, not
    outputs, are what the next token's window reads)."""
    channels, kernel = weight.shape
    if conv_state is None:
        conv_state = x.new_zeros(channels, kernel - 1)
    window = torch.cat((conv_state.to(x.dtype), x.t()), dim=-1)  # [C, K - 1 + T]
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=channels)[0]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - (kernel - 1) :]


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: x [B, C], conv_state [B, C, K - 1] -> (SiLU(conv) [B, C], the new state
    [B, C, K - 1], a view of the window that the caller copies into the pool)."""
    window = torch.cat((conv_state.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(dim=-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


# ---------------------------------------------------------------------------------------------- delta rule
def _heads_first_f32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[B, T, H, ...] -> [B, H, T, ...] float32, contiguous."""
    return [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in tensors]


def _grouped(query: torch.Tensor, key: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query/key head serves value_heads / key_heads consecutive value heads (grouped value attention)."""
    repeat = value_heads // key.shape[2]
    if repeat == 1:
        return query, key
    return query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, chunk by chunk (transformers' torch_chunk_gated_delta_rule with
    use_qk_l2norm_in_kernel, the way Qwen3-Next calls it).

    query, key: [B, T, Hk, Dk]; value: [B, T, Hv, Dv]; g (log decay, <= 0) and beta: [B, T, Hv];
    initial_state: [B, Hv, Dk, Dv] or None (zeros). Returns (out [B, T, Hv, Dv] in query's dtype, the final
    state [B, Hv, Dk, Dv] float32). Padding the tail up to a whole chunk leaves the final state as it is:
    padded tokens have k = 0 and g = 0, so they neither write nor decay."""
    dtype = query.dtype
    batch, length = key.shape[:2]
    value_heads, value_dim = value.shape[-2:]
    query, key = _grouped(query, key, value_heads)
    query, key, value, beta, decay = _heads_first_f32(query, key, value, beta, g)
    query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    beta, decay = (F.pad(t, (0, pad)) for t in (beta, decay))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (
        t.reshape(t.shape[0], t.shape[1], -1, chunk_size, t.shape[-1]) for t in (query, key, k_beta, v_beta)
    )
    cum_decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size).cumsum(dim=3)

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra_chunk = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = new_values.new_zeros(batch, value_heads, key.shape[-1], value_dim)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra_chunk[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, value_heads, -1, value_dim)[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (transformers' torch_recurrent_gated_delta_rule): same arguments and
    results as chunk_gated_delta_rule, initial_state left as it is. Each token is one delta_rule_step."""
    batch, length = key.shape[:2]
    value_heads, value_dim = value.shape[-2:]
    if initial_state is None:
        state = value.new_zeros(batch, value_heads, key.shape[-1], value_dim, dtype=torch.float32)
    else:
        state = initial_state.to(torch.float32, copy=True)
    outs = [
        delta_rule_step(query[:, i], key[:, i], value[:, i], g[:, i], beta[:, i], state)
        for i in range(length)
    ]
    return torch.stack(outs, dim=1), state


def delta_rule_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token per request, the state updated in place: query, key [B, Hk, Dk]; value [B, Hv, Dv]; g, beta
    [B, Hv]; state [B, Hv, Dk, Dv] float32, the caller's own (a gathered copy, never a view of the pool).

    Decay, read what the state predicts for the key, write beta times the miss, read the query: the reference's
    arithmetic with its two reductions over Dk as batched matmuls and its updates in place, since fresh
    state-sized tensors per step cost more than the arithmetic (the allocator hands big blocks back to the
    system and faults them in again). Returns the output [B, Hv, Dv] in query's dtype."""
    dtype = query.dtype
    repeat = value.shape[1] // key.shape[1]
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=1), key.repeat_interleave(repeat, dim=1)
    query, key = l2norm(query.float()), l2norm(key.float())
    query = query * query.shape[-1] ** -0.5
    state.mul_(g.float().exp()[..., None, None])
    predicted = (key.unsqueeze(-2) @ state).squeeze(-2)  # [B, Hv, Dv]
    delta = (value.float() - predicted) * beta.float().unsqueeze(-1)
    batch, heads, key_dim, value_dim = state.shape
    flat = state.view(batch * heads, key_dim, value_dim)
    flat.baddbmm_(key.reshape(batch * heads, key_dim, 1), delta.reshape(batch * heads, 1, value_dim))
    return (query.unsqueeze(-2) @ state).squeeze(-2).to(dtype)


def delta_rule_extend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's extend (arguments and results as chunk_gated_delta_rule's, B = 1) in the form that costs
    least for its length: one token is one recurrent step; a short extend runs in chunks of the next power of
    two rather than padded up to 64, since padding costs the full chunk's work; 64 tokens and more run in the
    reference's chunks of 64. The forms differ in rounding only."""
    length = key.shape[1]
    if length == 1:
        return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state)
    chunk = min(CHUNK_SIZE, 1 << (length - 1).bit_length())
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state, chunk_size=chunk)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head log decay g = -exp(A_log) * softplus(a + dt_bias) (float32: in half
    precision exp(A_log) can overflow to inf) and the write strength beta = sigmoid(b)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()
