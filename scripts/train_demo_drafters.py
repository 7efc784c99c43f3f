"""Train speculative-decoding drafters for the demo model (engine/default_model, see
scripts/train_demo_model.py): a small draft model and an EAGLE-3 head, both on the demo model's own
train split (the stdlib .py sources, same corpus, split and tokenizer), then measure how well they
draft greedily on its held-out test split.

    python scripts/train_demo_drafters.py --method draft --out engine/default_model/draft     # 5 min on 2 CPU cores
    python scripts/train_demo_drafters.py --method eagle3 --out engine/default_model/eagle3   # 5 min on 2 CPU cores

Each: about 4.5 minutes of training (370 steps of 8 windows; 800 of 4), half a minute of evaluation.
Shipped results (seed 0, k = 4): the draft model 3.23 tokens per target forward, the EAGLE-3 head
2.61, the 24 functions of the evaluation below (the engine measures the same).

--method draft: a Qwen3ForCausalLM with the target's vocabulary and tokenizer, 3 layers (hidden 256,
4 query / 2 KV heads of 64, MLP 768, tied embeddings; 4.5M parameters) initialised from the target's
embedding, final norm and layers `--layers` (0, 3 and 5), distilled from the target: KL to its
next-token distribution (temperature 1) over code windows. (Two layers, 0 and 5, reach 2.4 tokens
per forward in the same budget; three, 3.2.) Output: the HF layout (config.json,
generation_config.json, model.safetensors in bf16, tokenizer.json, tokenizer_config.json; the last
three copied from the target).

--method eagle3: an EAGLE-3 head in the layout SGLang and vLLM load (LlamaForCausalLMEagle3):
config.json and model.safetensors (bf16; d2t int64, t2d bool; 1.6M parameters) holding fc,
midlayer.*, norm and lm_head (these two initialised from the target's final norm and LM head rows)
over a 2048-token draft vocabulary (the train split's most frequent tokens, ties by id, sorted by
id; target id = draft id + d2t[draft id]), and no embedding: the head reads the target's, frozen.
Its math, as Eagle3Head implements it: features f_t = cat(hs[1], hs[3], hs[5]) of the target at
position t (transformers' output_hidden_states: hs[i] is the residual stream entering layer i).
Step 1 at position t reads token x_{t+1} and h = fc(f_t); a later step reads the previous step's
draft and h = its `prenorm`, one position further on. Each step: x = cat(rmsnorm(embed(token)),
rmsnorm(h)); Llama attention (neox RoPE theta 1e4, GQA 4/2 heads of 64, no q/k norm) over step 1's
keys at positions <= t and the chain's own steps; r = h + attn; prenorm = r + mlp(rmsnorm(r));
draft logits = lm_head(rmsnorm(prenorm)). Training unrolls `--ttt-steps` steps over every position
of a window at once with the mask inference sees (EAGLE-3's training-time test), data tokens as the
later steps' inputs; loss: KL to the target's next-token distribution renormalised over the draft
vocabulary, step s weighted 0.8^(s-1).

Both train on windows of the train split (scripts/train_demo_model.train_batches), the target's
logits and hidden states computed per batch (float32, no grad), AdamW with warmup and cosine decay
over `--steps`; the step budget ends the run (`--minutes` is only a cap), so a seed and a step
count give the same weights on the same machine and thread count.
Evaluation (the last line of JSON), on the saved files: the first half of the lines of
`--prompts` held-out functions (those `python -m engine bench spec` uses, see
scripts/make_spec_workload.py); the target (float32) decodes `--new-tokens` tokens greedily, and
greedy speculative decoding with `--k` drafts is simulated as the engine runs it (the prefill
forward gives the first token, each verify the accepted drafts + 1): tokens per target forward,
and per draft position the share of verifies that accepted it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
from transformers.utils.logging import disable_progress_bar

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_spec_workload as workload  # noqa: E402
import train_demo_model as base  # noqa: E402

AUX_LAYERS = [1, 3, 5]
DRAFT_VOCAB = 2048
COPIED_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 1, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "vocab_size": base.VOCAB, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": 256,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
}
DEFAULTS = {  # about 4.5 minutes of training each on 2 CPU cores
    "draft": {"steps": 370, "batch": 8, "lr": 1e-3},
    "eagle3": {"steps": 800, "batch": 4, "lr": 3e-3},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=list(DEFAULTS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target", type=Path, default=Path(__file__).resolve().parents[1] / "engine" / "default_model")
    p.add_argument("--steps", type=int, help="step budget, which ends the run (draft 370, eagle3 800)")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock cap on training")
    p.add_argument("--batch", type=int, help="windows per step (draft 8, eagle3 4)")
    p.add_argument("--seq-len", type=int, default=256, help="positions per window")
    p.add_argument("--lr", type=float, help="peak learning rate (draft 1e-3, eagle3 3e-3)")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--layers", default="0,3,5", help="draft: the target layers its layers start from")
    p.add_argument("--ttt-steps", type=int, default=4, help="eagle3: steps unrolled in training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--prompts", type=int, default=24, help="held-out functions in the evaluation")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="drafts per verify in the evaluation")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.method].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------- the draft model

def build_draft(target: Qwen3ForCausalLM, layers: list[int]) -> Qwen3ForCausalLM:
    """A Qwen3 like the target with only ``layers`` (copied from it), its embedding and final norm."""
    config = target.config.to_dict()
    config.update(num_hidden_layers=len(layers), layer_types=[config["layer_types"][i] for i in layers])
    draft = Qwen3ForCausalLM(type(target.config).from_dict(config))
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for mine, theirs in zip(draft.model.layers, layers):
        mine.load_state_dict(target.model.layers[theirs].state_dict())
    return draft


def draft_loss(draft: Qwen3ForCausalLM, target, windows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """KL(target || draft) per position, and the draft's top-1 agreement with the target."""
    with torch.no_grad():
        teacher = target(input_ids=windows).logits.log_softmax(-1)
    logits = draft(input_ids=windows).logits
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
    return kl(logits, teacher), [agree]


# ---------------------------------------------------------------- the EAGLE-3 head

def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox (rotate_half) rotary embedding of x [..., L, D] at positions pos [L]."""
    d = x.shape[-1]
    angle = pos[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)
    angle = torch.cat([angle, angle], -1)
    x1, x2 = x.chunk(2, -1)
    return x * angle.cos() + torch.cat([-x2, x1], -1) * angle.sin()


def module(**children: nn.Module) -> nn.Module:
    parent = nn.Module()
    for name, child in children.items():
        parent.add_module(name, child)
    return parent


class Eagle3Head(nn.Module):
    """The EAGLE-3 head; its state_dict is the published layout (no embedding: the target's)."""

    def __init__(self, vocab_ids: torch.Tensor, c: dict = EAGLE3_CONFIG):
        super().__init__()
        hidden, heads, kv, dim, mlp = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                                       c["head_dim"], c["intermediate_size"])
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv, dim, c["rope_theta"]

        def norm():
            return nn.RMSNorm(hidden, eps=c["rms_norm_eps"])

        def linear(i, o):
            return nn.Linear(i, o, bias=False)

        self.fc = linear(len(AUX_LAYERS) * c["target_hidden_size"], hidden)
        self.midlayer = module(
            input_layernorm=norm(), hidden_norm=norm(), post_attention_layernorm=norm(),
            self_attn=module(q_proj=linear(2 * hidden, heads * dim), k_proj=linear(2 * hidden, kv * dim),
                             v_proj=linear(2 * hidden, kv * dim), o_proj=linear(heads * dim, hidden)),
            mlp=module(gate_proj=linear(hidden, mlp), up_proj=linear(hidden, mlp), down_proj=linear(mlp, hidden)))
        self.norm = norm()
        self.lm_head = linear(hidden, len(vocab_ids))
        self.register_buffer("d2t", vocab_ids - torch.arange(len(vocab_ids)))
        self.register_buffer("t2d", torch.zeros(c["vocab_size"], dtype=torch.bool).index_fill(0, vocab_ids, True))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def qkv(self, emb: torch.Tensor, h: torch.Tensor, pos: torch.Tensor):
        """One step's rotated queries [B, heads, L, D] and keys and values [B, kv_heads, L, D]."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], -1)
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        return rope(q, pos, self.theta), rope(k, pos, self.theta), v

    def attend(self, q: torch.Tensor, keys: list, values: list) -> torch.Tensor:
        """The newest step's attention: to step 1's keys at positions <= the chain's start, causally,
        and to the chain's own steps 2.. (one key each, on the diagonal)."""
        rep = self.heads // self.kv_heads
        keys, values = [k.repeat_interleave(rep, 1) for k in keys], [v.repeat_interleave(rep, 1) for v in values]
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(q * k).sum(-1, keepdim=True) for k in keys[1:]]
        p = (torch.cat(scores, -1) * self.head_dim ** -0.5).softmax(-1)
        out = p[..., :n] @ values[0]
        for i, v in enumerate(values[1:]):
            out = out + p[..., n + i:n + i + 1] * v
        return self.midlayer.self_attn.o_proj(out.transpose(1, 2).flatten(2))

    def unroll(self, embed: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor, steps: int,
               feed_drafts: bool = False) -> list[torch.Tensor]:
        """Draft logits [B, L, draft vocab] of ``steps`` chained steps from every position t < L of
        feats [B, L, 3 * hidden] (the target's features). Step 1 at t reads tokens[:, t]; step s > 1
        runs at position t + s - 1 on step s-1's prenorm and token tokens[:, t + s - 1] (needs
        L + steps - 1 tokens) or, with ``feed_drafts``, step s-1's draft: each chain sees exactly what
        greedy drafting from t sees at inference."""
        n = feats.shape[1]
        pos, h, token = torch.arange(n), self.fc(feats), tokens[:, :n]
        keys, values, logits = [], [], []
        for s in range(steps):
            q, k, v = self.qkv(F.embedding(token, embed), h, pos + s)
            keys.append(k)
            values.append(v)
            r = h + self.attend(q, keys, values)
            mlp = self.midlayer.mlp
            x = self.midlayer.post_attention_layernorm(r)
            h = r + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
            logits.append(self.lm_head(self.norm(h)))
            token = self.to_target(logits[-1].argmax(-1)) if feed_drafts else tokens[:, s + 1:s + 1 + n]
        return logits


def features(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last (normed) hidden state and its EAGLE-3 features cat(hs[1], hs[3], hs[5])
    at every position."""
    out = target.model(input_ids=ids, output_hidden_states=True)
    return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in AUX_LAYERS], -1)


def eagle3_loss(head: Eagle3Head, target, windows: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Training-time test over (B, L + steps) windows: the step-weighted KL to the target's
    distribution renormalised over the draft vocabulary, and each step's top-1 agreement with it."""
    n = windows.shape[1] - steps
    vocab = head.to_target(torch.arange(head.lm_head.out_features))
    with torch.no_grad():
        last, feats = features(target, windows)
        teacher = F.linear(last, target.lm_head.weight[vocab]).log_softmax(-1)
    logits = head.unroll(target.model.embed_tokens.weight, feats[:, :n], windows[:, 1:], steps)
    loss, agree = 0.0, []
    for s, out in enumerate(logits, 1):
        want = teacher[:, s:s + n]
        loss = loss + 0.8 ** (s - 1) * kl(out, want)
        agree.append((out.argmax(-1) == want.argmax(-1)).float().mean().item())
    return loss, agree


def draft_vocab(stream: torch.Tensor) -> torch.Tensor:
    """The DRAFT_VOCAB most frequent ids of ``stream`` (ties: lower id first), in id order."""
    counts = torch.bincount(stream, minlength=base.VOCAB)
    return counts.sort(descending=True, stable=True).indices[:DRAFT_VOCAB].sort().values


def save_eagle3(head: Eagle3Head, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v if k in ("d2t", "t2d") else v.to(torch.bfloat16) for k, v in head.state_dict().items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(EAGLE3_CONFIG, indent=2) + "\n")


# ---------------------------------------------------------------- training and evaluation

def kl(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || softmax(logits)) over positions (teacher: log-probabilities), nats."""
    return (teacher.exp() * (teacher - logits.log_softmax(-1))).sum(-1).mean()


def train(model: nn.Module, loss_fn, batches, args: argparse.Namespace) -> dict:
    """``args.steps`` AdamW steps of ``loss_fn(windows) -> (loss, agreements)`` (stopped early
    only by the ``args.minutes`` cap)."""
    opt = base.make_optimizer(model, args, torch.device("cpu"))
    start = time.perf_counter()
    losses, agree = [], []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = base.learning_rate(step, step / args.steps, args)
        loss, agreement = loss_fn(next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        agree.append(agreement)
        elapsed = time.perf_counter() - start
        capped = elapsed > 60 * args.minutes
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps or capped:
            recent = torch.tensor(agree[-args.log_every:]).mean(0).tolist()
            print(f"step {step + 1:5d}  loss {torch.tensor(losses[-args.log_every:]).mean():.4f}  "
                  f"top-1 agreement {' '.join(f'{a:.3f}' for a in recent)}  elapsed {elapsed:6.1f}s", flush=True)
        if capped:
            print(f"stopped by the {args.minutes}-minute cap after {step + 1} steps", flush=True)
            break
    return {"steps": len(losses), "seconds": round(elapsed, 1),
            "final_loss": round(torch.tensor(losses[-args.log_every:]).mean().item(), 4)}


def eval_prompts(tok: Tokenizer, count: int) -> list[list[int]]:
    """The first half of the lines of held-out functions: those of `python -m engine bench spec`
    (scripts/make_spec_workload.py picks one in 5 of the test split's functions, the first 24)."""
    found = [code for rel, text in workload.test_split_files() for _, code, _ in workload.functions(rel, text)]
    prompts = []
    for code in found[::5][:count]:
        lines = code.splitlines()
        prompts.append(tok.encode("\n".join(lines[:len(lines) // 2])).ids)
    return prompts


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """Up to ``n`` greedy tokens after ``ids`` (through ``eos``, if given)."""
    new = []
    while len(new) < n and (eos is None or eos not in new):
        new.append(int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax()))
    return new


def simulate(seq: list[int], start: int, propose, k: int) -> tuple[int, list[int]]:
    """Greedy speculative decoding of seq[start:] (the target's own greedy tokens): target
    forwards, and per draft position the verifies that accepted it."""
    n, forwards, accepted = start, 0, [0] * k
    while n < len(seq):
        drafts, a = propose(n), 0
        while a < k and n + a < len(seq) and drafts[a] == seq[n + a]:
            accepted[a] += 1
            a += 1
        forwards, n = forwards + 1, n + a + 1
    return forwards, accepted


@torch.no_grad()
def evaluate(target, proposer, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Greedy speculative decoding with ``proposer(seq) -> propose(n)`` as the engine runs it: the
    prefill forward gives the first token, then each verify accepts a prefix of the k drafts and
    adds the target's token. Tokens per target forward (the prefill counted) and, per draft
    position, the share of verifies that accepted it."""
    forwards, verifies, accepted, tokens = 0, 0, [0] * args.k, 0
    for prompt in prompts:
        seq = prompt + greedy(target, prompt, args.new_tokens, target.config.eos_token_id)
        v, a = simulate(seq, len(prompt) + 1, proposer(seq), args.k)
        forwards, verifies, tokens = forwards + 1 + v, verifies + v, tokens + len(seq) - len(prompt)
        accepted = [x + y for x, y in zip(accepted, a)]
    return {"tokens_per_forward": round(tokens / forwards, 3), "tokens": tokens, "forwards": forwards,
            "acceptance_by_position": [round(a / verifies, 3) for a in accepted]}


def draft_proposer(draft, k: int):
    return lambda seq: lambda n: greedy(draft, seq[:n], k)


def eagle3_proposer(head: Eagle3Head, target, k: int):
    """Drafts from every prefix of seq at once: chain t starts after the target's features of
    seq[:t + 1], reading token seq[t + 1]; a prefix of n tokens drafts from chain n - 2."""
    def proposer(seq):
        ids = torch.tensor([seq])
        _, feats = features(target, ids[:, :-1])
        logits = head.unroll(target.model.embed_tokens.weight, feats, ids[:, 1:], k, feed_drafts=True)
        drafts = torch.stack([head.to_target(x[0].argmax(-1)) for x in logits], -1).tolist()
        return lambda n: drafts[n - 2]
    return proposer


def main() -> None:
    args = parse_args()
    disable_progress_bar()
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    sources = base.stdlib_sources()
    stream = base.token_stream(tok, sources["train"])
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    extra = args.ttt_steps - 1 if args.method == "eagle3" else -1  # windows of seq_len (+ steps) tokens
    batches = base.train_batches(stream, args.batch, args.seq_len + extra, args.seed)
    print(f"{args.method}: {len(sources['train'])} train files, {len(stream):,} tokens", flush=True)

    if args.method == "draft":
        model = build_draft(target, [int(i) for i in args.layers.split(",")])
        result = train(model, lambda w: draft_loss(model, target, w), batches, args)
        model.to(torch.bfloat16).save_pretrained(args.out)
        for name in COPIED_FILES:
            shutil.copy(args.target / name, args.out / name)
        saved = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
        proposer = draft_proposer(saved, args.k)
    else:
        model = Eagle3Head(draft_vocab(stream))
        with torch.no_grad():  # the target's LM head rows of the draft vocabulary, and its final norm
            model.lm_head.weight.copy_(target.lm_head.weight[model.to_target(torch.arange(DRAFT_VOCAB))])
            model.norm.weight.copy_(target.model.norm.weight)
        result = train(model, lambda w: eagle3_loss(model, target, w, args.ttt_steps), batches, args)
        save_eagle3(model, args.out)
        saved = Eagle3Head(model.d2t + torch.arange(DRAFT_VOCAB))
        saved.load_state_dict({k: v.float() if v.is_floating_point() else v
                               for k, v in load_file(args.out / "model.safetensors").items()})
        proposer = eagle3_proposer(saved.eval(), target, args.k)

    prompts = eval_prompts(tok, args.prompts)
    start = time.perf_counter()
    evaluation = evaluate(target, proposer, prompts, args)
    print(json.dumps({
        "method": args.method, "out": str(args.out), "seed": args.seed, **result,
        "parameters": sum(p.numel() for p in model.parameters()),
        "safetensors_bytes": (args.out / "model.safetensors").stat().st_size,
        "eval": {"prompts": len(prompts), "new_tokens": args.new_tokens, "k": args.k, **evaluation,
                 "seconds": round(time.perf_counter() - start, 1)},
    }))


if __name__ == "__main__":
    main()
