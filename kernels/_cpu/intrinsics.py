"""Small LLVM intrinsics callable from njit code: a prefetch hint (:func:`_prefetch`,
:func:`_prefetch_row`), count trailing zeros (:func:`_ctz`), NaN-propagating max/min
(:func:`_fmax`, :func:`_fmin`), a branch-free select (:func:`_select`) and an integer-to-float
bitcast (:func:`_as_float`).

Kernels in other modules compile this one's code in, and numba's disk cache does not see
edits here: see the package docstring.
"""

from __future__ import annotations

from llvmlite import binding as _llvm
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

# LLVM >= 15 names the intrinsic by opaque pointer type.
_PREFETCH_NAME = "llvm.prefetch.p0" if _llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, arr, row, col):
    """Hint the CPU to fetch the cache line holding ``arr[row, col]`` (llvm.prefetch, read)."""
    if not isinstance(arr, types.Array) or arr.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = [context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 2)]
        ptr = cgutils.get_item_pointer2(
            context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
            strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout, inds=inds,
            wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, row, col), codegen


@njit(inline="always")
def _prefetch_row(X, r, n, line):
    for c in range(0, n, line):
        _prefetch(X, r, c)


@intrinsic
def _ctz(typingctx, x):
    """Index of the lowest set bit of a nonzero 32-bit word (llvm.cttz)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        word = context.cast(builder, args[0], sig.args[0], types.uint32)
        fnty = ir.FunctionType(i32, [i32, ir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i32")
        return builder.zext(builder.call(fn, [word, ir.IntType(1)(1)]), ir.IntType(64))

    return types.int64(x), codegen


def _fp_intrinsic(name):
    """Two-operand LLVM floating-point intrinsic (``llvm.<name>.f32/f64``), callable from njit
    code."""

    @intrinsic
    def fn(typingctx, a, b):
        if not isinstance(a, types.Float) or a != b:
            return None

        def codegen(context, builder, sig, args):
            lty = args[0].type
            suffix = "f32" if lty == ir.FloatType() else "f64"
            callee = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(lty, [lty, lty]), f"llvm.{name}.{suffix}")
            return builder.call(callee, args)

        return a(a, b), codegen

    return fn


# NaN-propagating max/min (IEEE 754-2019 maximum/minimum, as torch's amax/amin). Written as
# `o = x if x > o else o`, the update is a conditional store, which LLVM vectorizes into masked
# stores (vmaskmovps): measured 1.5x slower than the sum kernel on this Zen 3 machine. These
# intrinsics vectorize into plain vmaxps/vminps plus NaN fixups.
_fmax = _fp_intrinsic("maximum")
_fmin = _fp_intrinsic("minimum")


@intrinsic
def _select(typingctx, c, a, b):
    """``a if c else b`` as one LLVM select (no branch, so loops around it vectorize)."""
    if not isinstance(c, types.Boolean) or a != b:
        return None

    def codegen(context, builder, sig, args):
        return builder.select(args[0], args[1], args[2])

    return a(c, a, b), codegen


@intrinsic
def _as_float(typingctx, bits):
    """The float32 / float64 whose IEEE bits are the int32 / int64 ``bits`` (a bitcast)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth not in (32, 64):
        return None
    fty = types.float32 if bits.bitwidth == 32 else types.float64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(fty))

    return fty(bits), codegen
