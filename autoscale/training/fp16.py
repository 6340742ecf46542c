"""fp16 on a CPU without fp16 matrix units: autocast's numerics, products at fp32 speed.

Without AVX512-FP16 or AMX-FP16, torch's CPU kernels for fp16 matrix products are scalar loops,
many times slower than fp32's BLAS on a large model (``experiments/results/fp16_speed.md``).
Their arithmetic is simple: every product and sum in fp32, one rounding to fp16 at the end, the
contract of a GPU's tensor cores too. :class:`Fp16EmulationMode` keeps
``torch.autocast(dtype=torch.float16)`` and autograd exactly as they are, so every tensor the
native path holds in fp16 (activations, the gradients flowing back through them, the fp16 weight
copies) is still an fp16 tensor; it only swaps the kernel of the matrix-product ops of autocast's
lower-precision list, once their fp16 arguments reach the CPU: upcast the fp16 inputs, run the
fp32 kernel (BLAS), round the outputs to fp16 (overflow to inf, subnormals, zero from half the
smallest subnormal, 2^-25, down). Forward and backward, since backward calls the same ops.

What cannot agree with the native kernels: the order of the fp32 sums (BLAS blocks them
differently; results differ in the last fp16 bit now and then), and the fp16 roundings that a
fused native kernel makes inside itself (the CPU flash-attention kernel rounds its softmax
probabilities to fp16 before multiplying them with V; emulated, they stay fp32).
``experiments/benchmarks/fp16_emulation.py`` measures how far this moves overflow thresholds,
skips and precision loss (``experiments/results/fp16_emulation.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autoscale.errors import unknown_name
from autoscale.training.spec import FP16_PATHS

__all__ = [
    "FP16_PATHS",
    "Fp16EmulationMode",
    "AUTO_MIN_MACS",
    "matmul_macs",
    "native_fp16_matmul",
    "resolve_fp16_path",
    "emulated_ops",
]

#: Upcasts at least this large reuse a kept buffer (see :class:`Fp16EmulationMode`).
SCRATCH_MIN_BYTES = 16 << 20
#: At most this many such buffers are kept.
SCRATCH_BUFFERS = 16
#: ``auto`` emulates only from this many matrix multiply-adds per micro-batch (see
#: :func:`resolve_fp16_path`).
AUTO_MIN_MACS = 2 << 20


@functools.cache
def emulated_ops() -> dict[Any, tuple[int, ...]]:
    """The aten ops the emulation computes in fp32, each with the outputs that stay fp32.

    These are what autocast's CPU and CUDA lower-precision ops (``mm``, ``addmm``, ``bmm``,
    ``baddbmm``, ``addbmm``, ``linear``, ``matmul``, ``conv*``, ``prelu``' s products,
    ``scaled_dot_product_attention``...) reach at the aten level, forward and backward, once
    composite ops have decomposed. Every other op (elementwise, reductions, the fp32 ops autocast
    upcasts such as ``cross_entropy``) runs natively on its fp16 or fp32 tensors, as under native
    autocast.
    """
    aten = torch.ops.aten
    names = {
        "mm": (),
        "addmm": (),
        "_addmm_activation": (),
        "bmm": (),
        "baddbmm": (),
        "addbmm": (),
        "mv": (),
        "addmv": (),
        "dot": (),
        "vdot": (),
        "convolution": (),
        "convolution_backward": (),
        "conv_tbc": (),
        "conv_tbc_backward": (),
        # (output, logsumexp): the logsumexp is fp32 on the native path too
        "_scaled_dot_product_flash_attention_for_cpu": (1,),
        "_scaled_dot_product_flash_attention_for_cpu_backward": (),
        # Not a product: the native fp16 kernel computes in fp32 and rounds once, like this, but
        # far slower (GPT-2's tanh-GELU takes x**3); tests check every fp16 input bit for bit.
        "pow.Tensor_Scalar": (),
    }
    ops = {}
    for name, keep in names.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            ops[op] = keep
    return ops


def _is_cpu_half(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float16 and x.device.type == "cpu"


class Fp16EmulationMode(TorchDispatchMode):
    """Computes fp16 matrix products on the CPU in fp32, rounding their results to fp16.

    Use it around the forward and the backward of an fp16 autocast step (and around evaluation)::

        emulation = Fp16EmulationMode()  # keep it: it reuses its buffers from step to step
        with emulation:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean()
            scaler.scale(loss).backward()

    Only ops of :func:`emulated_ops` with an fp16 CPU argument change: those arguments are
    upcast to fp32, the op runs in fp32, and its outputs are rounded back to fp16. Ops on other
    devices (CUDA's tensor cores already work this way), other dtypes and every other op pass
    through unchanged. A mix of fp16 and fp32 operands that the native op would refuse (outside
    autocast) is passed through so that it is refused the same way; the flash-attention ops'
    fp32 logsumexp is the one expected fp32 operand.

    Upcasts of 16 MiB and more (GPT-2's tied embedding used as the output layer) go into fp32
    buffers kept from one use to the next: a fresh buffer that size costs more in page faults
    than the copy itself. The buffers are scratch, dead once the op returns; at most
    :data:`SCRATCH_BUFFERS` are kept (all are dropped when a new one would exceed it).

    Modes stack: a mode entered inside this one (such as
    :class:`~autoscale.training.instruments.BackwardAmaxMode` around ``backward()``) sees each
    emulated op once, with its fp16 result, as it would see the native op's.

    Attributes:
        calls: Ops computed in fp32 so far (for tests and reports).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._ops = emulated_ops()
        self._scratch: dict[tuple, torch.Tensor] = {}

    @property
    def scratch_buffers(self) -> int:
        """Output buffers kept for reuse between steps (at most ``SCRATCH_BUFFERS``)."""
        return len(self._scratch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keep = self._ops.get(func)
        if keep is None:
            return func(*args, **kwargs)
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(_is_cpu_half(t) for t in flat) or not _same_kind(func, flat):
            return func(*args, **kwargs)
        self.calls += 1
        slot = iter(range(len(flat)))
        up = functools.partial(self._upcast, slot=slot)
        out = func(*tree_map(up, args), **tree_map(up, kwargs))
        if isinstance(out, torch.Tensor):
            return out.half()
        return type(out)(
            o.half()
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and i not in keep
            else o
            for i, o in enumerate(out)
        )

    def _upcast(self, x: Any, slot) -> Any:
        if not _is_cpu_half(x):
            return x
        if x.numel() * 4 < SCRATCH_MIN_BYTES:
            return x.float()
        key = (x.shape, x.stride(), next(slot))
        buf = self._scratch.get(key)
        if buf is None:
            if len(self._scratch) >= SCRATCH_BUFFERS:
                self._scratch.clear()
            buf = self._scratch[key] = _empty_like_layout(x)
        return buf.copy_(x)


def _empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor of ``x``'s shape and, when ``x`` is a permutation of a dense tensor, its
    strides (BLAS then reads it transposed, as it would ``x``); else contiguous."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    dense = x.permute(order)
    if not dense.is_contiguous():
        return torch.empty(x.shape, dtype=torch.float32)
    inverse = sorted(range(x.dim()), key=lambda d: order[d])
    return torch.empty(dense.shape, dtype=torch.float32).permute(inverse)


def _same_kind(func, tensors: list[torch.Tensor]) -> bool:
    """Whether the native op would accept these operands: floating ones all fp16 on the CPU
    (the flash-attention backward also takes its fp32 logsumexp)."""
    allowed = 1 if "flash_attention" in func.__name__ else 0
    others = sum(1 for t in tensors if t.is_floating_point() and not _is_cpu_half(t))
    return others <= allowed


def native_fp16_matmul() -> bool:
    """Whether this CPU has the fp16 matrix instructions (AVX512-FP16 or AMX-FP16) through which
    torch's fp16 products run at speed (oneDNN); without them they are scalar loops."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_fp16") or caps.get("amx_fp16"))


def matmul_macs(model: torch.nn.Module, samples: int) -> int:
    """Multiply-adds of the matrix products of one forward and backward, estimated as
    3 (forward, input gradient, weight gradient) x weight-matrix elements x ``samples`` (tokens
    of a micro-batch for a language model, examples for a classifier)."""
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p.requires_grad)
    return 3 * weights * samples


def resolve_fp16_path(
    requested: str, device: torch.device, macs: int | None = None
) -> tuple[str, str]:
    """The fp16 path a run takes, ``"native"`` or ``"emulated"``, and why, in words.

    ``auto`` emulates on a CPU without fp16 matrix instructions, unless the model's products
    are too small to pay for the emulation's per-op cost (a Python call for every op of the
    step, some microseconds each): under :data:`AUTO_MIN_MACS` multiply-adds per micro-batch
    (the ``mlp`` preset at batch 4 is under it and runs faster native:
    ``experiments/results/fp16_speed.md``).

    Args:
        requested: ``auto``, ``native`` or ``emulated`` (``WorkloadSpec.fp16``).
        device: Where the run trains.
        macs: :func:`matmul_macs` of the workload; None: assume large.
    """
    if requested not in FP16_PATHS:
        raise unknown_name("fp16 path", str(requested), FP16_PATHS, "autoscale run --help")
    if device.type != "cpu":
        return "native", f"{device.type} computes fp16 products natively (fp32 accumulation)"
    if requested != "auto":
        return requested, f"asked for (fp16: {requested})"
    if native_fp16_matmul():
        return "native", "this CPU has fp16 matrix instructions (AVX512-FP16/AMX-FP16)"
    if macs is not None and macs < AUTO_MIN_MACS:
        return "native", (
            f"no fp16 matrix instructions, but the products are small ({macs / 1e6:.1f}M "
            f"multiply-adds per micro-batch < {AUTO_MIN_MACS / 1e6:.1f}M): the emulation's "
            "per-op cost would exceed its saving"
        )
    size = "" if macs is None else f" ({macs / 1e6:.0f}M multiply-adds per micro-batch)"
    return "emulated", (
        f"no fp16 matrix instructions: torch's fp16 products are scalar loops; fp32 products "
        f"rounded to fp16 are faster{size}"
    )
