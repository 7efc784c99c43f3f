"""Train the default model that ships with agent-infer: a tiny Qwen3 trained on
the CPython standard library's own .py sources, then fine-tuned to chat and call tools.

    python scripts/train_demo_model.py --out engine/default_model     # ~6 min on one H200
    python scripts/train_demo_model.py --chat --out engine/default_model   # then: ~7 min on 2 CPU cores
    python scripts/train_demo_model.py --smoke --out /tmp/demo_smoke  # CPU, under 2 min
    python scripts/train_demo_model.py --chat --smoke --out /tmp/demo_chat_smoke   # CPU, under a minute

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

The chat stage (`--chat`) starts from `--init`'s weights and tokenizer (unchanged: 8192 ids, the
chat markers are ordinary text) and fine-tunes on scripts/demo_chat.py's synthetic conversations
(`--conversations` drawn from demo_chat.TRAIN_SEED + --seed; plain chat, system prompts,
multi-turn, and tool use: tools in the system turn, a request, a hermes `<tool_call>`, the tool's
result, a short answer; thinking on or off) beside stdlib code windows, so that it answers in
demo_chat.CHAT_TEMPLATE's format, ends its turn with `<|endoftext|>` (the EOS) and stays a code
model. Each assistant turn is one sequence: its prompt rendered by the template and tokenized as a
prompt is, then the turn's text and EOS (a later turn whose prompt continues it exactly joins it);
the sequences are packed into `--seq-len` + 1 rows. A step is `--batch` chat rows (loss on the
assistant tokens only, logits computed there only) and `--code-batch` code windows, one forward,
the loss the sum of the two means; bf16 autocast (on the CPU too); the schedule above over
`--steps` (the step budget ends it: `--minutes` is only a cap, so the same seed gives the same
weights on the same machine and thread count). Report: held-out code cross-entropy (the base
stage's test windows) and held-out chat cross-entropy (assistant tokens of demo_chat's held-out
split) before and after, the loss curves, greedy chat samples reloaded through transformers, a last
line of JSON. The output directory is the base stage's, with `chat_template` in
tokenizer_config.json. scripts/eval_demo_chat.py measures the result through the engine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM, set_seed
from transformers.utils.logging import disable_progress_bar

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_chat, beside this script

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


BASE_DEFAULTS = {"minutes": 5.0, "steps": 20_000, "batch": 128, "seq_len": 512, "lr": 2e-3, "warmup": 200,
                 "log_every": 100}
# --chat: a step-bound run (the same weights from the same seed on the same CPU), about 7 minutes on 2 cores
CHAT_DEFAULTS = {"minutes": 30.0, "steps": 600, "batch": 6, "seq_len": 512, "lr": 1e-3, "warmup": 20,
                 "log_every": 10}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("engine/default_model"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, help="wall-clock training budget (5; --chat: 30, a cap only)")
    p.add_argument("--steps", type=int, help="step budget (20000; --chat: 600)")
    p.add_argument("--batch", type=int, help="windows per step (128; --chat: 6 chat windows)")
    p.add_argument("--seq-len", type=int, help="window length (512)")
    p.add_argument("--lr", type=float, help="peak learning rate (2e-3; --chat: 1e-3)")
    p.add_argument("--warmup", type=int, help="linear warmup steps (200; --chat: 20)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--evals", type=int, default=20, help="validation passes over the budget")
    p.add_argument("--log-every", type=int, help="steps between progress lines (100; --chat: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--smoke", action="store_true",
                   help="150 train files, 30 steps of 4 windows: proves the pipeline on a CPU")
    chat = p.add_argument_group("--chat: fine-tune a trained demo model to chat and call tools (scripts/demo_chat.py)")
    chat.add_argument("--chat", action="store_true", help="the chat stage instead of training from scratch")
    chat.add_argument("--init", type=Path, default=Path("engine/default_model"),
                      help="the trained model (and tokenizer) to start from")
    chat.add_argument("--conversations", type=int, default=6000,
                      help="synthetic training conversations (drawn from demo_chat.TRAIN_SEED + --seed)")
    chat.add_argument("--code-batch", type=int, default=2, help="stdlib code windows per step beside the chat ones")
    chat.add_argument("--tool-share", type=float, default=0.5, help="the share of conversations that offer tools")
    chat.add_argument("--direct-share", type=float, default=0.15,
                      help="the share of those whose question no tool is for (answered directly)")
    args = p.parse_args(argv)
    for key, value in (CHAT_DEFAULTS if args.chat else BASE_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.steps, args.batch, args.warmup, args.evals, args.log_every = 30, 4, 5, 3, 5
        if args.chat:
            args.steps, args.batch, args.conversations = 6, 2, 60
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


def autocast(device: torch.device, cpu: bool = False):
    """bf16 autocast on CUDA (and on the CPU when ``cpu``: the chat stage trains that way, twice as fast)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" or cpu)


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


def save(model, tok: Tokenizer, out: Path, tokenizer_config: dict = TOKENIZER_CONFIG) -> int:
    """Write the HF directory (bf16 weights); return model.safetensors' size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
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


# ---------------------------------------------------------------- the chat stage (--chat)

def chat_sequences(render, encode, conv, merge: bool = True) -> list[list[tuple[str, bool]]]:
    """``conv``'s training sequences, each a list of (text, is_target) pieces: an assistant turn's
    prompt as the chat template renders it, then the text the model is to write (its EOS follows),
    each piece tokenized on its own as a prompt and the tokens generated after it are. With
    ``merge``, a later turn whose prompt continues the sequence so far exactly (the earlier turn
    rendered in the history as the model wrote it, with the same tokens) joins it; any other starts
    a sequence of its own."""
    sequences, pieces, covered = [], [], ""
    for index in sorted(conv.targets):
        prompt, target = render(conv, index), conv.targets[index]
        if merge and pieces and prompt.startswith(covered):
            pieces.append((prompt[len(covered):], False))
        else:
            if pieces:
                sequences.append(pieces)
            pieces = [(prompt, False)]
        pieces.append((target, True))
        covered = prompt + target + EOT
        if encode(prompt + target) != encode(prompt) + encode(target):  # a history would tokenize it otherwise
            sequences.append(pieces)
            pieces, covered = [], ""
    if pieces:
        sequences.append(pieces)
    return sequences


def encode_chats(tok: Tokenizer, render, convs: list, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Token ids and target mask (1: an assistant token or its EOS) of each training sequence of
    ``convs`` that fits ``max_len`` tokens (a conversation whose merged turns do not fit is cut
    into one sequence per turn)."""
    eot = tok.token_to_id(EOT)

    def encode(text: str) -> list[int]:
        return tok.encode(text).ids

    def encoded(pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        ids, mask = [], []
        for text, target in pieces:
            piece = encode(text) + ([eot] if target else [])
            ids += piece
            mask += [int(target)] * len(piece)
        return ids, mask

    out = []
    for conv in convs:
        sequences = [encoded(p) for p in chat_sequences(render, encode, conv)]
        if any(len(ids) > max_len for ids, _ in sequences):
            sequences = [encoded(p) for p in chat_sequences(render, encode, conv, merge=False)]
        out += [(ids, mask) for ids, mask in sequences if len(ids) <= max_len]
    return out


def pack(examples: list[tuple[list[int], list[int]]], width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples packed in order into (N, width) rows, none split across rows; the rest of a
    row is ``pad`` with mask 0."""
    rows, row = [], ([], [])
    for ids, mask in examples:
        if len(row[0]) + len(ids) > width:
            rows.append(row)
            row = ([], [])
        row[0].extend(ids)
        row[1].extend(mask)
    rows.append(row)
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows], dtype=torch.long)
    mask = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows], dtype=torch.bool)
    return ids, mask


def chat_batches(ids: torch.Tensor, mask: torch.Tensor, batch: int, seed: int):
    """Endless (batch, width) rows of the packed chats and their masks, a fresh random order every epoch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(ids), generator=gen)
        for i in range(0, len(order) - batch + 1, batch):
            yield ids[order[i:i + batch]], mask[order[i:i + batch]]


def masked_loss(model, ids: torch.Tensor, mask: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy (nats, fp32) of ``model`` over the target tokens of (B, L + 1) rows;
    the logits are computed at those positions only."""
    hidden = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
    targets = mask[:, 1:]
    return F.cross_entropy(model.lm_head(hidden[targets]).float(), ids[:, 1:][targets], reduction=reduction)


@torch.no_grad()
def chat_mean_loss(model, ids: torch.Tensor, mask: torch.Tensor, device: torch.device, batch: int = 8) -> float:
    """Mean cross-entropy (nats/token) over the assistant tokens of packed chats; keeps the model's mode."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for chunk, chunk_mask in zip(ids.split(batch), mask.split(batch)):
        total += masked_loss(model, chunk.to(device), chunk_mask.to(device), reduction="sum")
    model.train(was_training)
    return total.item() / mask[:, 1:].sum().item()


def train_chat(model, chats: tuple[torch.Tensor, torch.Tensor], code: torch.Tensor, args: argparse.Namespace,
               device: torch.device) -> dict:
    """Fine-tune in place: each step ``args.batch`` packed chat rows (loss on the assistant tokens)
    and ``args.code_batch`` code windows (loss on every token), one forward, the loss the sum of
    the two means; bf16 autocast, the schedule of ``train``. Ends with the last step's weights."""
    opt = make_optimizer(model, args, device)
    chat_iter = chat_batches(*chats, args.batch, args.seed)
    code_iter = (train_batches(code.to(device), args.code_batch, args.seq_len, args.seed + 1)
                 if args.code_batch else None)
    losses, step, progress, logged_step = [], 0, 0.0, 0
    start = last_log = time.perf_counter()
    model.train()
    while progress < 1.0:
        lr = learning_rate(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        ids, mask = (t.to(device) for t in next(chat_iter))
        with autocast(device, cpu=True):
            if code_iter is None:
                chat, code_loss = masked_loss(model, ids, mask), torch.zeros((), device=device)
            else:
                windows = next(code_iter)
                x = torch.cat([ids, windows])
                hidden = model.model(input_ids=x[:, :-1], use_cache=False).last_hidden_state
                targets = mask[:, 1:]
                chat = F.cross_entropy(model.lm_head(hidden[:len(ids)][targets]).float(), ids[:, 1:][targets])
                code_loss = F.cross_entropy(model.lm_head(hidden[len(ids):].flatten(0, 1)).float(),
                                            windows[:, 1:].flatten())
        (chat + code_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(torch.stack([chat.detach(), code_loss.detach()]))
        step += 1
        progress = max(step / args.steps, (time.perf_counter() - start) / (60 * args.minutes))
        if step % args.log_every == 0 or progress >= 1.0:
            recent = torch.stack(losses[-args.log_every:]).mean(0).tolist()
            now = time.perf_counter()
            tokens = (step - logged_step) * (args.batch + args.code_batch) * args.seq_len
            print(f"step {step:5d}  chat loss {recent[0]:.4f}  code loss {recent[1]:.4f}  lr {lr:.2e}  "
                  f"tok/s {tokens / (now - last_log):,.0f}  elapsed {now - start:6.1f}s", flush=True)
            last_log, logged_step = now, step
    seconds = time.perf_counter() - start
    curve = torch.stack(losses)
    return {"chat_losses": curve[:, 0].tolist(), "code_losses": curve[:, 1].tolist(), "steps": step,
            "seconds": seconds}


def chat_render(hf_tok, template: str):
    """render(conv, index): the prompt of ``conv``'s assistant message ``index`` through ``template``
    (thinking as the conversation has it: on is the template's default, off passes enable_thinking=False)."""
    def render(conv, index: int) -> str:
        options = {} if conv.thinking else {"enable_thinking": False}
        return hf_tok.apply_chat_template(conv.prompt_messages(index), tools=conv.tools, chat_template=template,
                                          add_generation_prompt=True, tokenize=False, **options)
    return render


def chat_samples(tok, model, render, convs: list, device: torch.device) -> list[dict]:
    """Greedy answers (at most 64 new tokens) to the last turn of each of ``convs``, through transformers."""
    samples = []
    for conv in convs:
        index = max(conv.targets)
        enc = tok(render(conv, index), return_tensors="pt", add_special_tokens=False).to(device)
        ids = model.generate(**enc, max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id)[0]
        new = ids[enc.input_ids.shape[1]:].tolist()
        samples.append({"thinking": conv.thinking, "user": conv.messages[index - 1].get("content"),
                        "answer": tok.decode(new, skip_special_tokens=True),
                        "eos": tok.eos_token_id in new, "tokens": len(new)})
    return samples


def main_chat(args: argparse.Namespace, device: torch.device) -> None:
    """The chat stage: --init's weights fine-tuned on demo_chat's conversations and stdlib code;
    the directory written to --out with the chat template in tokenizer_config.json."""
    import demo_chat

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(args.init / "tokenizer.json"))
    check_round_trip(lambda s: tok.encode(s).ids, tok.decode)
    eot = tok.token_to_id(EOT)
    render = chat_render(AutoTokenizer.from_pretrained(args.init), demo_chat.CHAT_TEMPLATE)
    held_out = 20 if args.smoke else 200
    convs = {"train": demo_chat.conversations(demo_chat.TRAIN_SEED + args.seed, args.conversations, "train",
                                              tool_share=args.tool_share, direct_share=args.direct_share),
             "test": demo_chat.conversations(demo_chat.EVAL_SEED, held_out, "test")}
    chats = {}
    for name, group in convs.items():
        examples = encode_chats(tok, render, group, args.seq_len + 1)
        chats[name] = pack(examples, args.seq_len + 1, eot)
        n_tokens = sum(len(ids) for ids, _ in examples)
        n_targets = sum(sum(mask) for _, mask in examples)
        print(f"chat {name:5s}: {len(group):5d} conversations  {len(examples):5d} sequences  {n_tokens:9,d} tokens  "
              f"{n_targets:8,d} assistant tokens  {len(chats[name][0]):5d} rows of {args.seq_len + 1}")
    sources = stdlib_sources()
    if args.smoke:
        sources = {"train": sources["train"][:150], "test": sources["test"][:2]}
    code_train = token_stream(tok, sources["train"])
    code_test = eval_windows(token_stream(tok, sources["test"]), 512)  # the base stage's test windows
    print(f"code: {len(code_train):,d} train tokens, {code_test[:, 1:].numel():,d} test tokens")
    print(f"data ready in {time.perf_counter() - t0:.1f}s", flush=True)

    def figures(model) -> dict:
        return {"code_test_loss": round(mean_loss(model, code_test, device), 4),
                "chat_test_loss": round(chat_mean_loss(model, *chats["test"], device), 4)}

    model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(device)
    before = figures(model)
    print(f"before: code test loss {before['code_test_loss']:.4f}  chat test loss {before['chat_test_loss']:.4f}",
          flush=True)
    result = train_chat(model, chats["train"], code_train, args, device)
    tokenizer_config = {**TOKENIZER_CONFIG, "chat_template": demo_chat.CHAT_TEMPLATE}
    size = save(model, tok, args.out, tokenizer_config)
    tok_hf, saved = reload(args.out, device)
    after = figures(AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(device))
    print(f"after:  code test loss {after['code_test_loss']:.4f}  chat test loss {after['chat_test_loss']:.4f}")
    print("chat loss curve:", loss_curve(result["chat_losses"]))
    print("code loss curve:", loss_curve(result["code_losses"]))
    picks = [c for c in convs["test"] if c.kind == "chat"][:3] + [c for c in convs["test"] if c.kind == "tool"][:3]
    samples = chat_samples(tok_hf, saved, chat_render(tok_hf, tok_hf.chat_template), picks, device)
    for sample in samples:
        print(f"--- {sample['user']!r} (thinking {'on' if sample['thinking'] else 'off'}; "
              f"{sample['tokens']} tokens{', EOS' if sample['eos'] else ''})\n{sample['answer']}")
    summary = {
        "stage": "chat",
        "code_test_loss_before": before["code_test_loss"], "code_test_loss": after["code_test_loss"],
        "chat_test_loss_before": before["chat_test_loss"], "chat_test_loss": after["chat_test_loss"],
        "samples_ending_with_eos": sum(s["eos"] for s in samples), "samples": len(samples),
        "model_bytes": size,
        "steps": result["steps"],
        "chat_rows": len(chats["train"][0]),
        "train_conversations": len(convs["train"]),
        "tokens_seen": result["steps"] * (args.batch + args.code_batch) * args.seq_len,
        "train_seconds": round(result["seconds"], 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "seed": args.seed,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    disable_progress_bar()
    set_seed(args.seed)
    if args.chat:
        return main_chat(args, device)
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
