"""The engine's options resolved once into a frozen ``EngineConfig``.

``EngineArgs.create_engine_config()`` (``resolve`` here) turns what a caller gave — anything may
be left to its default — into values that are all decided: the checkpoint and its model class,
device, dtype, lengths, the pool's limits, graphs, overlap, speculation. Each section says why
its defaults are what they are; ``LLMEngine(config)`` builds from it and decides nothing again.
A value that cannot work is a ValueError naming the option, raised here, before any weight is
read.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.core.model_source import resolve_model
from engine.model.config import ModelConfig
from engine.model.kernels import FP8_DTYPE, KernelSettings
from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.model.models.dense import DenseForCausalLM
from engine.model.models.registry import MODEL_CLASSES, default_dtype
from engine.scheduling.scheduler import SchedulerSettings
from engine.scheduling.speculative import DRAFT_CHECKPOINT_METHODS, SPECULATIVE_METHODS, NgramDrafter

DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "default_model"  # engine/default_model
FORCED_CLASSES = {"qwen_tp": DenseForCausalLM, "deepseek_tp": DeepseekV2ForCausalLM}
BACKENDS = ("tp", *FORCED_CLASSES, "hf")
DEFAULT_PREFILL_GRAPH_TOKENS = 2048  # steps above it are GPU-bound on an H200: their host dispatch hides
# serving Qwen3-8B on an H200 (64 streams, 512 in / 128 out): ITL p99 1.6 x its median at this cap, 25 x without
DEFAULT_PREFILL_TOKENS_BESIDE_DECODES = 384


@dataclass(frozen=True)
class ModelSettings:
    """What runs: the checkpoint in ``model_dir`` (default: the demo model shipped in
    ``engine/default_model``, so a fresh clone runs with no download; for a Hub id its snapshot in
    the Hugging Face cache, ``engine.core.model_source``), the model's ``name`` (the Hub id as given,
    else the directory's name: the served model name's default), its ``config.json``
    (``config``), the ``backend`` and the model class it routes to (``model_class``; None for
    "hf", transformers' own model under our scheduler), the ``dtype`` (default: float32 on CPU,
    where every phase checks float32 against transformers; on CUDA the checkpoint's half dtype,
    else bfloat16) and ``quantization`` ("fp8": a float checkpoint quantized at load)."""

    model_dir: Path
    name: str
    config: ModelConfig
    backend: str
    model_class: type | None
    dtype: torch.dtype
    quantization: str | None


KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}  # vLLM's names


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache: ``block_size`` tokens per block, in ``dtype`` (None: the model's; e4m3 for
    ``--kv-cache-dtype fp8``, see ``kernels.store_kv_cache``); the pool takes at most ``budget_bytes``,
    or (None) ``mem_utilization`` of the memory free after loading (the device's; on CPU the host's),
    less ``reserve_bytes`` kept for activations (its size is planned by the runner from the workload,
    ``kv_cache.plan_num_blocks``);
    ``enable_prefix_caching`` (off for the hf backend: each sequence runs its whole prompt in
    transformers' own cache)."""

    block_size: int
    dtype: torch.dtype | None
    mem_utilization: float
    reserve_bytes: int
    budget_bytes: int | None
    enable_prefix_caching: bool


@dataclass(frozen=True)
class ParallelSettings:
    """Where it runs: ``device`` (default ``cuda:LOCAL_RANK`` when CUDA is present, one GPU per
    torchrun rank, else the CPU); ``cuda_graphs`` (decode replays CUDA graphs on CUDA unless
    ``enforce_eager``); ``prefill_graph_tokens`` (steps with prefill chunks of up to this many
    tokens replay piecewise graphs, ``engine.worker.piecewise_graphs``: by default 2,048 capped at
    ``max_num_batched_tokens`` with CUDA graphs on, where a longer step's GPU time exceeds its
    host dispatch anyway; 0 otherwise); ``custom_all_reduce`` (under TP on CUDA, small all-reduces
    through symmetric memory, else NCCL only)."""

    device: torch.device
    cuda_graphs: bool
    prefill_graph_tokens: int
    custom_all_reduce: bool


@dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding: ``method`` (None: off, the default; "ngram": prompt lookup, which pays
    only when answers repeat their context; "draft": a smaller model, "eagle3": an EAGLE-3 head,
    both read from ``draft_model``; "mtp": the target checkpoint's own DeepSeek multi-token
    prediction layer), ``num_speculative_tokens`` drafted per decode, and the n-gram drafter's
    ``prompt_lookup_min`` and ``prompt_lookup_max`` (checked by ``NgramDrafter``). ``draft_model``:
    the draft checkpoint's directory ("draft" and "eagle3"; for the demo model its shipped
    drafters ``engine/default_model/draft`` and ``.../eagle3`` by default), else None."""

    method: str | None
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    draft_model: Path | None = None

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens one decode entry drafts (0 without speculation)."""
        return self.num_speculative_tokens if self.method is not None else 0

    def drafter(self) -> NgramDrafter | None:
        """The n-gram drafter (a model drafter is the runner's: ``engine.worker.drafting``)."""
        if self.method != "ngram":
            return None
        return NgramDrafter(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, decided. ``progress``: show a loading bar (default: on a terminal, on
    rank 0). ``kernels``: the kernels' switches (CUDA backend, decode GEMV, FP8 GEMM), read from
    their environment variables once, here (``KernelSettings.from_env``); the engine configures the
    process with them before it builds a layer.

    ``scheduler`` (``engine.scheduling.scheduler.SchedulerSettings``, which checks its values) gets these
    defaults: ``max_num_seqs`` 256 on CUDA, where batches pay, 16 on CPU, where the pool holds
    ``max_num_seqs x max_model_len`` tokens in host memory; ``max_model_len`` the model's
    ``max_position_embeddings``; ``prefill_tokens_beside_decodes``
    ``DEFAULT_PREFILL_TOKENS_BESIDE_DECODES`` for a serving engine on CUDA, where it bounds the gap
    between two streamed tokens (measured on the H200, see docs/performance.md), 0 (no cap beyond the
    budget) for offline work, whose throughput the cap lowers; ``overlap`` on, except for the hf
    backend, which runs each step at launch, and with speculation, whose drafts need every token
    on the host."""

    model: ModelSettings
    cache: CacheSettings
    scheduler: SchedulerSettings
    parallel: ParallelSettings
    speculative: SpeculativeSettings
    progress: bool
    kernels: KernelSettings


def model_class_for(config: ModelConfig, backend: str) -> type | None:
    """The model class for ``backend`` (None for "hf"): "tp" routes by ``architectures[0]``;
    "qwen_tp" / "deepseek_tp" force that family's runner (an architecture the registry maps into
    the family keeps its own class, e.g. Qwen2-VL's text-only variant)."""
    if backend not in BACKENDS:
        raise ValueError(f"inference_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "hf":
        return None
    known = MODEL_CLASSES.get(config.architecture)
    if backend == "tp":
        if known is None:
            raise ValueError(f"unsupported architecture {config.architecture!r} in config.json; supported: "
                             f"{', '.join(sorted(MODEL_CLASSES))} (or inference_backend='hf', 'qwen_tp', "
                             f"'deepseek_tp')")
        return known
    forced = FORCED_CLASSES[backend]
    return known if known is not None and issubclass(known, forced) else forced


def _kv_cache_dtype(name: str, ours: bool) -> torch.dtype | None:
    """The KV cache dtype of ``--kv-cache-dtype name`` (None: the model's); an unknown name, or
    FP8 for transformers' own model (the hf backend keeps its own cache), is a ValueError."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if KV_CACHE_DTYPES[name] is not None and not ours:
        raise ValueError(f"kv_cache_dtype={name} needs one of our model classes; the hf backend keeps "
                         "transformers' own cache")
    return KV_CACHE_DTYPES[name]


def _prefill_graph_tokens(requested: int | None, cuda_graphs: bool, max_num_batched_tokens: int) -> int:
    """The largest step with prefill chunks that replays piecewise graphs (0: none); asking for
    some without CUDA graphs of our own model classes (the hf backend runs transformers' model), or
    for a negative number, is a ValueError."""
    if requested is None:
        return min(DEFAULT_PREFILL_GRAPH_TOKENS, max_num_batched_tokens) if cuda_graphs else 0
    if requested < 0:
        raise ValueError(f"prefill_graph_tokens must be >= 0, got {requested}")
    if requested and not cuda_graphs:
        raise ValueError(f"prefill_graph_tokens={requested} needs CUDA graphs (a CUDA device, without enforce_eager, "
                         "one of our model classes)")
    return min(requested, max_num_batched_tokens)


def resolve(args) -> EngineConfig:
    """``args`` with every default decided and every value checked. ``args`` is read by attribute:
    an ``EngineArgs`` (``engine.core.engine_args``, whose ``create_engine_config`` calls this). That
    module stands above this one and imports it, so this one never names it, not even in an
    annotation: the two form no import circle (``tests/test_import_graph.py``)."""
    progress = args.progress
    if progress is None:
        progress = sys.stderr.isatty() and int(os.environ.get("RANK", "0")) == 0
    model_dir, name = resolve_model(args.model if args.model is not None else DEFAULT_MODEL_DIR, args.revision,
                                    progress=progress)
    config = ModelConfig.from_model_dir(model_dir, args.quantization)
    model_class = model_class_for(config, args.backend)
    speculative = _speculative(args, model_class, model_dir, progress)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = config.max_position_embeddings
    elif not 0 < max_model_len <= config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} must be in [1, {config.max_position_embeddings}] "
                         f"(the model's max_position_embeddings)")
    device = _device(args.device)
    dtype = args.dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError("dtype must be one of float32, float16, bfloat16")
    max_num_seqs = args.max_num_seqs if args.max_num_seqs is not None else 256 if device.type == "cuda" else 16
    max_num_batched_tokens = args.max_num_batched_tokens
    cuda_graphs = device.type == "cuda" and not args.enforce_eager
    ours = model_class is not None
    return EngineConfig(
        ModelSettings(model_dir, name, config, args.backend, model_class, dtype or default_dtype(config, device),
                      args.quantization),
        CacheSettings(args.block_size, _kv_cache_dtype(args.kv_cache_dtype, ours), args.mem_utilization,
                      args.reserve_bytes, _kv_cache_budget(args.kv_cache_memory), args.enable_prefix_caching and ours),
        SchedulerSettings(max_num_seqs, max_num_batched_tokens, max_model_len, args.admission,
                          _prefill_tokens_beside_decodes(args.prefill_tokens_beside_decodes, device, args.serving),
                          args.overlap and ours and speculative.method is None),
        ParallelSettings(device, cuda_graphs, _prefill_graph_tokens(args.prefill_graph_tokens, cuda_graphs and ours,
                                                                    max_num_batched_tokens), args.custom_all_reduce),
        speculative, progress, KernelSettings.from_env())


def _kv_cache_budget(gib: float | None) -> int | None:
    """``--kv-cache-memory`` in bytes (None: not given)."""
    if gib is None:
        return None
    if not (isinstance(gib, (int, float)) and 0 < gib < float("inf")):
        raise ValueError(f"kv_cache_memory must be a positive number of GiB, got {gib!r}")
    return int(gib * 2**30)


def _prefill_tokens_beside_decodes(requested: int | None, device: torch.device, serving: bool) -> int:
    """The cap's default (``SchedulerSettings`` checks a given one)."""
    if requested is None:
        return DEFAULT_PREFILL_TOKENS_BESIDE_DECODES if serving and device.type == "cuda" else 0
    return requested


def _speculative(args, model_class: type | None, model_dir: Path, progress: bool) -> SpeculativeSettings:
    if args.speculative not in (None, *SPECULATIVE_METHODS):
        raise ValueError(f"speculative must be None or one of {', '.join(SPECULATIVE_METHODS)}, "
                         f"got {args.speculative!r}")
    if args.speculative is not None and model_class is None:
        raise ValueError("speculative decoding needs our own runner: the hf backend verifies no drafts")
    settings = SpeculativeSettings(args.speculative, args.num_speculative_tokens, args.prompt_lookup_min,
                                   args.prompt_lookup_max)
    NgramDrafter(args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max)  # checks the options
    draft_model = args.draft_model
    if args.speculative in DRAFT_CHECKPOINT_METHODS:
        if draft_model is None and model_dir == DEFAULT_MODEL_DIR:
            draft_model = DEFAULT_MODEL_DIR / args.speculative
        if draft_model is None:
            raise ValueError(f"speculative={args.speculative!r} needs draft_model (--draft-model DIR|ORG/NAME): "
                             "the draft checkpoint")
        draft_model, _ = resolve_model(draft_model, None, progress=progress)
    elif draft_model is not None:
        raise ValueError(f"draft_model is read by speculative='draft' or 'eagle3' only, not {args.speculative!r}")
    return replace(settings, draft_model=draft_model)


def _device(device: torch.device | str | None) -> torch.device:
    """``device``, or ``cuda:LOCAL_RANK`` when CUDA is present, else the CPU; "cuda" without an
    index is the current CUDA device."""
    if device is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
