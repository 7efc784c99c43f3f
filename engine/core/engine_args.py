"""Engine options in one place: what a caller may give ``LLMEngine``, the command-line flags and help.

``EngineArgs.add_cli_args(parser)`` adds the "engine" option group every command that loads a
model shares (``generate``, ``serve``, ``bench``), ``EngineArgs.from_cli_args(args)`` reads it
back, ``create_engine_config()`` resolves every default into a frozen ``EngineConfig``
(``engine.core.engine_config``), which ``LLMEngine(config)`` is built from, and ``to_cli_args()`` turns the
options that differ from the defaults back into flags (what ``bench serve --launch`` passes to
the server it starts). Fields without a flag are options of the Python API only.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from engine.core.engine_config import DEFAULT_PREFILL_TOKENS_BESIDE_DECODES, KV_CACHE_DTYPES, EngineConfig, resolve
from engine.scheduling.scheduler import ADMISSION_POLICIES
from engine.scheduling.speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS


def _option(default, flag: str, help: str, **argparse_kwargs):
    """A field with its command-line flag; a bool whose flag turns it off (``--no-...``) stores False."""
    return field(default=default, metadata={"flag": flag, "help": help, **argparse_kwargs})


@dataclass
class EngineArgs:
    model: str | None = _option(None, "--model", "a Hugging Face checkpoint directory (config.json, safetensors, "
                                "tokenizer), else a Hugging Face Hub id fetched into the Hugging Face cache "
                                "(HF_HUB_OFFLINE=1: found there); default: the demo model shipped in "
                                "engine/default_model", metavar="DIR|ORG/NAME")
    revision: str | None = _option(None, "--revision", "with a Hub id: the branch, tag or commit to load (default "
                                   "main)")
    backend: str = _option("tp", "--backend", "tp: route by config.json architectures[0] (default); hf: "
                           "transformers under our scheduler", choices=["tp", "qwen_tp", "deepseek_tp", "hf"])
    dtype: str | None = _option(None, "--dtype", "default: float32 on CPU, the checkpoint's half dtype (else "
                                "bfloat16) on CUDA", choices=["float32", "float16", "bfloat16"])
    device: str | None = _option(None, "--device", "default: cuda:LOCAL_RANK when CUDA is present, else cpu")
    max_model_len: int | None = _option(None, "--max-model-len", "longest prompt + output in tokens (default: the "
                                        "model's max_position_embeddings)", type=int)
    max_num_seqs: int | None = _option(None, "--max-num-seqs", "most sequences running at once (default 256 on "
                                       "CUDA, 16 on CPU)", type=int)
    max_num_batched_tokens: int = _option(8192, "--max-num-batched-tokens", "most tokens in one step (decodes and "
                                          "prompt chunks); longer prompts are prefilled in chunks (default 8192)",
                                          type=int)
    prefill_tokens_beside_decodes: int | None = _option(
        None, "--prefill-tokens-beside-decodes", "most prompt tokens a step that also decodes may carry: every stream "
        "waits for the whole step, so this bounds the gap between two tokens under load (default: "
        f"{DEFAULT_PREFILL_TOKENS_BESIDE_DECODES} when serving on CUDA, else 0; 0: only --max-num-batched-tokens "
        "caps it)",
        type=int)
    admission: str = _option(ADMISSION_POLICIES[0], "--admission", "watermark: start a request when its prompt fits "
                             "the KV cache, preempting (and later recomputing) the newest requests when it runs out "
                             "(default); reserve: start one only when its prompt + max_tokens fits beside every "
                             "running request's, never preempting", choices=ADMISSION_POLICIES)
    block_size: int = _option(16, "--block-size", "KV cache block size in tokens (default 16)", type=int)
    kv_cache_dtype: str = _option("auto", "--kv-cache-dtype", "auto: the KV cache in the model's dtype (default); "
                                  "fp8 (or fp8_e4m3): e4m3, half the bytes of bf16, values saturated at ±448 with "
                                  "scale 1 (not for the hf backend)", choices=list(KV_CACHE_DTYPES))
    mem_utilization: float = _option(0.9, "--mem-utilization", "fraction of the memory free after loading (the "
                                     "device's; on CPU the host's) the KV cache may take (default 0.9)", type=float)
    kv_cache_memory: float | None = _option(None, "--kv-cache-memory", "GiB the KV cache may take, in place of "
                                            "--mem-utilization (default: not set)", type=float, metavar="GIB")
    enable_prefix_caching: bool = _option(True, "--no-prefix-caching", "turn prefix caching off")
    enforce_eager: bool = _option(False, "--enforce-eager", "decode without CUDA graphs (graphs are the default on "
                                  "CUDA)")
    prefill_graph_tokens: int | None = _option(None, "--prefill-graph-tokens", "steps that carry prefill chunks, up "
                                               "to this many tokens, replay piecewise CUDA graphs around their "
                                               "attention (default: 2048, at most --max-num-batched-tokens, when "
                                               "CUDA graphs are on; 0: such steps run eagerly)", type=int)
    custom_all_reduce: bool = _option(True, "--disable-custom-all-reduce", "tensor parallel on CUDA: all-reduce with "
                                      "NCCL only (default: symmetric memory for small messages)")
    quantization: str | None = _option(None, "--quantization", "fp8: quantize a float checkpoint's linear weights to "
                                       "FP8 at load (128 x 128 blocks, W8A8); FP8 checkpoints are read in their own "
                                       "format without it", choices=["fp8"])
    overlap: bool = _option(True, "--no-overlap", "run each step to the end before scheduling the next (default: the "
                            "host schedules and postprocesses while the device runs the previous step)")
    speculative: str | None = _option(None, "--speculative", "speculative decoding: drafts the next tokens and "
                                      "verifies them in the decode step, giving the same tokens: ngram by prompt "
                                      "lookup, draft by a smaller model, eagle3 by an EAGLE-3 head (both "
                                      "--draft-model), mtp by a DeepSeek-V3 checkpoint's own MTP layer (default: "
                                      "off; runs synchronous steps)", choices=list(SPECULATIVE_METHODS))
    draft_model: str | None = _option(None, "--draft-model", "the draft checkpoint (directory or Hub id) of "
                                      "--speculative draft or eagle3 (default for the demo model: its shipped "
                                      "drafters)", metavar="DIR|ORG/NAME")
    num_speculative_tokens: int = _option(4, "--num-speculative-tokens", "most tokens drafted per decode, "
                                          f"1-{MAX_SPECULATIVE_TOKENS} (default 4)", type=int)
    prompt_lookup_min: int = _option(2, "--prompt-lookup-min", "shortest suffix the n-gram drafter looks up "
                                     "(default 2)", type=int)
    prompt_lookup_max: int = _option(4, "--prompt-lookup-max", "longest suffix the n-gram drafter looks up, tried "
                                     "first (default 4)", type=int)
    serving: bool = field(default=False, metadata={"help": "the engine streams tokens to clients (``serve`` sets "
                                                   "it): the default prefill_tokens_beside_decodes caps the prompt "
                                                   "tokens beside decodes on CUDA"})
    reserve_bytes: int = field(default=2 << 30, metadata={"help": "device memory the KV cache leaves free"})
    progress: bool | None = field(default=None, metadata={"help": "a loading bar (default: on a terminal, rank 0)"})

    @classmethod
    def _flagged(cls):
        return [f for f in fields(cls) if "flag" in f.metadata]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        for f in cls._flagged():
            meta = dict(f.metadata)
            flag, help = meta.pop("flag"), meta.pop("help")
            if isinstance(f.default, bool):
                meta["action"] = "store_false" if f.default else "store_true"
            group.add_argument(flag, dest=f.name, default=f.default, help=help, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in cls._flagged()})

    def to_cli_args(self) -> list[str]:
        """The flags that give these options (those left at their default are omitted)."""
        flags = []
        for f in self._flagged():
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flags += [f.metadata["flag"]] if isinstance(f.default, bool) else [f.metadata["flag"], str(value)]
        return flags

    def create_engine_config(self) -> EngineConfig:
        """These options with every default decided and every value checked."""
        return resolve(self)
