"""Train the default model that ships with agent-infer: a tiny Qwen3 trained on
the CPython standard library's own .py sources.

    python scripts/train_demo_model.py --out engine/default_model     # ~6 min on one H200
    python scripts/train_demo_model.py --smoke --out /tmp/demo_smoke  # CPU, under 2 min

Corpus: every .py file under the running interpreter's stdlib that decodes as
UTF-8 (site-packages and dist-packages left out), in sorted relative-path
order. blake2b of a file's relative path fixes its split: 2% test (every
reported held-out number is on it), 2% validation (picks the checkpoint), the
rest train.
Tokenizer: byte-level BPE with 8192 ids, trained on the train split;
`<|endoftext|>` follows every document and is the EOS, pad and BOS id.
Model: Qwen3ForCausalLM, hidden 256, 6 layers, 4 query / 2 KV heads of 64,
MLP 768, tied embeddings: 6.8M parameters, 13.6 MB in bf16.
Training: the train split as one token stream cut into 512-token windows (a
fresh random offset and window order every epoch), AdamW, linear warmup then
cosine decay to 10% of the peak over the budget: `--steps` or `--minutes`,
whichever runs out first (the schedule follows whichever is further along, so
a wall-clock run still anneals). bf16 autocast on CUDA. Validation loss
`--evals` times over the budget; the best checkpoint is the one saved.
Report: progress lines, the train-loss curve, test cross-entropy (nats/token)
of the saved model and of a Witten-Bell bigram model on the same test tokens,
greedy samples from the saved directory reloaded through transformers, and a
last line of JSON.
Output (`--out`): config.json, generation_config.json, model.safetensors (bf16),
tokenizer.json, tokenizer_config.json, and nothing else.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM, set_seed
from transformers.utils.logging import disable_progress_bar

EOT = "<|endoftext|>"
VOCAB = 8192
MAX_POSITIONS = 1024
OUTPUT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"]
MAX_MODEL_BYTES = 15_000_000
ROUND_TRIP = "héllo → 世界\n\tdef f(x):  # ünïcode ✓\n        return x\n"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self"]
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOT,
    "pad_token": EOT,
    "model_max_length": MAX_POSITIONS,
    "clean_up_tokenization_spaces": False,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("engine/default_model"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=20_000, help="step budget")
    p.add_argument("--batch", type=int, default=128, help="windows per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=200, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--evals", type=int, default=20, help="validation passes over the budget")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--smoke", action="store_true",
                   help="150 train files, 30 steps of 4 windows: proves the pipeline on a CPU")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch, args.warmup, args.evals, args.log_every = 30, 4, 5, 3, 5
    return args


def split_of(rel_path: str) -> str:
    """'test', 'val' or 'train' (2% / 2% / 96% of files), fixed by blake2b of the path."""
    digest = hashlib.blake2b(rel_path.encode(), digest_size=8).digest()
    bucket = int.from_bytes(digest, "big") % 100
    return "test" if bucket < 2 else "val" if bucket < 4 else "train"


def stdlib_sources() -> dict[str, list[str]]:
    """The stdlib's UTF-8 .py sources by split, each split in sorted relative-path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    splits = {"train": [], "val": [], "test": []}
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    for rel in paths:
        if {"site-packages", "dist-packages"} & set(rel.split("/")):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        splits[split_of(rel)].append(text)
    return splits


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE with VOCAB ids; EOT is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def check_round_trip(encode, decode) -> None:
    """Raise unless decode(encode(ROUND_TRIP)) gives ROUND_TRIP back."""
    back = decode(encode(ROUND_TRIP))
    if back != ROUND_TRIP:
        raise RuntimeError(f"tokenizer does not round-trip: {ROUND_TRIP!r} -> {back!r}")


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one int64 stream, each followed by EOT."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, seq_len + 1) windows overlapping by one token: every token but the
    first is a target exactly once (the tail that fills no window is dropped)."""
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one window of {seq_len + 1}")
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def train_batches(stream: torch.Tensor, batch: int, seq_len: int, seed: int):
    """Endless (batch, seq_len + 1) windows of `stream`, on its device. Each epoch
    starts at a random offset and visits its windows in a random order; its
    last partial batch is dropped."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        offset = int(torch.randint(seq_len, (1,), generator=gen))
        windows = stream[offset:].unfold(0, seq_len + 1, seq_len)
        if len(windows) < batch:
            raise ValueError(f"the train split has {len(windows)} windows, fewer than a batch of {batch}")
        order = torch.randperm(len(windows), generator=gen).to(stream.device)
        for i in range(0, len(order) - batch + 1, batch):
            yield windows[order[i:i + batch]]


def build_model(eot: int) -> Qwen3ForCausalLM:
    """The demo Qwen3, randomly initialised, with every special id set to EOT."""
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=MAX_POSITIONS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
    )
    model = Qwen3ForCausalLM(config)
    # sampling by default: greedy decoding of a model this small falls into repetition loops
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                                               do_sample=True, temperature=0.6, top_p=0.9)
    return model


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lm_loss(model, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy (nats, fp32) of `model` over (B, L + 1) windows."""
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, device: torch.device, batch: int = 64) -> float:
    """Mean next-token cross-entropy (nats/token) over all windows; keeps the model's mode."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for chunk in windows.split(batch):
        with autocast(device):
            total += lm_loss(model, chunk.to(device), reduction="sum")
    model.train(was_training)
    return total.item() / windows[:, 1:].numel()


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over args.warmup steps, cosine from args.lr to 10% of it as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * (0.1 + 0.9 * cosine)


def make_optimizer(model, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (embedding included), not on norm weights."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train(model, stream: torch.Tensor, val: torch.Tensor, args: argparse.Namespace,
          device: torch.device) -> dict:
    """Train in place until the step or time budget is spent; the model ends
    holding the weights of its best validation pass. Returns the per-step
    losses, the validation passes [(step, loss)], steps, tokens and seconds."""
    opt = make_optimizer(model, args, device)
    forward = torch.compile(model) if args.compile else model
    batches = train_batches(stream.to(device), args.batch, args.seq_len, args.seed)
    losses, vals, best = [], [], (math.inf, None)
    step, progress, logged_step = 0, 0.0, 0
    start = last_log = time.perf_counter()
    model.train()
    while progress < 1.0:
        lr = learning_rate(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast(device):
            loss = lm_loss(forward, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        step += 1
        progress = max(step / args.steps, (time.perf_counter() - start) / (60 * args.minutes))
        if step % args.log_every == 0 or progress >= 1.0:
            recent = torch.stack(losses[-args.log_every:]).mean().item()
            now = time.perf_counter()
            tokens = (step - logged_step) * args.batch * args.seq_len
            print(f"step {step:6d}  loss {recent:.4f}  lr {lr:.2e}  "
                  f"tok/s {tokens / (now - last_log):,.0f}  elapsed {now - start:6.1f}s", flush=True)
            last_log, logged_step = now, step
        if int(progress * args.evals) > len(vals):
            vals.append((step, mean_loss(model, val, device)))
            print(f"step {step:6d}  validation loss {vals[-1][1]:.4f}", flush=True)
            if vals[-1][1] < best[0]:
                best = (vals[-1][1], {k: v.detach().clone() for k, v in model.state_dict().items()})
    seconds = time.perf_counter() - start
    model.load_state_dict(best[1])
    return {"losses": torch.stack(losses).tolist(), "vals": vals, "steps": step,
            "tokens": step * args.batch * args.seq_len, "seconds": seconds}


def loss_curve(losses: list[float]) -> dict[str, float]:
    """Train loss at 10/25/50/100% of the steps, each the mean over the 1% of steps up to that point."""
    n, width = len(losses), max(1, len(losses) // 100)
    curve = {}
    for frac in (0.10, 0.25, 0.50, 1.00):
        end = max(1, round(frac * n))
        window = losses[max(0, end - width):end]
        curve[f"{frac:.0%}"] = round(sum(window) / len(window), 4)
    return curve


def bigram_loss(train_stream: torch.Tensor, windows: torch.Tensor) -> float:
    """Mean cross-entropy (nats/token) on the (previous, next) pairs of `windows`
    of a bigram model counted on the train stream, Witten-Bell smoothed:
    p(b|a) = (c(a,b) + T(a) u(b)) / (c(a) + T(a)), with T(a) the number of
    distinct successors of a and u the add-one unigram; u(b) for an unseen a."""
    keys, pair_counts = torch.unique(train_stream[:-1] * VOCAB + train_stream[1:], return_counts=True)
    context = torch.bincount(keys // VOCAB, weights=pair_counts.double(), minlength=VOCAB)
    successors = torch.bincount(keys // VOCAB, minlength=VOCAB).double()
    unigram = (torch.bincount(train_stream, minlength=VOCAB).double() + 1) / (len(train_stream) + VOCAB)
    a, b = windows[:, :-1].flatten(), windows[:, 1:].flatten()
    query = a * VOCAB + b
    at = torch.searchsorted(keys, query).clamp(max=len(keys) - 1)
    pair = torch.where(keys[at] == query, pair_counts[at], 0).double()
    denominator = context[a] + successors[a]
    p = torch.where(denominator > 0, (pair + successors[a] * unigram[b]) / denominator.clamp(min=1), unigram[b])
    return -p.log().mean().item()


def save(model, tok: Tokenizer, out: Path) -> int:
    """Write the HF directory (bf16 weights); return model.safetensors' size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    present = sorted(p.name for p in out.iterdir())
    if present != OUTPUT_FILES:
        raise RuntimeError(f"{out} holds {present}, expected exactly {OUTPUT_FILES}")
    size = (out / "model.safetensors").stat().st_size
    if size >= MAX_MODEL_BYTES:
        raise RuntimeError(f"model.safetensors is {size:,} bytes, over the {MAX_MODEL_BYTES:,} limit")
    return size


def reload(out: Path, device: torch.device):
    """The saved directory loaded back through transformers' Auto classes (bf16, eval mode)."""
    tok = AutoTokenizer.from_pretrained(out)
    check_round_trip(lambda s: tok(s).input_ids, tok.decode)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(device).eval()
    return tok, model


def greedy_samples(tok, model, device: torch.device) -> dict[str, str]:
    """64 greedy new tokens after each prompt in PROMPTS."""
    samples = {}
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt").to(device)
        ids = model.generate(**enc, max_new_tokens=64, do_sample=False)
        samples[prompt] = tok.decode(ids[0, enc.input_ids.shape[1]:])
    return samples


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    disable_progress_bar()
    set_seed(args.seed)
    t0 = time.perf_counter()

    sources = stdlib_sources()
    if args.smoke:
        sources = {"train": sources["train"][:150], "val": sources["val"][:1], "test": sources["test"][:2]}
    tok = train_tokenizer(sources["train"])
    check_round_trip(lambda s: tok.encode(s).ids, tok.decode)
    streams = {name: token_stream(tok, texts) for name, texts in sources.items()}
    for name, texts in sources.items():
        n_bytes = sum(len(t.encode()) for t in texts)
        print(f"{name:5s}: {len(texts):5d} files  {n_bytes:11,d} bytes  {len(streams[name]):10,d} tokens  "
              f"({n_bytes / len(streams[name]):.2f} bytes/token)")
    print(f"data ready in {time.perf_counter() - t0:.1f}s", flush=True)

    eot = tok.token_to_id(EOT)
    model = build_model(eot).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    result = train(model, streams["train"], eval_windows(streams["val"], args.seq_len), args, device)

    size = save(model, tok, args.out)
    tok_hf, saved = reload(args.out, device)
    test = eval_windows(streams["test"], args.seq_len)
    summary = {
        "test_loss": round(mean_loss(saved, test, device), 4),
        "bigram_test_loss": round(bigram_loss(streams["train"], test), 4),
        "best_val_loss": round(min(v for _, v in result["vals"]), 4),
        "best_val_step": min(result["vals"], key=lambda sv: sv[1])[0],
        "params": n_params,
        "model_bytes": size,
        "steps": result["steps"],
        "tokens_seen": result["tokens"],
        "train_tokens": len(streams["train"]),
        "test_tokens": test[:, 1:].numel(),
        "train_seconds": round(result["seconds"], 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    print("train loss curve:", loss_curve(result["losses"]))
    print("validation:", ", ".join(f"{s}: {v:.4f}" for s, v in result["vals"]))
    print(f"test loss {summary['test_loss']:.4f} nats/token (bigram {summary['bigram_test_loss']:.4f})")
    for prompt, completion in greedy_samples(tok_hf, saved, device).items():
        print(f"--- {prompt!r}\n{prompt}{completion}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
