"""Sampler: greedy, temperature, top-k, top-p and seeds against float64 truth and statistics."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.distributed import TPGroup
from engine.model.layers.sampler import Sampler, _mul32, _uniform_noise

F64 = torch.float64


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, seeds=None, steps=None, sampler=None):
    """Call the sampler with scalar or per-row parameters."""
    batch, device = logits.shape[0], logits.device

    def column(value, dtype):
        return torch.as_tensor(value, dtype=dtype, device=device).expand(batch).contiguous()

    seeds = torch.arange(batch) if seeds is None else seeds
    steps = torch.zeros(batch, dtype=torch.int64) if steps is None else steps
    return (sampler or Sampler(TPGroup()))(
        logits, column(temperature, torch.float32), column(top_k, torch.int64), column(top_p, torch.float32),
        column(seeds, torch.int64), column(steps, torch.int64))


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Float64 truth for one row: softmax(logits / T) restricted to the top_k tokens, then to
    the smallest most-likely set with mass >= top_p, renormalised."""
    probs = torch.softmax(logits.to(F64) / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in keep)
    kept, acc = [], 0.0
    for t in keep:
        if acc >= top_p * mass:
            break
        kept.append(t)
        acc += probs[t].item()
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def top_p_between(logits: torch.Tensor, temperature: float, top_k: int, keep: int) -> float:
    """A top_p that keeps exactly ``keep`` tokens, halfway between two cumulative masses."""
    probs = torch.softmax(logits.to(F64) / temperature, dim=-1).sort(descending=True).values
    if top_k > 0:
        probs = probs[:top_k] / probs[:top_k].sum()
    cum = probs.cumsum(0)
    return float((cum[keep - 2] + cum[keep - 1]) / 2) if keep > 1 else float(cum[0] / 2)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token outside the allowed set"
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = torch.tensor((int(support.sum()) - 1) / 2, dtype=F64)
    return torch.special.gammaincc(df, stat / 2).item()


LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.7, -1.5, -3.0])[torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])]


def test_greedy_equals_exact_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=gen) * 3
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        ids = sample(x, temperature=0.0, top_k=5, top_p=0.5, seeds=torch.randint(0, 2**62, (16,), generator=gen))
        truth = x.to(F64)
        assert ids.dtype == torch.int64 and ids.shape == (16,)
        assert torch.equal(truth.gather(1, ids[:, None])[:, 0], truth.max(dim=1).values)


@pytest.mark.parametrize("temperature, top_k, keep", [
    (1.0, 0, None), (0.7, -1, None), (1.6, 4, None), (1.0, 0, 3), (0.8, 6, 2), (1.2, 3, 2)])
def test_draws_follow_the_float64_distribution(temperature, top_k, keep):
    """Many seeds, one draw each: frequencies match the restricted, renormalised softmax."""
    top_p = 1.0 if keep is None else top_p_between(LOGITS8, temperature, top_k, keep)
    n = 40000
    ids = sample(LOGITS8.expand(n, -1), temperature, top_k, top_p, seeds=torch.arange(n) * 7919 + 11)
    probs = reference_probs(LOGITS8, temperature, top_k, top_p)
    assert chi_square_p_value(torch.bincount(ids, minlength=8).to(F64), probs) > 1e-5


def test_steps_of_one_seed_are_independent_draws():
    """One seed over many steps: each draw follows the distribution and consecutive draws
    are independent (joint frequencies match the product distribution)."""
    logits = torch.tensor([0.9, 0.0, -0.4, 0.5])
    n = 40000
    ids = sample(logits.expand(n, -1), seeds=torch.full((n,), 2**40 + 3), steps=torch.arange(n))
    probs = reference_probs(logits, 1.0, 0, 1.0)
    assert chi_square_p_value(torch.bincount(ids, minlength=4).to(F64), probs) > 1e-5
    pairs = torch.bincount(ids[:-1] * 4 + ids[1:], minlength=16).to(F64)
    assert chi_square_p_value(pairs, torch.outer(probs, probs).flatten()) > 1e-5


def test_top_k_and_top_p_never_leave_the_allowed_set():
    gen = torch.Generator().manual_seed(1)
    rows, vocab, draws = 256, 64, 16
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(F64)  # float32 values: same order in both
    top_k = torch.randint(1, 12, (rows,), generator=gen)
    top_k[::4] = 0  # top-k off
    temperature = (0.5 + torch.rand(rows, generator=gen)).to(F64)
    keep = [int(torch.randint(1, min(int(k) if k > 0 else vocab, 8) + 1, (1,), generator=gen)) for k in top_k]
    top_p = torch.tensor([top_p_between(logits[r], float(temperature[r]), int(top_k[r]), keep[r])
                          for r in range(rows)])
    top_p[1::4] = 1.0  # top-p off
    allowed = [set(reference_probs(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]))
                   .nonzero().flatten().tolist()) for r in range(rows)]
    seen = [set() for _ in range(rows)]
    for step in range(draws):
        ids = sample(logits.float(), temperature.float(), top_k, top_p.float(),
                     seeds=torch.arange(rows) + 100, steps=torch.full((rows,), step))
        for r, token in enumerate(ids.tolist()):
            assert token in allowed[r], f"row {r}: token {token} outside {sorted(allowed[r])}"
            seen[r].add(token)
    assert sum(len(s) for s in seen) > 2 * rows, "sampling collapsed to a few tokens"


def test_mul32_is_the_exact_product_modulo_2_32():
    """The noise hash's multiply keeps exactly the low 32 bits of x * c (Python's integers as truth)
    at the extremes of its range, where the int64 product passes 2**63."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64),
                   torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64)])
    for c in (0x85EBCA6B, 0xC2B2AE35, 2**32 - 1, 1):
        assert _mul32(x, c).tolist() == [(int(v) * c) % 2**32 for v in x.tolist()]


def test_noise_stays_below_one_and_masked_tokens_are_never_drawn():
    """(seed 4, output index 0, token 3773515) hashes to the largest 24-bit value, whose float32
    rounds up to 1.0: the noise must stay in (0, 1), or log(-log u) = -inf makes the race of a
    masked (-inf) token NaN, which argmax picks."""
    noise = _uniform_noise(torch.tensor([4]), torch.tensor([0]), torch.tensor([3773515, 0]))
    assert 0 < noise.min() and noise.max() < 1
    logits = torch.full((1, 3773516), float("-inf"))
    logits[0, 7] = 0.0
    assert sample(logits, 1.0, seeds=torch.tensor([4])).tolist() == [7]


def min_p_allowed(logits: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    """Float64 truth for one row: the tokens whose probability under softmax(logits / T) is at
    least ``min_p`` times the most likely token's."""
    probs = torch.softmax(logits.to(F64) / temperature, dim=-1)
    return set((probs >= min_p * probs.max()).nonzero().flatten().tolist())


def test_min_p_never_leaves_the_float64_allowed_set():
    """Over many seeds every drawn id keeps probability >= min_p x the row's largest (float64),
    greedy rows still take the argmax, and the hinted path draws the same ids."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab, draws = 128, 64, 16
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(F64)
    temperature = (0.5 + torch.rand(rows, generator=gen)).to(F64)
    min_p = torch.rand(rows, generator=gen).to(F64) * 0.5
    min_p[::5] = 0.0  # min-p off
    allowed = [min_p_allowed(logits[r], float(temperature[r]), float(min_p[r])) for r in range(rows)]
    seen = [set() for _ in range(rows)]
    sampler = Sampler(TPGroup())
    for step in range(draws):
        args = (logits.float(), temperature.float(), torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
                torch.arange(rows) + 7, torch.full((rows,), step), min_p.float())
        ids = sampler(*args)
        assert torch.equal(ids, sampler(*args, random_rows=torch.arange(rows), use_top_k=False, use_top_p=False))
        for r, token in enumerate(ids.tolist()):
            assert token in allowed[r], f"row {r}: token {token} outside {sorted(allowed[r])}"
            seen[r].add(token)
    assert sum(len(s) for s in seen) > 2 * rows, "sampling collapsed to a few tokens"
    greedy = sampler(logits.float(), torch.zeros(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
                     torch.arange(rows), torch.zeros(rows, dtype=torch.int64), min_p.float())
    assert torch.equal(greedy, logits.argmax(dim=-1))


def test_min_p_leaving_one_survivor_always_draws_it():
    """A min_p above the runner-up's probability ratio (float64) leaves only the argmax: every
    draw, at every seed, is that token, even at a high temperature."""
    gen = torch.Generator().manual_seed(6)
    rows, vocab = 64, 100
    logits = torch.randn(rows, vocab, generator=gen).to(F64)
    temperature = 2.0
    probs = torch.softmax(logits / temperature, dim=-1).sort(dim=-1, descending=True).values
    min_p = ((probs[:, 1] / probs[:, 0] + 1) / 2).float()  # between the runner-up's ratio and 1
    for step in range(20):
        ids = Sampler(TPGroup())(
            logits.float(), torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
            torch.arange(rows) * 31 + step, torch.full((rows,), step), min_p)
        assert torch.equal(ids, logits.argmax(dim=-1))


def test_temperature_towards_zero_matches_greedy():
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 64, 200
    logits = torch.stack([torch.randperm(vocab, generator=gen) * 0.05 for _ in range(rows)]).float()
    greedy = sample(logits, temperature=0.0)
    assert torch.equal(greedy, logits.argmax(dim=1))
    for temperature in (1e-3, 1e-4, 1e-38):  # 1e-38 would overflow logits / t without a floor
        assert torch.equal(sample(logits, temperature=temperature, seeds=torch.arange(rows) + 5), greedy)


def test_seeded_tokens_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(3)
    steps, vocab, seed = 40, 100, 2**62 + 12345
    mine = torch.randn(steps, vocab, generator=gen) * 2
    params = dict(temperature=0.9, top_k=50, top_p=0.95)

    def my_tokens(seed_value, batch_sizes):
        tokens = []
        for step in range(steps):
            batch = batch_sizes[step]
            pos = int(torch.randint(0, batch, (1,), generator=gen))
            logits = torch.randn(batch, vocab, generator=gen) * 2
            logits[pos] = mine[step]
            columns = dict(temperature=torch.rand(batch, generator=gen),
                           top_k=torch.randint(0, 30, (batch,), generator=gen),
                           top_p=torch.rand(batch, generator=gen) * 0.9 + 0.1,
                           seeds=torch.randint(0, 2**62, (batch,), generator=gen))
            for name, value in zip(("temperature", "top_k", "top_p", "seeds"), (*params.values(), seed_value)):
                columns[name][pos] = value
            steps_column = torch.randint(0, 1000, (batch,), generator=gen)
            steps_column[pos] = step
            tokens.append(int(sample(logits, **columns, steps=steps_column)[pos]))
        return tokens

    alone = my_tokens(seed, [1] * steps)
    assert my_tokens(seed, torch.randint(2, 9, (steps,), generator=gen).tolist()) == alone
    assert my_tokens(seed + 1, [1] * steps) != alone


@pytest.mark.parametrize("case", ["mixed", "all_top_k", "no_top_p", "top_k_mixed_no_top_p", "temperature_only",
                                  "all_greedy"])
def test_runner_hints_give_the_same_tokens(case):
    """The runner's host-side hints (sampled rows only, topk candidates instead of a full
    sort, no top-p pass when nobody asks) pick exactly the tokens of the unhinted path."""
    gen = torch.Generator().manual_seed(11)
    batch, vocab = 24, 300
    logits = torch.randn(batch, vocab, generator=gen) * 3
    temperatures = torch.rand(batch, generator=gen) + 0.2
    temperatures[::3] = 0.0
    top_ks = torch.randint(1, 40, (batch,), generator=gen)
    top_ps = torch.rand(batch, generator=gen) * 0.8 + 0.2
    if case == "mixed":
        top_ks[1::4] = 0
        top_ps[2::5] = 1.0
    if case in ("no_top_p", "temperature_only", "top_k_mixed_no_top_p"):
        top_ps[:] = 1.0
    if case == "top_k_mixed_no_top_p":  # some rows filter by top_k, others not, nobody by top_p
        top_ks[1::3] = 0
    if case == "temperature_only":
        top_ks[:] = -1
    if case == "all_greedy":
        temperatures[:] = 0.0
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    steps = torch.randint(0, 100, (batch,), generator=gen)
    args = (logits, temperatures, top_ks, top_ps, seeds, steps)
    plain = Sampler(TPGroup())(*args)
    rows = (temperatures > 0).nonzero()[:, 0]
    ks = top_ks[rows].tolist()
    hinted = Sampler(TPGroup())(*args, random_rows=rows,
                                max_top_k=max(ks) if ks and min(ks) > 0 else None,
                                use_top_k=bool(ks) and max(ks) > 0, use_top_p=bool((top_ps[rows] < 1).any()))
    assert torch.equal(plain, hinted)


def test_sampler_has_no_host_sync():
    """Under FakeTensorMode any read of a tensor value on the host (.item(), .tolist(),
    a Python branch on a tensor) raises; the sampler must run through it."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def sampler_call():
        return sample(torch.randn(4, 32), temperature=torch.tensor([0.0, 1.0, 0.5, 2.0]),
                      top_k=torch.tensor([0, 3, -1, 10]), top_p=torch.tensor([1.0, 0.9, 0.5, 1.0]))

    with FakeTensorMode():
        ids = sampler_call()
        assert ids.shape == (4,) and ids.dtype == torch.int64
        with pytest.raises(DataDependentOutputException):  # the harness does catch a sync
            torch.randn(3).sum().item()


def test_bad_shapes_raise():
    sampler = Sampler(TPGroup())
    ones = torch.ones(3)
    ints = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.randn(3), ones, ints, ones, ints, ints)
    with pytest.raises(ValueError, match="top_ps"):
        sampler(torch.randn(3, 5), ones, ints, torch.ones(2), ints, ints)


@pytest.mark.cuda
def test_cuda_bf16_sampling_without_sync_and_under_graph_capture():
    """bf16 logits on the GPU: greedy rows take a maximal logit, top-k rows stay in the top-k
    set, nothing syncs with the host, and a captured CUDA graph replays on new logits."""
    device = torch.device("cuda")
    rows, vocab, k = 64, 32000, 20
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, device=device, generator=gen) * 3).bfloat16()
    temperatures = torch.where(torch.arange(rows, device=device) % 2 == 0, 0.0, 0.8).float()
    top_ks = torch.full((rows,), k, device=device)
    top_ps = torch.full((rows,), 0.9, device=device)
    seeds = torch.arange(rows, device=device)
    steps = torch.zeros(rows, dtype=torch.int64, device=device)
    sampler = Sampler(TPGroup())

    def check(x, ids):
        truth = x.to(F64)
        chosen = truth.gather(1, ids[:, None])[:, 0]
        greedy = temperatures == 0
        assert torch.equal(chosen[greedy], truth.max(dim=1).values[greedy])
        kth = truth.topk(k, dim=1).values[:, -1]
        assert bool((chosen[~greedy] >= kth[~greedy]).all())

    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = sampler(logits, temperatures, top_ks, top_ps, seeds, steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(logits, ids)

    static_logits = logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sampler(static_logits, temperatures, top_ks, top_ps, seeds, steps)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_ids = sampler(static_logits, temperatures, top_ks, top_ps, seeds, steps)
    new_logits = (torch.randn(rows, vocab, device=device, generator=gen) * 3).bfloat16()
    static_logits.copy_(new_logits)
    static_ids.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    check(new_logits, static_ids)
