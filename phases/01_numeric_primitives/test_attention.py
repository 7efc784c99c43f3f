"""varlen_attention and paged_decode_attention against float64 attention written here.

Outputs are allocated inside the ops, so the calls run with poisoned allocations
(torch.empty returns NaN): any element an op fails to write shows up as NaN.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from primitives_checks import TARGETS, assert_close, poisoned_allocations, rand, run_cases

SEEDS = st.integers(0, 2**31 - 1)
# (query/key head dim, value head dim): Qwen 64/128, MLA prefill 192 -> 128.
HEAD_DIMS = st.sampled_from([(64, 64), (128, 128), (192, 128)])


def attention_truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D], k [Lk, Hk, D], v [Lk, Hk, Dv] in float64; causal is bottom-right aligned."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        offset = k.shape[0] - q.shape[0]
        hidden = torch.arange(k.shape[0])[None, :] > torch.arange(q.shape[0])[:, None] + offset
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khe->qhe", torch.softmax(scores, dim=-1), v)


def within_budget(lengths: list[int], budget: int) -> list[int]:
    """The leading lengths whose sum stays within ``budget`` (the first one clipped to it)."""
    kept = [min(lengths[0], budget)]
    for n in lengths[1:]:
        if sum(kept) + n > budget:
            break
        kept.append(n)
    return kept


def varlen_case(target, max_seqs: int, max_tokens: int, kv_heads=(1, 2, 4), ratios=(1, 2, 4, 8)):
    def build(lengths_dims):
        q_lens, cached, kv_heads, ratio, dims, causal, seed = lengths_dims
        return q_lens, cached[: len(q_lens)], kv_heads, ratio, dims, causal, seed
    lens = st.lists(st.integers(1, max_tokens), min_size=1, max_size=max_seqs).map(
        lambda n: within_budget(n, max_tokens))
    prefix = st.lists(st.sampled_from([0, 0, 1, 17, 64]), min_size=max_seqs, max_size=max_seqs)
    return st.tuples(lens, prefix, st.sampled_from(kv_heads), st.sampled_from(ratios), HEAD_DIMS,
                     st.booleans(), SEEDS).map(build)


def run_varlen(target, attention, **heads):
    """``heads``: ``kv_heads`` / ``ratios`` to draw from (``varlen_case``'s defaults: GQA 1 to 8)."""
    def check(case):
        q_lens, cached, kv_heads, ratio, (head_dim, v_dim), causal, seed = case
        gen = torch.Generator().manual_seed(seed)
        k_lens = [lq + c for lq, c in zip(q_lens, cached)]  # a cached prefix: more keys than queries
        heads = kv_heads * ratio
        q = rand(gen, sum(q_lens), heads, head_dim, target=target)
        k = rand(gen, sum(k_lens), kv_heads, head_dim, target=target)
        v = rand(gen, sum(k_lens), kv_heads, v_dim, target=target)
        cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=target.device)
        cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=target.device)
        scale = head_dim ** -0.5
        with poisoned_allocations():
            out = attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, causal)
        want = torch.cat([attention_truth(q[a:b], k[c:d], v[c:d], scale, causal) for a, b, c, d in
                          zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())])
        assert_close(out, want, target.tol, f"varlen attention q_lens={q_lens} k_lens={k_lens}")

    # causal with cached prefixes (bottom-right alignment), GQA, and MLA's 192/128 head dims
    must = [([5, 3], [17, 0], 2, 4, (64, 64), True, 1), ([4, 6], [1, 9], 1, 2, (192, 128), True, 2)]
    run_cases(target, varlen_case(target, 4, min(300, target.max_tokens * 2), **heads), check, must)


def test_varlen_attention_matches_float64(target):
    """Ragged batch, GQA 1/2/4/8, head dims 64/128/192 (v 128), cached prefixes (bottom-right causal)."""
    run_varlen(target, target.ops.varlen_attention)


@pytest.mark.cuda
def test_cuda_triton_varlen_kernel_matches_float64():
    """The Triton varlen kernel itself in bf16 (on CUDA the op sends one causal sequence to cuDNN)."""
    from engine.model.kernels.triton.prefill_attention import flash_varlen_attention

    run_varlen(next(p.values[0] for p in TARGETS if p.id == "triton-cuda"), flash_varlen_attention)


def test_the_cudnn_route_takes_only_the_shapes_cudnn_serves():
    """cuDNN's dense attention gets one causal sequence of at least two rows without a cached
    prefix, in half precision with equal head dims up to 128 (multiples of 8); everything else,
    a one-token prompt first (cuDNN has no kernel for one key row), stays on the Triton kernel."""
    from engine.model.kernels.triton.prefill_attention import _cudnn_shape

    bf16 = torch.bfloat16
    for rows in (2, 3, 128, 4096):
        assert _cudnn_shape(1, rows, rows, True, bf16, 128, 128), rows
    assert _cudnn_shape(1, 77, 77, True, torch.float16, 64, 64)
    refused = {"one token": (1, 1, 1, True, bf16, 128, 128), "no rows": (1, 0, 0, True, bf16, 128, 128),
               "two sequences": (2, 64, 64, True, bf16, 128, 128), "a cached prefix": (1, 63, 64, True, bf16, 128, 128),
               "not causal": (1, 64, 64, False, bf16, 128, 128), "float32": (1, 64, 64, True, torch.float32, 128, 128),
               "MLA's 192 / 128": (1, 64, 64, True, bf16, 192, 128), "head 256": (1, 64, 64, True, bf16, 256, 256),
               "head 100": (1, 64, 64, True, bf16, 100, 100)}
    for case, args in refused.items():
        assert not _cudnn_shape(*args), case


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, padded, kv_heads, head_dim", [(300, 0, 8, 128), (1000, 24, 2, 64), (77, 3, 4, 128),
                                                                (1, 0, 8, 128), (2, 0, 8, 128)])
def test_one_causal_sequence_through_cudnn(tokens, padded, kv_heads, head_dim):
    """One causal prompt without a cached prefix goes to cuDNN's dense attention: its rows match float64
    attention, also when the step's rows carry padding after the sequence (which it must not see); a
    one-token prompt (no cuDNN kernel for one key row) runs on the Triton kernel and matches too."""
    from engine.model.kernels.triton import prefill_attention

    target = next(p.values[0] for p in TARGETS if p.id == "triton-cuda")
    assert prefill_attention._cudnn_attention_runs(torch.device("cuda")), "cuDNN attention does not run here"
    gen = torch.Generator().manual_seed(tokens)
    rows = tokens + padded
    q = rand(gen, rows, 32, head_dim, target=target)
    k, v = (rand(gen, rows, kv_heads, head_dim, target=target) for _ in range(2))
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    assert prefill_attention._one_causal_sequence(q, k, v, cu, True) == (rows >= 2)  # one row: the Triton kernel
    two = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device="cuda")
    refused = {"not causal": (q, k, v, cu, False), "two sequences": (q, k, v, two, True),
               "a cached prefix": (q[1:], k, v, cu, True), "float32": (q.float(), k.float(), v.float(), cu, True),
               "q/k 192 wide, v 128": (torch.cat([q, q[..., :64]], -1), torch.cat([k, k[..., :64]], -1), v, cu, True)}
    for case, args in refused.items():
        assert not prefill_attention._one_causal_sequence(*args), case
    out = prefill_attention.varlen_attention(q, k, v, cu, cu, tokens, tokens, head_dim ** -0.5, True)
    assert out.shape == (rows, 32, head_dim) and out.is_contiguous()
    want = attention_truth(q[:tokens], k[:tokens], v[:tokens], head_dim ** -0.5, True)
    assert_close(out[:tokens], want, target.tol, f"cuDNN attention, {tokens} tokens + {padded} padded")


def paged_case(num_blocks: int, block_size: int, context_lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Block tables [B, max_blocks] int32 of random, distinct block ids; unused entries are -1."""
    max_blocks = max(-(-n // block_size) for n in context_lens) + 1
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(context_lens):
        need = -(-n // block_size)
        tables[row, :need] = ids[used: used + need].to(torch.int32)
        used += need
    return tables


def decode_truth(q, k_cache, v_cache, tables, context_lens, scale, v_dim):
    outs = []
    for row, n in enumerate(context_lens):
        positions = torch.arange(n)
        blocks = tables[row].long()[positions // k_cache.shape[1]]
        keys = k_cache.cpu()[blocks, positions % k_cache.shape[1]]
        values = keys[..., :v_dim] if v_cache is None else v_cache.cpu()[blocks, positions % k_cache.shape[1]]
        outs.append(attention_truth(q[row: row + 1], keys, values, scale, causal=False))
    return torch.cat(outs)


def run_decode(target, kv_heads, ratio, head_dim, v_dim, latent, block_size, context_lens, seed, rope_dim=0,
               **kwargs):
    """``rope_dim`` > 0: the query's last ``rope_dim`` channels come as ``q_rope``, the rest as a
    head-major strided view (MLA's latent query out of its per-head bmm)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    q = rand(gen, len(context_lens), kv_heads * ratio, head_dim, target=target)
    k_cache = rand(gen, num_blocks, block_size, kv_heads, head_dim, target=target)
    v_cache = None if latent else rand(gen, num_blocks, block_size, kv_heads, v_dim, target=target)
    tables = paged_case(num_blocks, block_size, context_lens, gen)
    scale = head_dim ** -0.5
    query = {"q": q}
    if rope_dim:
        head_major = q[..., :head_dim - rope_dim].transpose(0, 1).contiguous().transpose(0, 1)
        query = {"q": head_major, "q_rope": q[..., head_dim - rope_dim:]}
    with poisoned_allocations():
        out = target.ops.paged_decode_attention(
            k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(target.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=target.device), softmax_scale=scale,
            v_head_dim=v_dim if latent else None, **query, **kwargs)
    want = decode_truth(q, k_cache, v_cache, tables, context_lens, scale, v_dim)
    assert_close(out, want, target.tol, f"paged decode context_lens={context_lens} block_size={block_size}")


def context_lengths(block_size: int, max_len: int):
    """Lengths of 1, exactly a block, one past a block, and anything else up to ``max_len``."""
    edges = st.sampled_from([1, block_size, block_size + 1, 2 * block_size - 1])
    return st.lists(st.one_of(edges, st.integers(1, max_len)).map(lambda n: min(n, max_len)), min_size=1, max_size=6)


def test_paged_decode_attention_matches_float64(target):
    """FM-008: block sizes 16 and 256, contexts crossing block boundaries, GQA 1/2/4/8, head dims 64/128."""
    max_len = 600 if target.max_tokens >= 300 else 300

    def check(case):
        (kv_heads, ratio, head_dim, block_size, seed), lens = case
        run_decode(target, kv_heads, ratio, head_dim, head_dim, False, block_size, lens, seed)

    shapes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([64, 128]),
                       st.sampled_from([16, 256]), SEEDS)
    run_cases(target, shapes.flatmap(lambda s: st.tuples(st.just(s), context_lengths(s[3], max_len))), check)


@pytest.mark.parametrize("block_size,rope_dim", [(16, 0), (256, 0), (16, 64)])
def test_paged_decode_attention_mla_latent_cache(target, block_size, rope_dim):
    """MLA decode: one KV head of 512 + 64, V = its first 512 channels, 16 query heads; with
    ``rope_dim`` the query comes as its latent part (a strided view) and ``q_rope``, never
    concatenated by the caller."""
    run_decode(target, 1, 16, 576, 512, True, block_size, [1, block_size + 3, 300][: 2 if target.max_tokens < 300
                                                                                     else 3], seed=block_size,
               rope_dim=rope_dim)


def test_paged_decode_empty_context_gives_a_zero_row(target):
    """A row with context length 0 (a padded graph row) is exactly zero, never 0/0 = NaN (NaN
    would poison MoE routing downstream); the other rows are unaffected."""
    gen = torch.Generator().manual_seed(3)
    block_size, lens = 16, [0, 21, 0]
    q = rand(gen, 3, 4, 64, target=target)
    k_cache, v_cache = (rand(gen, 4, block_size, 2, 64, target=target) for _ in range(2))
    tables = torch.tensor([[0, 0], [1, 2], [3, 0]], dtype=torch.int32)
    out = target.ops.paged_decode_attention(q, k_cache, v_cache, tables.to(target.device),
                                            torch.tensor(lens, dtype=torch.int32, device=target.device), 0.125)
    assert torch.equal(out[0::2].float().cpu(), torch.zeros(2, 4, 64))
    want = decode_truth(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], 0.125, 64)
    assert_close(out[1:2], want, target.tol, "paged decode beside empty rows")


@pytest.mark.parametrize("which,lens", [([0, 1, 0, 0, 2, 1, 0], [37, 20, 38, 40, 0, 23, 39]),
                                         ([0, 0, 0, 0, 0], [36, 40, 37, 0, 39])])
def test_paged_decode_rows_sharing_a_table(target, which, lens):
    """Rows that share a block table (a verify step's tokens and a draft's catch-up are one
    sequence's, each with its own context length), interleaved with other tables' rows, or all of
    one table, and an empty row: each row equals float64 attention over its own context (the CPU
    backend gathers a table's cache once for all its rows)."""
    gen = torch.Generator().manual_seed(5)
    block_size, tables_of = 16, paged_case(12, 16, [40, 23, 9], gen)
    tables = tables_of[which]
    q = rand(gen, len(which), 8, 64, target=target)
    k_cache, v_cache = (rand(gen, 12, block_size, 2, 64, target=target) for _ in range(2))
    with poisoned_allocations():
        out = target.ops.paged_decode_attention(q, k_cache, v_cache, tables.to(target.device),
                                                torch.tensor(lens, dtype=torch.int32, device=target.device), 0.125)
    assert torch.equal(out[lens.index(0)].float().cpu(), torch.zeros(8, 64))
    want = decode_truth(q, k_cache, v_cache, tables, lens, 0.125, 64)
    keep = [i for i, n in enumerate(lens) if n]
    assert_close(out[keep], want[keep], target.tol, "paged decode, rows sharing tables")


def test_paged_decode_query_in_two_parts_off_the_main_block(target):
    """``q_rope`` where the first part does not fill the head dim's main block (96 | 32 of 128, GQA):
    the same answer as the whole query (the Triton backend concatenates first)."""
    run_decode(target, 2, 4, 128, 128, False, 16, [5, 40], seed=3, rope_dim=32)


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("head_dim, splits, fused", [(64, None, None), (128, 3, False), (128, 4, True)])
def test_paged_decode_in_column_chunks(target, chunks, head_dim, splits, fused):
    """The Triton launch that splits keys and values into ``chunks`` column blocks (a dot and an
    accumulator each) equals float64 attention: GQA 4, contexts across blocks and tiles, one split
    (the output written by the split kernel) and several (parts merged by a second launch or by the
    last split to arrive)."""
    if "triton" not in target.module:
        pytest.skip("chunks is a Triton-backend knob")
    run_decode(target, 2, 4, head_dim, head_dim, False, 16, [1, 17, 70], seed=chunks + head_dim, chunks=chunks,
               block_n=16, num_splits=splits, fused_merge=fused)


def test_triton_decode_attention_refuses_what_it_cannot_launch():
    """The Triton wrapper's refusals, before any launch (so they run without a GPU): more than
    65,535 sequences (the grid's y dimension), fp16 dots over a cache that is not e4m3 (a bf16
    value past ±65,504 would become inf) and column chunks where the head is not one power-of-two
    block for keys and values (MLA's 512 + 64) are ValueErrors naming the limit."""
    pytest.importorskip("triton")
    from engine.model.kernels.triton.decode_attention import paged_decode_attention

    cache = torch.zeros(1, 16, 1, 16)
    many = 65536
    with pytest.raises(ValueError, match="65,535 sequences"):
        paged_decode_attention(torch.zeros(many, 1, 16), cache, cache, torch.zeros(many, 1, dtype=torch.int32),
                               torch.ones(many, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="fp16_dots needs an e4m3 cache"):
        paged_decode_attention(torch.zeros(2, 1, 16), cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 1.0, fp16_dots=True)
    latent = torch.zeros(1, 16, 1, 576)
    with pytest.raises(ValueError, match="chunks=4"):
        paged_decode_attention(torch.zeros(2, 16, 576), latent, None, torch.zeros(2, 1, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 1.0, v_head_dim=512, chunks=4)
