"""A stand-in for the Kernels Hub's `kernels-community/flash-attn2` made of PyTorch's own FlashAttention kernels, for
`make gpu-check` on a GPU machine that has neither the flash-attn package nor a route to the Hub (the lent one).

gpu-check points the `kernels` package at this folder (LOCAL_KERNELS=kernels-community/flash-attn2=<here>, kernels'
own override for a repo), so a rank that asks for `kernels-community/flash-attn2` goes through everything transformers
does for a Hub kernel (hub_kernels.load_and_register_attn_kernel, the flash mask, modeling_flash_attention_utils'
packed-sequence detection from position_ids and its cumulative lengths) and ends in the two functions below, with
flash-attn 2's signatures:
- `flash_attn_varlen_func`: torch.nn.attention.varlen.varlen_attn, PyTorch's FlashAttention-2 varlen kernel (CUDA);
- `flash_attn_func`: scaled_dot_product_attention restricted to SDPA's flash backend (an error, never a fallback).
Anything flash-attn would do that these cannot (dropout, a sliding window, softcap, ALiBi) raises. On CPU (the tests
here, which check the plumbing, not the kernel) both compute the same attention with SDPA's math, document by document.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

KERNEL = "PyTorch's FlashAttention (torch.nn.attention.varlen + SDPA's flash backend)"


def _refuse(dropout_p, window_size, softcap, alibi_slopes) -> None:
    if dropout_p:
        raise NotImplementedError(f"orch's torch-flash stand-in: attention dropout {dropout_p} is not supported")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"orch's torch-flash stand-in: sliding window {tuple(window_size)} is not supported")
    if softcap:
        raise NotImplementedError(f"orch's torch-flash stand-in: softcap {softcap} is not supported")
    if alibi_slopes is not None:
        raise NotImplementedError("orch's torch-flash stand-in: ALiBi is not supported")


def _kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention as flash-attn takes it (fewer key/value heads), repeated to the query's heads."""
    groups = q.shape[head_dim] // k.shape[head_dim]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=head_dim), v.repeat_interleave(groups, dim=head_dim)


def _sdpa(q, k, v, causal: bool, scale: float | None, flash: bool) -> torch.Tensor:
    """[batch, seq, heads, dim] in and out, as flash-attn's dense function."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v = _kv_heads(q, k, v, head_dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    backend = SDPBackend.FLASH_ATTENTION if flash else SDPBackend.MATH
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False):  # fmt: skip
    _refuse(dropout_p, window_size, softcap, alibi_slopes)
    return _sdpa(q, k, v, causal, softmax_scale, flash=q.is_cuda)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False):  # fmt: skip
    """[total tokens, heads, dim] with the documents' cumulative lengths, as flash-attn's varlen function."""
    _refuse(dropout_p, window_size, softcap, alibi_slopes)
    if not q.is_cuda:  # the plumbing's check on CPU: each document alone
        starts, ends = cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:]
        kstarts = cu_seqlens_k.tolist()[:-1]
        parts = [_sdpa(q[None, a:b], k[None, c:c + b - a], v[None, c:c + b - a], causal, softmax_scale, flash=False)[0]
                 for a, b, c in zip(starts, ends, kstarts, strict=True)]  # fmt: skip
        return torch.cat(parts)
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters  # its keywords moved between torch 2.9 and 2.13
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = softmax_scale
    elif softmax_scale is not None and abs(softmax_scale - q.shape[-1] ** -0.5) > 1e-6:
        raise NotImplementedError(f"orch's torch-flash stand-in: varlen_attn here takes no scale ({softmax_scale})")
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    else:
        k, v = _kv_heads(q, k, v, head_dim=1)
    cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    return varlen_attn(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), **kwargs)
