"""Run-time compilation and launching of the CUDA kernels in this directory.

One memoized loader keyed by an explicit :class:`Variant`: (kernel family, activation dtype,
head_dim, KV quantization, query heads per CTA). The page size, group size, sink/local window
and all lengths are launch arguments, so one binary serves every cache geometry. Sources are
compiled by NVRTC through ``cupy.RawModule`` with ``-I`` pointing here and a ``#line``
directive naming the file, so compile errors point at ``kernels/<file>.cu:<line>``.

Launches go to torch's current stream (``cupy.cuda.ExternalStream``); tensors are passed by
``data_ptr`` as ``numpy.uint64`` and scalars as ``numpy.int32`` / ``numpy.int64`` /
``numpy.float32``, matching the C signatures exactly. CuPy is imported lazily so the package
imports on machines without it.

``python -m lserve.kernels.loader --nvcc-check`` compiles every variant with ``nvcc`` (no GPU
needed) and prints the register / shared-memory report.
"""

from __future__ import annotations

import functools
import hashlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent

FAMILIES = {
    "kv_write": ("kv_write.cu", ("ls_kv_write",)),
    "decode": ("decode.cu", ("ls_decode",)),  # CUDA cores: any dtype, quantized pools
    "decode_tc": ("decode_tc.cu", ("ls_decode_tc",)),  # tensor cores: bf16/fp16 pools
    "merge": ("merge.cu", ("ls_decode_merge",)),
    "selector": ("selector.cu", ("ls_page_scores", "ls_page_topk")),
    "selector_tc": ("selector_tc.cu", ("ls_page_scores_tc",)),  # page scores on tensor cores
    "prefill": ("prefill.cu", ("ls_prefill",)),
    "bsp_prefill": ("bsp_prefill.cu", ("ls_bsp_prefill",)),  # block-sparse prefill over paged KV
    "bsp_prefill_wg": ("bsp_prefill_wg.cu", ("ls_bsp_prefill_wg",)),  # the same on Hopper wgmma (sm_90a)
    "bsp_prefill_ws": ("bsp_prefill_ws.cu", ("ls_bsp_prefill_ws",)),  # warp-specialized wgmma (sm_90a, D 128)
    "bsp_prefill_ws4": ("bsp_prefill_ws4.cu", ("ls_bsp_prefill_ws4",)),  # v4: 128 keys a step, Q in smem
    "bsp_prefill_v5": ("bsp_prefill_v5.cu", ("ls_bsp_prefill_v5",)),  # v5: v3 with pool K/V by TMA (tensor_map.py)
    "prefill_estimate": ("prefill_estimate.cu", ("ls_antidiag_mass", "ls_antidiag_mass2")),  # block masses of a prefill chunk
    "prefill_cut": ("prefill_cut.cu", ("ls_mass_rank", "ls_mass_keep")),  # a prefill chunk's block list from its masses
    "page_copy": ("page_copy.cu", ("ls_page_copy",)),  # the host KV tier's page moves, one launch a batch
    "stage": ("stage.cu", ("ls_stage_picks",)),  # the host KV tier: a selection's picks on the host, staged
    "fused": ("fused.cu", ("ls_add_rmsnorm", "ls_add_rmsnorm_v8", "ls_rope", "ls_rope_v8", "ls_silu_mul",
                           "ls_silu_mul_v8", "ls_argmax", "ls_gemv")),  # elementwise steps, argmax, GEMV
}
TENSOR_CORE_FAMILIES = ("prefill", "bsp_prefill", "bsp_prefill_wg", "bsp_prefill_ws", "bsp_prefill_ws4",
                        "bsp_prefill_v5", "decode_tc", "selector_tc")
# Families built for sm_90a exactly (architecture-specific instructions: wgmma); NVRTC is asked for
# that target directly, since CuPy's RawModule picks the plain compute capability.
SM90A_FAMILIES = ("bsp_prefill_wg", "bsp_prefill_ws", "bsp_prefill_ws4", "bsp_prefill_v5")
# Families that take a TierLayer pointer and have an LS_TIER build (kernels/tier.cuh).
TIER_FAMILIES = ("kv_write", "decode", "decode_tc")
DTYPES = {"bf16": 0, "fp16": 1, "fp32": 2}
_TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
LOG2E = 1.4426950408889634  # kernels take softmax scales in base 2 (exp2)
QUANTS = {"none": 0, "int8": 1, "int4": 2}
HEAD_DIMS = (64, 128, 256)
BASE_OPTIONS = ("-std=c++17",)


def dtype_name(dtype) -> str | None:
    """The :data:`DTYPES` name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``), None for one no
    kernel takes (read from its name, so this module does not import torch)."""
    return _TORCH_DTYPES.get(str(dtype))


class KernelError(RuntimeError):
    """A kernel cannot be built or launched for these inputs."""


@dataclass(frozen=True)
class Variant:
    """What a compiled module is specialized on.

    Parameters
    ----------
    family : str
        ``"kv_write"``, ``"decode"``, ``"decode_tc"``, ``"merge"``, ``"selector"``,
        ``"selector_tc"``, ``"prefill"`` or ``"fused"``.
    dtype : str
        ``"bf16"``, ``"fp16"`` or ``"fp32"`` (tensor-core families: 16-bit only).
    head_dim : int
        64, 128 or 256.
    kv_quant : str
        ``"none"``, ``"int8"`` or ``"int4"`` (families that touch the pools; else ``"none"``).
    gq : int
        Query heads per CTA (decode, merge, selector; else 1).
    tuning : tuple of str
        Extra ``NAME=VALUE`` defines of a family's tile shape (tuning sandboxes, e.g.
        ``("LS_BSP_MT=1",)``); empty = the shape the source ships with.
    tier : bool
        Dense pages through the host KV tier's slot table (``-DLS_TIER=1``, ``kernels/tier.cuh``;
        the :data:`TIER_FAMILIES` only).
    """

    family: str
    dtype: str
    head_dim: int
    kv_quant: str = "none"
    gq: int = 1
    tuning: tuple[str, ...] = ()
    tier: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise KernelError(f"unknown kernel family {self.family!r}")
        if self.dtype not in DTYPES:
            raise KernelError(f"unsupported dtype {self.dtype!r} (bf16, fp16, fp32)")
        if self.head_dim not in HEAD_DIMS:
            raise KernelError(f"unsupported head_dim {self.head_dim} (supported: {HEAD_DIMS})")
        if self.kv_quant not in QUANTS:
            raise KernelError(f"unsupported kv_quant {self.kv_quant!r}")
        if self.family in TENSOR_CORE_FAMILIES and self.dtype == "fp32":
            raise KernelError(f"the {self.family} kernel runs on tensor cores: bf16/fp16 only")
        if self.tier and self.family not in TIER_FAMILIES:
            raise KernelError(f"the {self.family} kernel does not read dense pages through the host KV tier")
        if self.family == "decode_tc" and self.kv_quant != "none":
            raise KernelError("decode_tc reads unquantized pools; quantized ones use the decode family")
        if not 1 <= self.gq <= 8:
            raise KernelError(f"query heads per CTA must be in 1..8, got {self.gq}")

    def defines(self) -> tuple[str, ...]:
        """The ``-D`` options of this variant."""
        return (f"-DLS_DTYPE={DTYPES[self.dtype]}", f"-DLS_HEAD_DIM={self.head_dim}",
                f"-DLS_QUANT={QUANTS[self.kv_quant]}", f"-DLS_GQ={self.gq}") + tuple(f"-D{t}" for t in self.tuning) \
            + (("-DLS_TIER=1",) if self.tier else ())


def source_of(family: str) -> str:
    """The source text of a family with a ``#line`` directive naming its file."""
    path = KERNEL_DIR / FAMILIES[family][0]
    return f'#line 1 "{path}"\n' + path.read_text()


def options_of(variant: Variant) -> tuple[str, ...]:
    """Compiler options (NVRTC and nvcc accept the same spellings)."""
    return BASE_OPTIONS + (f"-I{KERNEL_DIR}",) + variant.defines()


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def included_headers(family: str) -> list[Path]:
    """The headers of this directory a family's source includes, directly or through other headers
    (every ``#include "..."`` line, whatever ``#if`` surrounds it), sorted."""
    seen: set[Path] = set()
    todo = [KERNEL_DIR / FAMILIES[family][0]]
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_text()):
            path = KERNEL_DIR / name
            if path.is_file() and path not in seen:
                seen.add(path)
                todo.append(path)
    return sorted(seen)


def build_key(variant: Variant) -> str:
    """What names a variant's cached binary: a hash of its source, every header it includes (an edited
    header must not reuse a stale cubin) and its compiler options."""
    h = hashlib.sha1(source_of(variant.family).encode())
    for path in included_headers(variant.family):
        h.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    h.update(b"\0" + "\0".join(options_of(variant)).encode())
    return h.hexdigest()[:16]


def nvrtc_source(variant: Variant) -> str:
    """The source CuPy compiles for a family outside sm_90a: its text, then a comment naming
    :func:`build_key`. CuPy's own binary cache is keyed by the source text and the options, not by
    the headers ``-I`` finds, so an edited header (an upgrade) would otherwise run a stale binary."""
    return source_of(variant.family) + f"\n// lserve build key {build_key(variant)}\n"


def _load_sm90a(variant: Variant):
    """NVRTC with ``-arch=sm_90a`` (a cubin; else PTX for the driver to finish), written under
    ``$LSERVE_CACHE_DIR/kernels`` (named by :func:`build_key`) and loaded from there as a
    ``cupy.RawModule``."""
    import os

    import cupy
    from cupy_backends.cuda.libs import nvrtc

    cc = cupy.cuda.Device().compute_capability
    if cc != "90":
        raise KernelError(f"the {variant.family} kernel needs an sm_90 GPU (Hopper), this one is sm_{cc}")
    src, opts, key = source_of(variant.family), options_of(variant), build_key(variant)
    folder = Path(os.environ.get("LSERVE_CACHE_DIR", Path.home() / ".cache" / "lserve")) / "kernels"
    errors = []
    for arch, getter, suffix in (("sm_90a", "getCUBIN", "cubin"), ("compute_90a", "getPTX", "ptx")):
        path = folder / f"{variant.family}-{key}.{suffix}"
        if not path.is_file():
            prog = nvrtc.createProgram(src, f"{variant.family}.cu", (), ())
            try:
                nvrtc.compileProgram(prog, [*opts, f"-arch={arch}"])
                code = getattr(nvrtc, getter)(prog)
            except Exception as e:  # keep NVRTC's log, which names file:line
                errors.append(f"{arch}: {e}\n{nvrtc.getProgramLog(prog)}")
                continue
            finally:
                nvrtc.destroyProgram(prog)
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(code if isinstance(code, bytes) else code.encode())
            tmp.replace(path)
        return cupy.RawModule(path=str(path))
    raise KernelError(f"compiling {variant} for sm_90a:\n" + "\n".join(errors))


@functools.lru_cache(maxsize=512)
def load_module(variant: Variant):
    """Compile (once per process and variant) and return the ``cupy.RawModule``."""
    import cupy

    if variant.family in SM90A_FAMILIES:
        return _load_sm90a(variant)
    try:
        mod = cupy.RawModule(code=nvrtc_source(variant), options=options_of(variant), backend="nvrtc")
        mod.compile()
    except cupy.cuda.compiler.CompileException as e:  # keep NVRTC's log, which names file:line
        raise KernelError(f"compiling {variant}:\n{e}") from None
    return mod


@functools.lru_cache(maxsize=512)
def get_kernel(variant: Variant, name: str):
    """A ``cupy.RawKernel`` of a compiled variant."""
    if name not in FAMILIES[variant.family][1]:
        raise KernelError(f"{name} is not in family {variant.family}")
    return load_module(variant).get_function(name)


# -- launching ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _external_stream(handle: int, device: int):
    import cupy

    return cupy.cuda.ExternalStream(handle, device)


def torch_stream():
    """A cupy stream object wrapping torch's current CUDA stream (cached per handle)."""
    import torch

    dev = torch.cuda.current_device()
    return _external_stream(torch.cuda.current_stream(dev).cuda_stream, dev)


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0,
           pdl: bool = False) -> None:
    """Launch ``kernel`` on torch's current stream.

    ``args`` must already be numpy scalars (see :func:`ptr`, :func:`i32`, :func:`i64`, :func:`f32`).
    ``pdl=True`` launches it as a programmatic dependent of the previous kernel (``pdl.py``;
    only for kernels that call ``pdl_wait()``, and only where ``pdl.available``).
    """
    import cupy

    if min(grid) <= 0:
        return
    opt_in_shared(kernel, shared_mem)
    import torch

    dev = torch.cuda.current_device()
    with cupy.cuda.Device(dev):
        if pdl:
            from lserve.kernels.pdl import launch_pdl

            launch_pdl(kernel.kernel.ptr, grid, block, args, shared_mem, torch.cuda.current_stream(dev).cuda_stream)
            return
        with torch_stream():
            kernel(grid, block, args, shared_mem=shared_mem)


def opt_in_shared(kernel, shared_mem: int) -> None:
    """Raise ``kernel``'s dynamic shared-memory limit to ``shared_mem`` bytes where the launch needs it.

    A CTA whose static plus dynamic shared memory exceeds 48 KiB needs the opt-in: the dynamic part
    alone can be under 48 KiB and still fail the launch (``CUDA_ERROR_INVALID_VALUE``).
    """
    if shared_mem + kernel.shared_size_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem


def ptr(t) -> np.uint64:
    """Device address of a tensor (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(x: int) -> np.int32:
    if not -(2 ** 31) <= int(x) < 2 ** 31:
        raise KernelError(f"{x} does not fit a 32-bit kernel argument")
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


# -- offline compile check ------------------------------------------------------------------------
def all_variants() -> list[Variant]:
    """Every variant the backend can ask for with head_dim 64/128 (for the nvcc check)."""
    out = []
    for dt in DTYPES:
        for d in (64, 128):
            for qz in QUANTS:
                out.append(Variant("kv_write", dt, d, qz))
                for gq in (1, 2, 4, 8):
                    out.append(Variant("decode", dt, d, qz, gq))
            for gq in (1, 2, 4, 8):
                out.append(Variant("selector", dt, d, "none", gq))
                out.append(Variant("merge", dt, d, "none", gq))
                if dt != "fp32":
                    out.append(Variant("decode_tc", dt, d, "none", gq))
                    out.append(Variant("selector_tc", dt, d, "none", gq))
            if dt != "fp32":
                out.append(Variant("prefill", dt, d))
                out.append(Variant("bsp_prefill", dt, d))
                if d == 128:
                    out.append(Variant("bsp_prefill_wg", dt, d))
                    for sw, pp in ((1, 0), (1, 1), (0, 0)):
                        out.append(Variant("bsp_prefill_ws", dt, d, tuning=(f"LS_BSP_SWIZZLE={sw}", f"LS_BSP_PINGPONG={pp}")))
                    for st in (2, 3):
                        out.append(Variant("bsp_prefill_ws4", dt, d, tuning=(f"LS_BSP_STAGES={st}",)))
                    for st in (2, 3, 4):
                        out.append(Variant("bsp_prefill_v5", dt, d, tuning=(f"LS_BSP_STAGES={st}",)))
                    out.append(Variant("bsp_prefill_v5", dt, d, tuning=("LS_BSP_STAGES=3", "LS_BSP_PERSIST=1")))
            out.append(Variant("fused", dt, d))
    out.append(Variant("prefill_cut", "fp32", 128))  # float32 masses whatever the model's dtype
    out.append(Variant("page_copy", "bf16", 128))  # bytes: one build whatever the model
    return out


def nvcc_check(arch: str = "sm_90", variants: list[Variant] | None = None, verbose: bool = False) -> int:
    """Compile variants with ``nvcc -cubin`` and print ptxas resource usage; returns failures."""
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for var in variants or all_variants():
            src = Path(tmp) / f"{var.family}.cu"
            src.write_text(source_of(var.family))
            target = "sm_90a" if var.family in SM90A_FAMILIES else arch
            cmd = ["nvcc", f"-arch={target}", "-cubin", "-o", str(Path(tmp) / "out.cubin"), "-Xptxas", "-v",
                   *options_of(var), str(src)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in res.stderr.splitlines() if "registers" in ln or "spill" in ln or "error" in ln]
            status = "ok" if res.returncode == 0 else "FAILED"
            print(f"{status:6s} {var}")
            if res.returncode != 0:
                failures += 1
                print(res.stderr)
            elif verbose:
                print("\n".join("    " + ln.strip() for ln in lines))
    return failures


if __name__ == "__main__":
    if "--nvcc-check" in sys.argv:
        sys.exit(1 if nvcc_check(verbose="-v" in sys.argv) else 0)
    print(__doc__)
