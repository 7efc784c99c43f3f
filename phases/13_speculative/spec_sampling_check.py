"""The check that speculative sampling is lossless (``test_spec_sampling.py`` at top-p 1,
``test_spec_sampling_top_p.py`` at 0.9: two files, so that they run side by side): on the
shipped demo model (trained, so it repeats a line it has seen repeated and the drafts copying it
are often accepted) a thousand seeded requests of one prompt, sampled at temperature 1, draw
their first three tokens from plain sampling's distributions: the first (the prefill's), and the
second and third (a verify step's two rows, max_tokens leaving room for one draft: the token
after the last one, and the token after the accepted draft; after a rejected draft the third
comes from the next step). The truth is transformers' model on the same checkpoint: the softmax
(top-p applied, as the sampler defines it) of its logits, the third token's marginalised over
the second."""
import torch

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams

NUM_DRAWS = 1000
TEMPERATURE = 1.0
MASS_LEFT_OUT = 1e-6  # the third token's truth leaves out second tokens this unlikely together
PROMPT = "    total += 1\n" * 3 + "    total +="  # a line the model repeats: the drafts copy it


def restricted_softmax(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """float64 probabilities [..., V]: softmax(logits / T), then the smallest set of tokens, most
    likely first, whose mass reaches top_p (a token is kept while the mass before it is below
    top_p), renormalised."""
    probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def chi_square_p_value(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of the drawn ``tokens`` against ``expected`` counts per token id: the cells
    expecting at least 5 draws, the rest pooled into one cell."""
    observed = torch.bincount(tokens, minlength=expected.numel()).double()
    big = expected >= 5
    cells_o = torch.cat([observed[big], observed[~big].sum()[None]])
    cells_e = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = cells_e > 0
    assert cells_o[~keep].sum() == 0, "drew a token plain sampling never draws"
    stat = ((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum()
    return torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64), stat / 2).item()


def load_model():
    """transformers' model of the shipped checkpoint, float32, eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()


@torch.no_grad()
def next_token_logits(model, prefix: list[int], continuations: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """transformers' last logits [C, V] of ``prefix + [c]`` for each token c of ``continuations``:
    per chunk, the prefix's cache repeated for each continuation, then that one token."""
    rows = []
    for part in continuations.split(chunk):
        cache = model(torch.tensor([prefix]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(part))
        rows.append(model(part[:, None], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(rows)


NGRAM = dict(speculative="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)


def check_first_three_tokens(model, top_p: float, speculative: dict = NGRAM) -> None:
    """The check of the module docstring at ``top_p``, against ``model`` (transformers', float32),
    drafting by the ``speculative`` options of LLMEngine (two drafts)."""
    engine = LLMEngine(**speculative, max_num_seqs=500, max_model_len=256)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = [SamplingParams(temperature=TEMPERATURE, top_p=top_p, max_tokens=3, seed=seed, ignore_eos=True)
              for seed in range(NUM_DRAWS)]
    ids = [engine.add_request(prompt, p, detokenize=False) for p in params]
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.pop_request(rid) for rid in ids]
    drawn = torch.tensor([o.token_ids for o in outs])
    accepted = sum(o.num_accepted_tokens for o in outs)
    drafted = sum(o.num_draft_tokens for o in outs)
    assert NUM_DRAWS / 4 < accepted < drafted, (accepted, drafted)  # drafts often accepted, sometimes not

    vocab = model.config.vocab_size
    with torch.no_grad():
        first = restricted_softmax(model(torch.tensor([prompt])).logits[0, -1], top_p)
    assert chi_square_p_value(drawn[:, 0], first * NUM_DRAWS) > 1e-4

    # the second token, given each draw's first: expected counts summed over the draws
    firsts, counts = drawn[:, 0].unique(return_counts=True)
    second = restricted_softmax(next_token_logits(model, prompt, firsts), top_p)  # [firsts, V]
    per_draw = second[torch.searchsorted(firsts, drawn[:, 0].contiguous())]
    assert chi_square_p_value(drawn[:, 1], per_draw.sum(0)) > 1e-4

    # the third token, for the draws whose first token was the most common one: the second token's
    # distribution times the third's given it, over the second tokens plain sampling draws but for
    # the least likely ones, whose mass together is under MASS_LEFT_OUT (at top-p 1 that is most of
    # the vocabulary; one transformers forward each would be most of this check's time)
    mode = firsts[counts.argmax()]
    chosen = drawn[:, 0] == mode
    p2 = second[counts.argmax()]
    sorted_p2, order = p2.sort(descending=True)
    seconds = order[(sorted_p2.cumsum(0) - sorted_p2 < 1 - MASS_LEFT_OUT) & (sorted_p2 > 0)].sort().values
    third = restricted_softmax(next_token_logits(model, prompt + [int(mode)], seconds), top_p)  # [seconds, V]
    marginal = p2[seconds] @ third
    assert marginal.shape == (vocab,) and abs(float(marginal.sum()) - 1) < 2 * MASS_LEFT_OUT
    assert chi_square_p_value(drawn[chosen, 2], marginal * int(chosen.sum())) > 1e-4
