"""ModelRunner: step metadata against the BlockManager's own tables, the eager decode gates."""
import pytest
import torch

from engine.attention_context import reset_context, set_context
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint
from phases.harness import assert_no_host_sync_and_no_copies, count_step

BLOCK = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "Qwen3ForCausalLM", seed=7)
    return LLMEngine(path, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=96)


def start_decoding(engine, prompts, max_tokens=20):
    """Queue ``prompts`` and step until every one has prefilled and decoded once."""
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    for _ in range(len(prompts) + 1):
        engine.step()
    return [engine._requests[i].seq for i in ids]


def finish(engine):
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()


def expected_slot(seq, position):
    """The cache slot of ``position`` by the BlockManager's table, computed here."""
    return seq.block_table[position // BLOCK] * BLOCK + position % BLOCK


def test_block_tables_and_decode_context_follow_the_block_manager(engine):
    """Each running sequence's device row equals its BlockManager table after every step
    (blocks appended at boundaries are written), and the decode context's slots, context
    lengths and positions are those the BlockManager implies (FM-025, FM-040)."""
    runner = engine.runner
    seqs = start_decoding(engine, [[3] * 3, list(range(2, 9)), list(range(10, 21))])
    for _ in range(6):  # cross block boundaries while decoding
        live = [s for s in seqs if not s.is_finished]
        for seq in live:
            row = runner._row_of[seq.request_id]
            assert runner.block_tables[row, :len(seq.block_table)].tolist() == seq.block_table
        for seq in live:
            engine.block_manager.append_slot(seq)
        runner._sync_block_tables(live)
        input_ids, positions, ctx = runner.prepare_decode(live)
        assert input_ids.tolist() == [s.last_token_id for s in live]
        assert positions.tolist() == [s.num_tokens - 1 for s in live]
        assert ctx.context_lens.tolist() == [s.num_tokens for s in live]
        assert ctx.slot_mapping.tolist() == [expected_slot(s, s.num_tokens - 1) for s in live]
        for i, seq in enumerate(live):
            assert ctx.block_tables[i, :len(seq.block_table)].tolist() == seq.block_table
        engine.scheduler.postprocess(live, False, runner.run(live, is_prefill=False))
    for seq in seqs:
        engine.abort_request(seq.request_id)
    finish(engine)


def test_prefill_context_skips_cached_prefix_tokens(engine):
    """A prompt whose first blocks are cached computes only its new tokens, and reads every
    context token's K/V from the slots of its block table."""
    shared = list(range(30, 50))
    start_decoding(engine, [shared + [1]], max_tokens=2)
    finish(engine)
    rid = engine.add_request(shared + [2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    seq = engine._requests[rid].seq
    batch, is_prefill = engine.scheduler.schedule()
    assert batch == [seq] and is_prefill and seq.num_cached_tokens == 20
    engine.runner._sync_block_tables(batch)
    input_ids, positions, ctx, last = engine.runner.prepare_prefill(batch)
    assert input_ids.tolist() == [2, 3] and positions.tolist() == [20, 21]
    assert ctx.slot_mapping.tolist() == [expected_slot(seq, 20), expected_slot(seq, 21)]
    assert ctx.prefill_kv_slots.tolist() == [expected_slot(seq, p) for p in range(22)]
    assert ctx.cu_seqlens_q.tolist() == [0, 2] and ctx.cu_seqlens_k.tolist() == [0, 22] and last.tolist() == [1]
    engine.scheduler.postprocess(batch, True, engine.runner.run(batch, True))
    finish(engine)


def decode_forward_ops(engine, monkeypatch):
    """Op counts of one decode forward of the model as the runner sets it up."""
    runner = engine.runner
    seqs = start_decoding(engine, [list(range(2, 12)), [5, 6, 7]])
    input_ids, positions, ctx = runner.prepare_decode(seqs)
    set_context(ctx)
    try:
        ops = count_step(lambda: runner.model(input_ids, positions), monkeypatch)
    finally:
        reset_context()
    for seq in seqs:
        engine.abort_request(seq.request_id)
    finish(engine)
    return ops


def test_decode_forward_has_no_host_sync(engine, monkeypatch):
    ops = decode_forward_ops(engine, monkeypatch)
    assert ops.host_reads == [], ops.host_reads
    assert ops.counts.get("item", 0) == 0 and ops.counts.get("_local_scalar_dense", 0) == 0, ops.counts


def test_eager_decode_does_not_clone(engine, monkeypatch):
    assert_no_host_sync_and_no_copies(decode_forward_ops(engine, monkeypatch))


def test_decode_inputs_live_in_static_buffers(engine):
    """Decode input tensors are views of buffers allocated once (what phase 11 captures)."""
    runner = engine.runner
    seqs = start_decoding(engine, [[4, 5, 6], [7, 8]])
    buffers = (runner.decode_inputs.data_ptr(), runner.decode_tables.data_ptr())
    input_ids, positions, ctx = runner.prepare_decode(seqs)
    assert input_ids.data_ptr() == buffers[0] and ctx.block_tables.data_ptr() == buffers[1]
    assert positions.untyped_storage().data_ptr() == runner.decode_inputs.untyped_storage().data_ptr()
    for seq in seqs:
        engine.abort_request(seq.request_id)
    finish(engine)


def test_padded_decode_rows_are_harmless(engine):
    """The graph path's padded decode (phase 11 captures exactly these device ops): padding rows
    read the padding row's null block, write nowhere (slot -1) and leave the real rows' logits
    equal to the unpadded step's; over the full block-table width as a graph sees it."""
    runner = engine.runner
    seqs = start_decoding(engine, [list(range(2, 9)), [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    with torch.inference_mode():
        expected = runner._forward(*runner.prepare_decode(seqs))
        caches = [c.clone() for c in runner.kv_caches]
        size = runner.decode_inputs.shape[1]  # max_num_seqs: two real rows, two padding rows
        runner._stage_decode(seqs, size)
        input_ids, positions, ctx = runner._decode_inputs(size, runner.max_blocks_per_seq)
        assert ctx.slot_mapping[len(seqs):].tolist() == [-1] * (size - len(seqs))
        assert ctx.context_lens[len(seqs):].tolist() == [1] * (size - len(seqs))
        padded = runner._forward(input_ids, positions, ctx)
    torch.testing.assert_close(padded[:len(seqs)], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded).all()
    real_slots = [expected_slot(s, s.num_tokens - 1) for s in seqs]
    for before, after in zip(caches, runner.kv_caches):
        flat_before, flat_after = before.flatten(-4, -3), after.flatten(-4, -3)  # [..., slots, H, D]
        untouched = torch.ones(flat_before.shape[-3], dtype=torch.bool)
        untouched[real_slots] = False
        assert torch.equal(flat_before[..., untouched, :, :], flat_after[..., untouched, :, :]), \
            "a padding row wrote into the cache"
        torch.testing.assert_close(flat_after[..., real_slots, :, :], flat_before[..., real_slots, :, :])
    for seq in seqs:
        engine.abort_request(seq.request_id)
    finish(engine)
