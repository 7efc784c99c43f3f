"""Text in, text out through a real byte-level BPE tokenizer, with multi-byte characters."""
import json

import pytest
import torch

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks
from phases.checkpoints import make_tiny_checkpoint

CORPUS = ["naïve café déjà vu", "über straße grüße", "日本語のテキスト 世界", "emoji 🙂 🚀 ok",
          "the quick brown fox jumps over the lazy dog", "def f(x):\n    return x * 2\n"] * 20


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory):
    """A tiny Qwen3 checkpoint whose tokenizer is a byte-level BPE trained here (vocab 400 < 512),
    so characters outside ASCII span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bpe"), "Qwen3ForCausalLM", seed=9)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|endoftext|>"}))
    return path


def test_prompts_round_trip_and_outputs_decode_whole(bpe_checkpoint):
    engine = LLMEngine(bpe_checkpoint, block_size=4, max_num_seqs=4, max_model_len=128)
    tok = engine.tokenizer
    for text in CORPUS[:6]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert len(ids) > 1
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)
    rids = [engine.add_request(t, params) for t in CORPUS[:6]]
    while engine.has_unfinished_requests():
        engine.step()
    for rid in rids:
        out = engine.pop_request(rid)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert_no_block_leaks(engine)


def test_incremental_detokenizer_never_splits_a_character(bpe_checkpoint):
    """Streaming deltas never hold half a character (no U+FFFD), and they add up to the
    whole decode, for multi-byte text and for random byte-level token sequences."""
    engine = LLMEngine(bpe_checkpoint, block_size=4, max_num_seqs=2, max_model_len=64)
    tok = engine.tokenizer
    streams = [tok.encode(t, add_special_tokens=False) for t in CORPUS[:6]]
    gen = torch.Generator().manual_seed(0)
    streams += [torch.randint(2, 400, (30,), generator=gen).tolist() for _ in range(5)]
    for ids in streams:
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.add(t) for t in ids] + [detok.flush()]
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == detok.text == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)
