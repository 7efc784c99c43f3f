"""Launch a Triton kernel through its compiled kernel's own launcher once its launch signature is known.

``kernel[grid](*args)`` binds every argument, specialises it (dtype and 16-byte alignment of a
tensor, an integer's range, whether it is 1 or a multiple of 16), builds a cache key and looks the
compiled kernel up, on every call: on an H200 host 18-49 µs of Python a launch against 6-15 µs
for the compiled kernel's launcher alone (``scripts/bench_dispatch.py``), and an eager Qwen3-8B
decode step makes 217 of them. ``launch_kernel`` keys the compiled kernel on what that specialisation
depends on (``arg_signature``), computed in a few operations per argument, and calls the
compiled kernel's launcher directly when it has seen the key; the first call of a key goes
through Triton (which compiles, or finds its own cache). Under the interpreter (CPU) it is
``kernel[grid](*args)``. Triton's launch hooks (``knobs.runtime.launch_enter_hook``, profilers
such as proton) are not called on the cached path.
"""
from __future__ import annotations

import inspect

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

_UNCACHED = object()  # an argument whose signature cannot be keyed cheaply: the launch goes through Triton
_current_device = getattr(torch._C, "_cuda_getDevice", None)  # None in a torch built without CUDA


def arg_signature(value):
    """What Triton's specialisation of a non-constexpr argument depends on, as a hashable value:
    equal signatures mean equal specialisations (tested against Triton's own). ``_UNCACHED`` for a
    type this does not key (tuples of tensors, descriptors)."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if kind is int:  # i32 / i64 / u64 by range; 1 becomes a constexpr; multiples of 16 are marked
        return value == 1, value % 16 == 0, -0x80000000 <= value < 0x80000000, value >= 1 << 63
    if kind is float:
        return float
    if value is None or kind is bool or kind is str:
        return value
    return _UNCACHED


# id(kernel) -> (names of its runtime parameters, positions of its constexpr parameters)
_parameters: dict[int, tuple[frozenset[str], tuple[int, ...]]] = {}
# key -> (compiled kernel, the values of the parameters after the positional ones, in order)
_compiled: dict[tuple, tuple] = {}


def _describe(kernel) -> tuple[frozenset[str], tuple[int, ...]]:
    """(names of ``kernel``'s runtime parameters, positions of its constexpr parameters), kept."""
    parameters = inspect.signature(kernel.fn).parameters.values()
    constexpr = [p.annotation is tl.constexpr or "constexpr" in str(p.annotation) for p in parameters]
    found = _parameters[id(kernel)] = (frozenset(p.name for p, const in zip(parameters, constexpr) if not const),
                                       tuple(i for i, const in enumerate(constexpr) if const))
    return found


def _refuse_runtime_keywords(kernel, runtime_names: frozenset[str], kwargs: dict) -> None:
    """A runtime (non-constexpr) argument passed by keyword is refused: the key holds keyword values
    as they are, so a tensor there would key every call apart and stay referenced."""
    runtime = [name for name in kwargs if name in runtime_names]
    if runtime:
        raise TypeError(f"launch: pass {', '.join(runtime)} of {kernel.fn.__name__} positionally "
                        f"(keywords are for constexprs and launch options)")


def launch_kernel(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` (``grid`` a tuple of 1 to 3 ints; ``kwargs`` constexprs and
    launch options such as ``num_warps``, hashable), through the compiled kernel's launcher after
    the first call with the same launch signature on the current device and stream."""
    runtime_names, positions = _parameters.get(id(kernel)) or _describe(kernel)
    if type(kernel) is not JITFunction or _current_device is None:  # the interpreter's function; no CUDA
        _refuse_runtime_keywords(kernel, runtime_names, kwargs)
        kernel[grid](*args, **kwargs)
        return
    signature = tuple(map(arg_signature, args))
    if _UNCACHED in signature:
        kernel[grid](*args, **kwargs)
        return
    device = _current_device()
    key = (id(kernel), device, tuple(kwargs.items()), signature,
           tuple(args[i] for i in positions if i < len(args)))
    entry = _compiled.get(key)
    if entry is None:  # (a hit has the keywords of a checked miss: they are part of the key)
        _refuse_runtime_keywords(kernel, runtime_names, kwargs)
        compiled = kernel[grid](*args, **kwargs)
        if compiled is None:  # Triton launched nothing it could hand back (a stubbed run, in benchmarks)
            return
        rest = kernel.params[len(args):]
        _compiled[key] = (compiled, tuple(kwargs[p.name] if p.name in kwargs else p.default for p in rest))
        return
    compiled, tail = entry
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_y, grid_z, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)
