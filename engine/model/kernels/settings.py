"""The kernels' switches, decided once per process: which CUDA backend runs the ops, whether a
decode step's linear layers take the decode GEMV, which FP8 GEMM runs. ``KernelSettings.from_env``
is the one place their environment variables are read; an engine resolves them into its
``EngineConfig`` (``engine.core.engine_config``) and ``configure``s the process with them before it
builds a layer; code that runs kernels without an engine gets the environment's, read at first
use. Dispatch reads ``current()``, a module attribute, never the environment."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

BACKEND_ENV = "AGENT_INFER_KERNELS"          # torch | triton | vllm: forces the CUDA backend
DECODE_GEMV_ENV = "AGENT_INFER_DECODE_GEMV"  # "1": linear layers take decode_gemv for a decode step's rows
FP8_GEMM_ENV = "AGENT_INFER_FP8_GEMM"        # triton | scaled_mm: forces the FP8 GEMM (unset: measured)
BACKENDS = ("torch", "triton", "vllm")
FP8_GEMMS = ("triton", "scaled_mm")


@dataclass(frozen=True)
class KernelSettings:
    """``backend``: the CUDA backend forced (None: triton where it runs, else torch; CPU tensors
    always take the torch reference); ``decode_gemv``: linear layers built on CUDA hand a decode
    step's rows to ``kernels.decode_gemv``; ``fp8_gemm``: "triton" keeps the Triton FP8 kernels at
    every row count, "scaled_mm" takes cuBLAS wherever it fits (None: measured per row count,
    ``kernels.triton.fp8``). An unknown name is a ValueError naming its variable."""
    backend: str | None = None
    decode_gemv: bool = False
    fp8_gemm: str | None = None

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.fp8_gemm is not None and self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"{FP8_GEMM_ENV}={self.fp8_gemm!r}: use 'triton' or 'scaled_mm' (unset: measured up "
                             "to 128 rows, scaled_mm beyond on sm90)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelSettings:
        """The settings ``environ``'s variables give (an empty value counts as unset)."""
        return cls(environ.get(BACKEND_ENV) or None, environ.get(DECODE_GEMV_ENV) == "1",
                   environ.get(FP8_GEMM_ENV) or None)


_current: KernelSettings | None = None


def current() -> KernelSettings:
    """The process's settings: the last ``configure``d, else the environment's (read once)."""
    global _current
    if _current is None:
        _current = KernelSettings.from_env()
    return _current


def configure(settings: KernelSettings) -> None:
    """Every kernel call from now on runs under ``settings`` (layers read ``decode_gemv`` when
    they are built)."""
    global _current
    _current = settings


@contextlib.contextmanager
def using(**changes) -> Iterator[KernelSettings]:
    """``current()`` with ``changes`` (fields of ``KernelSettings``) inside the block; the
    settings before it after."""
    before = current()
    configure(dataclasses.replace(before, **changes))
    try:
        yield current()
    finally:
        configure(before)
