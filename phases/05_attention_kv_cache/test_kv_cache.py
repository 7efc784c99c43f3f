"""KV cache sizing (from the workload, capped by memory, bound once per layer) and the
per-step attention context that maps tokens onto the paged cache."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.distributed import TPGroup
from engine.model.layers.gqa_attention import GQAAttention
from engine.worker.kv_cache import (
    attention_layers,
    bind_kv_cache,
    free_memory_bytes,
    kv_bytes_per_token,
    plan_num_blocks,
)
from phases.harness import engine_config


def tiny_model(rank=0, size=1):
    """One Qwen attention per layer of the tiny config: the cache-owning part of the model
    (the whole model needs phases 06 and 07)."""
    cfg = engine_config()
    tp = TPGroup(rank=rank, size=size)
    return cfg, nn.ModuleList(GQAAttention(cfg, tp) for _ in range(cfg.num_hidden_layers))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_bytes_per_token_is_layers_x_local_kv_heads_x_head_dim_x_2_x_dtype(size):
    cfg, model = tiny_model(rank=size - 1, size=size)
    local_kv_heads = max(1, cfg.num_key_value_heads // size)
    for dtype, elem in [(torch.float32, 4), (torch.bfloat16, 2)]:
        want = cfg.num_hidden_layers * local_kv_heads * cfg.head_dim * 2 * elem
        assert kv_bytes_per_token(model, dtype) == want


def test_pool_is_sized_from_the_workload_not_the_model_maximum():
    # 4 sequences x 1000 tokens at block 16 -> 4 * 63 blocks, whatever max_position_embeddings says
    assert plan_num_blocks(1024, 16, max_num_seqs=4, max_model_len=1000) == 4 * math.ceil(1000 / 16)
    plenty = 10 * 2**30
    assert plan_num_blocks(1024, 16, 4, 1000, free_bytes=plenty) == 4 * 63


def test_pool_is_capped_by_memory_utilisation_of_free_memory():
    per_block = 1024 * 16
    free = 100 * per_block
    assert plan_num_blocks(1024, 16, 64, 1000, free_bytes=free, memory_utilization=0.9) == 90


def test_pool_too_small_for_one_sequence_is_a_clear_error():
    """The error names the flags that size the pool; a utilisation out of (0, 1] is refused."""
    with pytest.raises(ValueError, match="max_model_len") as caught:
        plan_num_blocks(1024, 16, 4, 1000, free_bytes=10 * 1024 * 16)
    assert all(flag in str(caught.value) for flag in ("--max-model-len", "--mem-utilization", "--kv-cache-memory"))
    with pytest.raises(ValueError, match="memory_utilization"):
        plan_num_blocks(1024, 16, 4, 1000, free_bytes=2**30, memory_utilization=1.5)


def test_free_memory_on_the_host_is_what_the_host_has_available():
    """On CPU the pool's memory is the host's available memory: /proc/meminfo's MemAvailable where
    there is one (read independently here), positive and no more than the host's total."""
    free = free_memory_bytes(torch.device("cpu"))
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        fields = {line.split(":")[0]: int(line.split()[1]) << 10 for line in meminfo.read_text().splitlines()}
        assert 0 < free <= fields["MemTotal"]
        assert abs(free - fields["MemAvailable"]) < fields["MemTotal"] // 10  # read moments apart
    else:
        assert free > 0


def test_bind_gives_every_layer_its_own_paged_cache():
    cfg, model = tiny_model()
    caches = bind_kv_cache(model, num_blocks=7, block_size=16, dtype=torch.float32, device="cpu")
    layers = attention_layers(model)
    assert len(layers) == len(caches) == cfg.num_hidden_layers
    for layer, cache in zip(layers, caches):
        assert layer.k_cache.shape == layer.v_cache.shape == (7, 16, cfg.num_key_value_heads, cfg.head_dim)
        assert layer.k_cache.data_ptr() == cache[0].data_ptr()
        assert layer.v_cache.data_ptr() == cache[1].data_ptr()
    ptrs = {a.k_cache.data_ptr() for a in layers} | {a.v_cache.data_ptr() for a in layers}
    assert len(ptrs) == 2 * len(layers)


def test_step_context_rejects_impossible_layouts():
    from phases.harness import prefill_context

    with pytest.raises(ValueError, match="cached tokens"):
        prefill_context([5], [5], [[0]], 16, "cpu")  # nothing left to compute
    with pytest.raises(ValueError, match="cannot hold"):
        prefill_context([17], [0], [[0]], 16, "cpu")  # 17 tokens in one 16-slot block


def test_step_context_maps_tokens_to_their_blocks():
    """Slots follow each sequence's own (non-contiguous) block table; cu_seqlens
    count only the new tokens for queries and every token for keys."""
    from phases.harness import decode_context, prefill_context

    positions, ctx = prefill_context([3, 18], [0, 16], [[7], [2, 5]], 16, "cpu")
    assert positions.tolist() == [0, 1, 2, 16, 17]
    assert ctx.slot_mapping.tolist() == [112, 113, 114, 80, 81]
    assert ctx.cu_seqlens_q.tolist() == [0, 3, 5] and ctx.cu_seqlens_k.tolist() == [0, 3, 21]
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (3, 18)
    assert ctx.prefill_kv_slots.tolist() == [112, 113, 114] + list(range(32, 48)) + [80, 81]
    assert prefill_context([3], [0], [[7]], 16, "cpu")[1].prefill_kv_slots is None  # nothing cached: this step's K/V
    positions, ctx = decode_context([4, 17], [[7], [2, 5]], 16, "cpu")
    assert positions.tolist() == [3, 16] and ctx.slot_mapping.tolist() == [115, 80]
    assert ctx.block_tables.dtype == ctx.context_lens.dtype == torch.int32
    assert ctx.block_tables.tolist() == [[7, 0], [2, 5]] and ctx.context_lens.tolist() == [4, 17]
