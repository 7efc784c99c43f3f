"""ModelRunner: step metadata against the BlockManager's own tables (also while a step is in
flight and its tokens are fed on the device), mixed steps, the eager decode gates."""
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.model.attention_context import forward_context
from engine.scheduling.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint
from phases.harness import assert_no_host_sync_and_no_copies, count_step

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "Qwen3ForCausalLM", seed=7)


@pytest.fixture(scope="module")
def engine(checkpoint):
    """A synchronous engine: between steps nothing is in flight, so a test can drive the
    scheduler and the runner by hand."""
    return LLMEngine(checkpoint, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=96,
                     overlap=False)


def greedy(max_tokens=20):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def start_decoding(engine, prompts, max_tokens=20):
    """Queue ``prompts`` and step until every one has prefilled and decoded once."""
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    for _ in range(2):
        engine.step()
    return [engine.sequence(i) for i in ids]


def finish(engine):
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()


def abort_all(engine, seqs):
    for seq in seqs:
        engine.abort_request(seq.request_id)
    finish(engine)


def expected_slot(seq, position):
    """The cache slot of ``position`` by the BlockManager's table, computed here."""
    return seq.block_table[position // BLOCK] * BLOCK + position % BLOCK


def staged_decode(engine):
    """Schedule the next (decode) batch and prepare it as a decode step does, in the static
    buffers, over the whole table width as a graph runs it: (batch, its ForwardBatch);
    ``complete`` runs and postprocesses it."""
    batch = engine.scheduler.schedule()
    assert batch.is_decode
    return batch, engine.runner.prepare(batch, decode_size=len(batch))


def complete(engine, batch):
    engine.postprocess(engine.runner.launch(batch))


class ForwardRecorder:
    """Records every forward the runner runs: its batch with each sequence's block table at
    launch, and clones of its input ids, positions and attention context tensors taken when the
    forward runs (before later steps overwrite them)."""

    def __init__(self, runner, monkeypatch):
        self.steps, self.launched = [], None
        real_launch, real_forward = runner.launch, runner.forward

        def launch(batch, previous=None):
            self.launched = batch, [list(s.block_table) for s in batch.seqs]
            return real_launch(batch, previous)

        def forward(step):
            ctx = step.attention
            fields = {name: getattr(ctx, name).clone() if isinstance(getattr(ctx, name), torch.Tensor)
                      else getattr(ctx, name) for name in vars(ctx)}
            self.steps.append((*self.launched, step.input_ids.clone(), step.positions.clone(), fields))
            return real_forward(step)
        monkeypatch.setattr(runner, "launch", launch)
        monkeypatch.setattr(runner, "forward", forward)


@pytest.mark.parametrize("overlap", [False, True])
def test_block_tables_and_decode_context_follow_the_block_manager(checkpoint, monkeypatch, overlap):
    """Every forward's inputs are those the BlockManager's tables imply: each decode row's token
    is the sequence's token at its position (with overlap, the previous step's sampled id, fed
    on the device before the host knows it), its position, slot, context length and block-table
    row follow the sequence's table across block boundaries; mixed steps put decode rows first
    (FM-025, FM-040)."""
    engine = LLMEngine(checkpoint, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
                       overlap=overlap)
    recorder = ForwardRecorder(engine.runner, monkeypatch)
    prompts = [[3] * 3, list(range(2, 9)), list(range(10, 31)), list(range(40, 45))]
    for prompt in prompts:
        engine.add_request(prompt, greedy(9))
    while engine.has_unfinished_requests():
        engine.step()
    seen_mixed = seen_pending = 0
    for batch, tables, input_ids, positions, ctx in recorder.steps:
        offset = 0
        decode_rows = len(batch) if not ctx["has_prefill"] else ctx["num_decode_tokens"]
        seen_mixed += ctx["has_prefill"] and decode_rows > 0
        for i, (seq, table, start, n) in enumerate(zip(batch.seqs, tables, batch.starts, batch.num_tokens)):
            assert input_ids[offset:offset + n].tolist() == seq.token_ids[start:start + n]
            assert positions[offset:offset + n].tolist() == list(range(start, start + n))
            assert ctx["slot_mapping"][offset:offset + n].tolist() == [
                table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
            if i < decode_rows:
                assert n == 1 and ctx["context_lens"][i] == start + 1
                width = -(-(start + 1) // BLOCK)
                assert ctx["block_tables"][i, :width].tolist() == table[:width]
                seen_pending += start >= seq.num_prompt_tokens
            offset += n
    assert seen_mixed, "no step mixed decodes with prefill chunks"
    assert seen_pending, "no decode fed a sampled token"
    assert not engine.runner.held


def test_prefill_context_skips_cached_prefix_tokens(engine):
    """A prompt whose first blocks are cached computes only its new tokens, and reads every
    context token's K/V from the slots of its block table."""
    shared = list(range(30, 50))
    start_decoding(engine, [shared + [1]], max_tokens=2)
    finish(engine)
    rid = engine.add_request(shared + [2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    seq = engine.sequence(rid)
    batch = engine.scheduler.schedule()
    assert batch.seqs == [seq] and batch.starts == [20] and batch.num_tokens == [2] and seq.num_cached_tokens == 20
    step = engine.runner.prepare(batch)
    input_ids, positions, ctx, last = step.input_ids, step.positions, step.attention, step.logits_indices
    assert input_ids.tolist() == [2, 3] and positions.tolist() == [20, 21]
    assert ctx.slot_mapping.tolist() == [expected_slot(seq, 20), expected_slot(seq, 21)]
    assert ctx.prefill_kv_slots.tolist() == [expected_slot(seq, p) for p in range(22)]
    assert ctx.cu_seqlens_q.tolist() == [0, 2] and ctx.cu_seqlens_k.tolist() == [0, 22] and last.tolist() == [1]
    assert ctx.num_decode_tokens == 0
    complete(engine, batch)
    finish(engine)


def test_mixed_step_puts_decode_rows_first(engine):
    """A step that decodes one sequence while another prefills: the decode row comes first, at
    its own position and context length (never a prefill position), the prefill chunk after it
    with its own cu_seqlens; each entry's logits row is its last token."""
    (decoding,) = start_decoding(engine, [list(range(2, 9))])
    rid = engine.add_request(list(range(60, 66)), greedy())
    batch = engine.scheduler.schedule()
    prefilling = engine.sequence(rid)
    assert batch.seqs == [decoding, prefilling] and batch.num_tokens == [1, 6]
    step = engine.runner.prepare(batch)
    input_ids, positions, ctx, last = step.input_ids, step.positions, step.attention, step.logits_indices
    pos = decoding.num_tokens - 2  # its newest token (this step appends a pending one)
    assert ctx.has_prefill and ctx.num_decode_tokens == 1
    assert input_ids.tolist() == [decoding.last_token_id, *range(60, 66)]
    assert positions.tolist() == [pos, *range(6)]
    assert ctx.context_lens.tolist() == [pos + 1]
    assert ctx.block_tables[0].tolist() == decoding.block_table[:ctx.block_tables.shape[1]]
    assert ctx.cu_seqlens_q.tolist() == [0, 6] and ctx.cu_seqlens_k.tolist() == [0, 6] and last.tolist() == [0, 6]
    complete(engine, batch)
    abort_all(engine, [decoding, prefilling])


def test_one_token_prefill_chunks_beside_a_decode_read_their_own_tokens(checkpoint):
    """A token budget of two: a prompt is prefilled one token per step beside another's decode
    (every entry computes one token, so the step takes the decode path); each chunk feeds its own
    prompt token, not the prompt's last. Both outputs are transformers' greedy tokens."""
    import transformers

    engine = LLMEngine(checkpoint, block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=2, max_model_len=64,
                       overlap=False)
    prompts = [[5, 6, 7], list(range(20, 27))]
    first = engine.add_request(prompts[0], greedy(12))
    engine.step()  # prefilled: it decodes from the next step on
    second = engine.add_request(prompts[1], greedy(4))
    chunks = []
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()
        chunks += [start for seq, start in zip(batch.seqs, batch.starts)
                   if seq.request_id == second and start < len(prompts[1])]
        engine.postprocess(engine.runner.launch(batch))
    assert chunks == list(range(len(prompts[1])))  # one token per step, beside the decode
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    for rid, prompt, new in ((first, prompts[0], 12), (second, prompts[1], 4)):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
        assert engine.pop_request(rid).token_ids == expected[0, len(prompt):].tolist()


def decode_forward_ops(engine, monkeypatch):
    """Op counts of one decode forward of the model as the runner sets it up."""
    runner = engine.runner
    seqs = start_decoding(engine, [list(range(2, 12)), [5, 6, 7]])
    batch, step = staged_decode(engine)
    try:
        with forward_context(step.attention):
            ops = count_step(lambda: runner.model(step.input_ids, step.positions), monkeypatch)
    finally:
        monkeypatch.undo()  # the counter stops recording host reads here
    complete(engine, batch)
    abort_all(engine, seqs)
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
    buffers = (runner.decode_inputs.buffer.data_ptr(), runner.decode_tables.data_ptr())
    batch, step = staged_decode(engine)
    assert step.input_ids.data_ptr() == buffers[0] and step.attention.block_tables.data_ptr() == buffers[1]
    assert step.positions.untyped_storage().data_ptr() == runner.decode_inputs.buffer.untyped_storage().data_ptr()
    complete(engine, batch)
    abort_all(engine, seqs)


def test_padded_decode_rows_are_harmless(engine):
    """The graph path's padded decode (phase 11 captures exactly these device ops): padding rows
    read the padding row's null block, write nowhere (slot -1) and leave the real rows' logits
    equal to the unpadded step's; over the full block-table width as a graph sees it."""
    runner = engine.runner
    seqs = start_decoding(engine, [list(range(2, 9)), [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    batch, step = staged_decode(engine)
    with torch.inference_mode():
        expected = runner.forward(step)
        caches = [c.clone() for c in runner.kv_caches]
        size = runner.decode_inputs.buffer.shape[1]  # max_num_seqs: two real rows, two padding rows
        step = runner.prepare(batch, decode_size=size)
        ctx = step.attention
        assert ctx.slot_mapping[len(seqs):].tolist() == [-1] * (size - len(seqs))
        assert ctx.context_lens[len(seqs):].tolist() == [1] * (size - len(seqs))
        padded = runner.forward(step)
    torch.testing.assert_close(padded[:len(seqs)], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded).all()
    real_slots = [expected_slot(s, start) for s, start in zip(batch.seqs, batch.starts)]
    for before, after in zip(caches, runner.kv_caches):
        flat_before, flat_after = before.flatten(-4, -3), after.flatten(-4, -3)  # [..., slots, H, D]
        untouched = torch.ones(flat_before.shape[-3], dtype=torch.bool)
        untouched[real_slots] = False
        assert torch.equal(flat_before[..., untouched, :, :], flat_after[..., untouched, :, :]), \
            "a padding row wrote into the cache"
        torch.testing.assert_close(flat_after[..., real_slots, :, :], flat_before[..., real_slots, :, :])
    complete(engine, batch)
    abort_all(engine, seqs)


def test_graph_batch_sizes_climb_the_ladder_and_end_at_the_limit():
    """Decode graphs are captured for 1, 2, 4, 8, every multiple of 16, and the limit itself."""
    from engine.worker.model_runner import graph_batch_sizes

    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(1) == [1]
