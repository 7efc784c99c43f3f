"""Shared by the phase-09 tests: the HF transformers greedy oracle, prompts, and the
block-leak check every engine test ends with."""
from __future__ import annotations

import torch

VOCAB = 512  # the tiny checkpoints' vocabulary (phases/checkpoints.py)


def prompts_with_shared_prefix(seed: int = 0, count: int = 9) -> list[list[int]]:
    """``count`` token-id prompts of different lengths (2..40); the last three share a
    40-token prefix, so later ones hit the prefix cache once the first has run."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [2, 5, 9, 17, 23, 31, 40][:max(0, count - 3)]
    prompts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    prefix = torch.randint(2, VOCAB, (40,), generator=gen).tolist()
    prompts += [prefix + torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (3, 7, 1)]
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = 1,
              dtype=torch.float32, device="cpu") -> list[list[int]]:
    """transformers' own ``generate`` (greedy), one prompt at a time (no padding), on the
    checkpoint in ``model_dir``; stops at ``eos_token_id`` (kept, as our engine keeps it). Under
    torchrun (a process group initialised) rank 0 generates and every rank gets its tokens: the
    other ranks would generate the same, each paying for transformers' model code again."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return _hf_generate(model_dir, prompts, max_new_tokens, eos_token_id, dtype, device)
    tokens = [_hf_generate(model_dir, prompts, max_new_tokens, eos_token_id, dtype, device)
              if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tokens, src=0)
    return tokens[0]


def _hf_generate(model_dir, prompts, max_new_tokens, eos_token_id, dtype, device) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def assert_no_block_leaks(engine) -> None:
    """Once idle, every KV block is free and no block-table row is held."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert not any(bm.ref_counts)
    assert not engine.runner.held, f"runner state (block-table rows, caches) still held by {sorted(engine.runner.held)}"


def shrink_kv_pool(engine, num_blocks: int) -> None:
    """Let an idle ``engine`` schedule only the first ``num_blocks`` blocks of its KV pool (on
    CPU the pool holds max_num_seqs x max_model_len tokens, so nothing would ever be preempted):
    a new BlockManager, and a Scheduler with the same settings over it."""
    from engine.scheduling.block_manager import BlockManager
    from engine.scheduling.scheduler import Scheduler

    old = engine.scheduler
    assert not old.has_unfinished() and num_blocks <= engine.runner.num_blocks
    engine.block_manager = BlockManager(num_blocks, old.block_manager.block_size,
                                        old.block_manager.enable_prefix_caching)
    engine.scheduler = Scheduler(old.settings, engine.block_manager, old.eos_token_ids, old.drafter, old.on_free,
                                 old.watermark)
