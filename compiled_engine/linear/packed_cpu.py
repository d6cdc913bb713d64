"""The fp32 weights of the compiled CPU path, held once, in oneDNN's packed layout.

For more than a few rows, oneDNN's linear on a weight reordered once into its blocked layout runs
the decoder layer's products faster than F.linear on the CPU (figures in docs/benchmarks.md,
"Compiled path on CPU, second round"). For one to four rows (decode), a native kernel reads the
same packed memory (kernels/blocked_gemv.c) at close to memory bandwidth. So the packed copy is
the only copy: the dense [out, in] weight is released once it is packed.

On AVX2 machines oneDNN stores an fp32 weight as blocks of B output rows, each input-major:
`packed[o // B, i, o % B] = weight[o, i]`. B is oneDNN's choice, per shape and per machine (16
and 64 were seen for different shapes on one CPU model; docs/benchmarks.md). `pack` reads the
packed memory through a tensor of that shape ("the blocked view") for each width the native
kernel takes (BLOCK_WIDTHS) and keeps the view whose elements equal the weight's, one for one;
the kernel reads B from the view's shape. Where no width reads back the weight (another layout,
padding) or the kernel cannot be built, the weight stays dense and the packed copy is kept beside
it, as two copies, with one warning saying why.

oneDNN is given only a few row counts (`onednn_pieces`): it keeps a primitive, with a buffer of
its output's size, for every row count it sees.

Inductor only uses oneDNN's kernels when it freezes the weights into constants, which would give
every layer its own compiled graph, so compiled code calls them through the opaque operator
`compiled_engine::packed_linear`, which finds the packed tensor of the weight it is given.

The kernel modules, built from the plain model's and installed by the kernel walk
(linear/install.py, picked by linear/table.py): `CpuLinear`, a product over its packed weight,
and `BlockedEmbedding`, the lookup of a tied embedding whose table became the head's packed copy.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from compiled_engine.model.layers import Linear
from compiled_engine.native_build import KernelBuildError, TorchOperatorLibrary

logger = logging.getLogger(__name__)

# The widths (output rows per block) that the native kernel takes (kernels/blocked_gemv.c:
# multiples of LANES up to MAX_BLOCK), widest first: the candidates for oneDNN's choice.
BLOCK_WIDTHS = (64, 56, 48, 40, 32, 24, 16, 8)
GEMV_MAX_ROWS = 4  # rows up to which the native kernel runs the product (kernels/blocked_gemv.c: MAX_ROWS)

GemvOperator = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_KERNELS = Path(__file__).with_name("kernels")
BLOCKED_GEMV_OPERATOR = TorchOperatorLibrary(
    _KERNELS / "blocked_gemv_op.cpp", _KERNELS / "blocked_gemv.c", "native product with packed fp32 weights"
)

# A dense weight kept beside its packed copy (the two-copy fallback) -> that copy.
_beside: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The address of a blocked view's memory -> the oneDNN tensor that owns it. Keyed by address, not
# by tensor, because compiled code may hand the operator another tensor object over the same memory.
_owners: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


@cache
def blocked_gemv_operator() -> torch._ops.OpOverload | None:
    """`compiled_engine::blocked_gemv_f32`, built once per machine, or None (with one warning)
    when it cannot be built: weights are then packed as a second copy beside the dense one."""
    try:
        BLOCKED_GEMV_OPERATOR.load()
    except KernelBuildError as error:
        logger.warning("packed CPU weights keep a dense copy beside them (twice the memory), because %s", error)
        return None
    torch.library.register_fake("compiled_engine::blocked_gemv_f32")(_out_shaped)
    op: torch._ops.OpOverload = torch.ops.compiled_engine.blocked_gemv_f32.default
    return op if agrees_with_f_linear(op) else None


def agrees_with_f_linear(op: GemvOperator) -> bool:
    """Whether the kernel `op` gives F.linear's products at every block width, on a small random
    weight; if not, one warning says where (a miscompiled kernel then costs memory, not outputs)."""
    wrong = _wrong_widths(op)
    if wrong:
        logger.warning(
            "packed CPU weights keep a dense copy beside them (twice the memory), because the native kernel "
            "disagrees with F.linear at block widths %s",
            wrong,
        )
    return not wrong


def block(weight: torch.Tensor, width: int) -> torch.Tensor:
    """`weight` [out, in] laid out as the blocked view [out / width, in, width] (a new tensor)."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // width, width, in_features).transpose(1, 2).contiguous()


def _wrong_widths(op: GemvOperator) -> list[int]:
    """The widths at which the kernel's products differ from F.linear's on a small random weight."""
    generator = torch.Generator().manual_seed(0)
    wrong = []
    for width in BLOCK_WIDTHS:
        weight = torch.randn(2 * width, 24, generator=generator)
        bias = torch.randn(2 * width, generator=generator)
        x = torch.randn(GEMV_MAX_ROWS, 24, generator=generator)
        with torch.inference_mode():
            for rows in range(1, GEMV_MAX_ROWS + 1):
                if not torch.allclose(
                    op(x[:rows], block(weight, width), bias), F.linear(x[:rows], weight, bias), 1e-4, 1e-4
                ):
                    wrong.append(width)
                    break
    return wrong


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack `weight` ([out, in], fp32, CPU) for oneDNN. Returns what its module should hold from
    now on: the blocked view [out / B, in, B] of the packed memory (the one copy: drop `weight`),
    or `weight` itself, with the packed copy kept beside it, where no view can be used."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} for oneDNN")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    width_or_reason = (
        blocked_width(weight, packed) if blocked_gemv_operator() is not None else "the native kernel is not built"
    )
    if isinstance(width_or_reason, str):
        _warn_two_copies(width_or_reason)
        _beside[weight] = packed
        return weight
    return _blocked_view(packed, weight.shape[0], weight.shape[1], width_or_reason)


def blocked_width(weight: torch.Tensor, packed: torch.Tensor) -> int | str:
    """The block width B at which oneDNN's packed memory reads back as `weight` through the view
    [out / B, in, B], or why no width the kernel takes does."""
    out_features, in_features = weight.shape
    widths = [width for width in BLOCK_WIDTHS if out_features % width == 0]
    if not widths:
        return f"{out_features} output rows are not whole blocks of any width in {BLOCK_WIDTHS}"
    if torch.ops.mkldnn._nbytes(packed) != weight.numel() * 4:
        return "oneDNN padded the packed weight"
    dense, memory = weight.detach(), _memory(packed, weight.numel())
    for width in widths:
        view = memory.view(out_features // width, in_features, width)
        if torch.equal(view, dense.view(out_features // width, width, in_features).transpose(1, 2)):
            return width
    return f"oneDNN chose a layout on this CPU that is not [out / B, in, B] for B in {tuple(widths)}"


def _memory(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat CPU tensor over the memory of the oneDNN tensor `packed`, which lives as long as any
    tensor over that memory (the buffer object holds it)."""
    memory = (ctypes.c_float * numel).from_address(torch.ops.mkldnn.data_ptr(packed))
    memory._owner = packed  # type: ignore[attr-defined]  # ctypes arrays take attributes
    return torch.frombuffer(memory, dtype=torch.float32)


def _blocked_view(packed: torch.Tensor, out_features: int, in_features: int, width: int) -> torch.Tensor:
    """The blocked view [out / width, in, width] of `packed`, known to the operator as its own."""
    _owners[torch.ops.mkldnn.data_ptr(packed)] = packed
    return _memory(packed, out_features * in_features).view(out_features // width, in_features, width)


_warned: set[str] = set()


def _warn_two_copies(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("a packed CPU weight keeps its dense copy beside it (twice the memory), because %s", reason)


def is_blocked(weight: torch.Tensor) -> bool:
    """Whether `weight` is a blocked view over a packed weight (the one-copy layout)."""
    return weight.dim() == 3 and weight.data_ptr() in _owners


def has_packed_copy(weight: torch.Tensor) -> bool:
    """Whether the dense `weight` has a packed copy beside it (the two-copy fallback)."""
    return weight in _beside


def packed_bytes() -> int:
    """Bytes of the packed copies kept beside dense weights (zero when every packed weight is its
    own one copy)."""
    return sum(torch.ops.mkldnn._nbytes(packed) for packed in list(_beside.values()))


def unblocked(blocked: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] weight of a blocked view (a new tensor): the reference's weight."""
    return blocked.transpose(1, 2).reshape(blocked.shape[0] * blocked.shape[2], blocked.shape[1])


def blocked_rows(blocked: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the weight a blocked view holds: the lookup of an embedding table that is
    also the (tied) head's packed weight."""
    width = blocked.shape[2]
    return blocked[rows // width, :, rows % width]


def out_features(weight: torch.Tensor) -> int:
    return weight.shape[0] * weight.shape[2] if weight.dim() == 3 else weight.shape[0]


def _out_shaped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features(weight))


torch.library.define("compiled_engine::packed_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


# oneDNN builds (JIT-compiles, about 1 ms) and caches a primitive for every row count it is
# given, up to 1024 of them, and each keeps a buffer of its output's size (rows x out x 4 bytes):
# a process that saw every row count from 5 to 600 grew by 1.4 GB (docs/benchmarks.md). So it is
# given few row counts: the product's rows padded up to the next of ONEDNN_ROWS (at most an
# eighth more rows past 64), in pieces of at most `largest_piece` rows, so that every primitive's
# buffer stays under ONEDNN_PIECE_BYTES. The memory this can take is bounded: for the default
# model about 30 MB for the layers and 25 MB for the head, once every row count has been seen.
ONEDNN_ROWS = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
ONEDNN_PIECE_BYTES = 8 << 20


def largest_piece(out_features: int) -> int:
    """The most rows one oneDNN call of a product with `out_features` outputs takes."""
    fitting = [rows for rows in ONEDNN_ROWS if rows * out_features * 4 <= ONEDNN_PIECE_BYTES]
    return fitting[-1] if fitting else ONEDNN_ROWS[0]


def onednn_pieces(rows: int, out_features: int) -> list[tuple[int, int]]:
    """(rows, rows padded) of each call that a product of `rows` rows makes, in order. A last
    piece of at most GEMV_MAX_ROWS rows is not padded: the native kernel runs it."""
    largest = largest_piece(out_features)
    pieces = []
    while rows > largest:
        pieces.append((largest, largest))
        rows -= largest
    if rows > GEMV_MAX_ROWS:
        pieces.append((rows, next(padded for padded in ONEDNN_ROWS if padded >= rows)))
    elif rows > 0:
        pieces.append((rows, rows))
    return pieces


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T + bias through oneDNN's packed W, in the pieces of `onednn_pieces` (`blocked`: W's
    blocked view, for the native kernel's piece; None: oneDNN runs that piece too, padded)."""
    gemv = blocked_gemv_operator() if blocked is not None else None

    def product(rows: torch.Tensor, padded: int) -> torch.Tensor:
        if padded <= GEMV_MAX_ROWS and gemv is not None:
            return gemv(rows, blocked, bias)
        padded = max(padded, ONEDNN_ROWS[0])
        if padded != rows.shape[0]:
            rows = F.pad(rows, (0, 0, 0, padded - rows.shape[0]))
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")

    out_features = packed.size(0)
    pieces = onednn_pieces(x.shape[0], out_features)
    if len(pieces) == 1:
        size, padded = pieces[0]
        y = product(x, padded)
        return y if y.shape[0] == size else y[:size]
    out = x.new_empty(x.shape[0], out_features)
    start = 0
    for size, padded in pieces:
        out[start : start + size] = product(x[start : start + size], padded)[:size]
        start += size
    return out


@torch.library.impl("compiled_engine::packed_linear", "CompositeExplicitAutograd")
def _packed_linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    if weight.dim() == 3:  # a blocked view: up to four rows native, more through oneDNN (in pieces)
        owner = _owners.get(weight.data_ptr())
        if owner is None or rows == 0:  # not a view this module made: the reference
            return F.linear(x, unblocked(weight), bias)
        return _onednn_linear(x, owner, bias, weight)
    packed = _beside.get(weight)
    if packed is None or rows == 0:  # not packed (or packed for another tensor): the plain product
        return F.linear(x, weight, bias)
    return _onednn_linear(x, packed, bias, None)


torch.library.register_fake("compiled_engine::packed_linear")(_out_shaped)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) for 2-D x, where `weight` is W as a blocked view (`pack`'s one copy)
    or W dense, through its packed copy when it has one."""
    return torch.ops.compiled_engine.packed_linear(x, weight, bias)


class CpuLinear(Linear):
    """The packed CPU kernel of a product (compiled, fp32 on the CPU). With its weight packed as
    one copy (`blocked`): up to four rows through the native kernel, more through oneDNN, both
    reading that copy. Otherwise one row as a multiply-and-sum (compiled only: eager it would
    materialise the products), several rows through the weight's packed copy when it has one."""

    blocked: torch.Tensor | None  # with it, `weight` is gone
    packed: bool = False  # a packed copy beside the dense weight (the two-copy fallback)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("blocked", None)

    @classmethod
    def from_linear(cls, linear: Linear) -> CpuLinear:
        """The kernel for `linear`'s product, over the same weight and bias tensors (a tied head
        keeps sharing its weight with the embedding): packed where oneDNN can run it, as its one
        copy when `pack` gives a blocked view (the weight then goes), else beside the weight."""
        out_features, in_features = linear.weight.shape
        with torch.device("meta"):
            kernel = cls(in_features, out_features, bias=linear.bias is not None)
        kernel.weight = linear.weight
        kernel.bias = linear.bias
        if can_pack(linear.weight):
            held = pack(linear.weight)
            if held.dim() == 3:
                del kernel.weight
                kernel.blocked = held
            else:
                kernel.packed = True
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            if x.shape[0] == 1:
                y: torch.Tensor = torch.ops.compiled_engine.blocked_gemv_f32(x, self.blocked, self.bias)
                return y
            return packed_linear(x, self.blocked, self.bias)
        if x.shape[0] == 1 and torch.compiler.is_compiling():
            y = (x[:, None, :] * self.weight[None]).sum(-1)
            return y + self.bias if self.bias is not None else y
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return "packed, one copy" if self.blocked is not None else "packed beside dense" if self.packed else "dense"


class BlockedEmbedding(nn.Module):
    """The embedding of a tied head whose table became the head's packed copy: a lookup reads its
    rows from the blocked view, so the dense table can go."""

    blocked: torch.Tensor

    def __init__(self, blocked: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = out_features(blocked), blocked.shape[1]
        self.register_buffer("blocked", blocked)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return blocked_rows(self.blocked, input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the head's packed copy"
