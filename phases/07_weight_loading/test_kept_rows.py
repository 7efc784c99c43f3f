"""The last layer's MLP and the final norm on the logits rows alone (``keep_rows``: what the runner
passes for an eager step with prefill chunks) against HF transformers' logits at those rows, for a
dense, an MoE and an MLA + MoE model, through a ragged prefill and decode steps over the paged
cache: every row still reaches attention and the cache (later steps read it), and the kept rows
come out in the order asked for."""
import pytest
import torch
import transformers

from engine.worker.kv_cache import bind_kv_cache
from phases.harness import load_engine_model, num_blocks_for, rel_err, run_paged

PROMPT_LENS = [6, 17, 1, 33]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM"])
def test_last_layer_on_kept_rows_matches_hf_at_those_rows(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, seed=31)
    model = load_engine_model(model_dir)
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, model.config.vocab_size, (n + 6,), generator=gen) for n in PROMPT_LENS]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), 16), 16, torch.float32, "cpu")

    calls = []

    def every_other_row_reversed(ids, positions):  # the other half of the rows at the next step
        calls.append(len(ids))
        rows = torch.arange(len(ids) - 1 - (len(calls) % 2 if len(ids) > 1 else 0), -1, -2)  # never none
        logits = model.compute_logits(model(ids, positions, rows))
        assert logits.shape[0] == len(rows)
        out = torch.full((len(ids), logits.shape[1]), float("nan"))
        out[rows] = logits
        return out

    with torch.no_grad():
        got = run_paged(every_other_row_reversed, sequences, PROMPT_LENS, 16)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [hf(ids[None]).logits[0] for ids in sequences]
    for i, (g, w) in enumerate(zip(got, want)):
        kept = ~g[:, 0].isnan()
        assert kept.any(), f"sequence {i}: no row kept"
        assert rel_err(g[kept], w[kept]) < 1e-4, f"sequence {i} of {arch}: kept rows differ from transformers"
