"""hybridkv's own CPU kernels (``cpu_kernels.c``): compiled at first use, called through ctypes.

The default engine path on an x86-64 CPU with AVX2 and FMA runs its quantized matmuls here; where
the kernels cannot be built (another CPU, no C compiler, ``HYBRIDKV_CPU_KERNELS=0``) the engine
uses torch's int4 kernels instead. Every kernel computes each output row from its own input row
alone (see the C file's header), so results never depend on the batch or the chunking.
See docs/ENGINE.md, "Quantized matmuls".
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
"""No ``-ffast-math``: the compiler must keep the order of every floating-point operation."""
ABI_VERSION = 1

_lib: ctypes.CDLL | None = None
_failure: str | None = None


def cache_dir() -> Path:
    """Where the compiled library is kept: ``$HYBRIDKV_CACHE`` or ``~/.cache/hybridkv`` (as the
    assembled GGUF), in a ``kernels`` folder only this user may write."""
    return Path(os.environ.get("HYBRIDKV_CACHE", Path.home() / ".cache" / "hybridkv")) / "kernels"


def _private(folder: Path) -> Path:
    """``folder``, created if missing; ``OSError`` unless this user owns it and nobody else may write
    it (a library loaded from a folder others can write would run their code)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{folder} is not a folder only this user can write")
    return folder


def _cpu_supported() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, the kernels need x86-64"
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return "/proc/cpuinfo cannot be read to check for AVX2 and FMA"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _compile(compiler: str, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent process loads either no file or a whole one
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{compiler} failed: {exc.stderr.strip()[:500]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None (the reason logged once, and in
    ``unavailable_reason()``) where they cannot run here."""
    global _lib, _failure
    if _lib is not None or _failure is not None:
        return _lib
    if os.environ.get("HYBRIDKV_CPU_KERNELS", "1") == "0":
        _failure = "HYBRIDKV_CPU_KERNELS=0"
        return None
    why = _cpu_supported()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if why is None and compiler is None:
        why = "no C compiler (cc, gcc or $CC) to build them"
    if why is not None:
        _failure = why
        logger.info("hybridkv's CPU kernels are off (%s); using torch's int4 kernels", why)
        return None
    assert compiler is not None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    try:
        try:
            folder = _private(cache_dir())
        except OSError:  # a read-only home: this user's own folder in the temporary directory
            folder = _private(Path(tempfile.gettempdir()) / f"hybridkv-kernels-{os.getuid()}")
        target = folder / f"cpu_kernels-{key}.so"
        if not target.exists():
            start = time.perf_counter()
            _compile(compiler, target)
            logger.info("built hybridkv's CPU kernels in %.1f s (%s)", time.perf_counter() - start, target)
        lib = ctypes.CDLL(str(target))
        if lib.hkv_abi_version() != ABI_VERSION:
            raise OSError(f"{target} is ABI {lib.hkv_abi_version()}, expected {ABI_VERSION}")
    except (OSError, subprocess.SubprocessError) as exc:
        _failure = f"building or loading them failed: {exc}"
        logger.warning("hybridkv's CPU kernels are off (%s); using torch's int4 kernels", _failure)
        return None
    _declare(lib)
    _lib = lib
    return lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _failure


def _declare(lib: ctypes.CDLL) -> None:
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "hkv_qmatmul": [i, i, i, i, i, p, p, p, p, i, p, p, i],
        "hkv_rms_norm": [i, i, p, i, p, f, p, p, p],
        "hkv_qk_norm_rope": [i, i, i, p, i, p, f, p, p],
        "hkv_gelu_mul": [i, i, p, p],
        "hkv_attention": [i, i, i, i, i, i, p, i, p, p, p, p, p, i, f, p, i, i],
        "hkv_logsumexp": [i, i, p, p, i],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None


def _kernels() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"hybridkv's CPU kernels are not available: {_failure}")
    return lib


def _rows(t: torch.Tensor) -> int:
    """The row stride of a 2-D float32 CPU tensor whose rows are contiguous (a view's columns allowed)."""
    if t.dim() != 2 or t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(1) != 1:
        raise ValueError(f"expected a 2-D float32 CPU tensor with contiguous rows, got {t.dtype} {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, residual: torch.Tensor | None = None,
             then: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma's RMSNorm of the rows of ``x`` ``[T, n]`` (float32 rows) times ``weight`` (``1 + w``, float32
    and contiguous; None: 1). With ``residual`` (``[T, n]``, contiguous): adds the result to it in place
    and returns ``residual``, or, with ``then`` (the next norm's weight), the RMSNorm of the updated
    residual times ``then`` (a post-norm and the pre-norm after it in one call)."""
    rows, n = x.shape
    if n % 8 or (residual is not None and (not residual.is_contiguous() or residual.shape != x.shape)):
        raise ValueError(f"rows of {n} values (a multiple of 8), a contiguous residual of the input's shape")
    out = residual if residual is not None and then is None else torch.empty(rows, n)
    if rows:
        _kernels().hkv_rms_norm(rows, n, _ptr(x), _rows(x), None if weight is None else _ptr(weight), eps, _ptr(out),
                                None if residual is None else _ptr(residual), None if then is None else _ptr(then))
    return out


def qk_norm_rope(x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """In place on the first ``heads`` heads of each row of ``x`` ``[T, >= heads * head_dim]``: per-head
    RMSNorm with ``weight`` ``[heads, head_dim]``, then rotate-half RoPE with ``cos``, ``sin`` ``[T, head_dim]``."""
    rows = x.shape[0]
    if head_dim % 16 or head_dim > 1024 or weight.shape != (heads, head_dim):
        raise ValueError(f"per-head norm of {heads} x {head_dim} with weights {tuple(weight.shape)}")
    cos, sin, w = cos.float().contiguous(), sin.float().contiguous(), weight.float().contiguous()
    if rows:
        _kernels().hkv_qk_norm_rope(rows, heads, head_dim, _ptr(x), _rows(x), _ptr(w), eps, _ptr(cos), _ptr(sin))


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``gelu_tanh(gate) * up`` of rows ``[gate | up]`` ``[T, 2n]`` (float32, contiguous)."""
    rows, two_n = gate_up.shape
    gate_up = gate_up.float().contiguous()
    out = torch.empty(rows, two_n // 2)
    if rows:
        _kernels().hkv_gelu_mul(rows, two_n // 2, _ptr(gate_up), _ptr(out))
    return out


def logsumexp(logits: torch.Tensor) -> torch.Tensor | None:
    """``torch.logsumexp(logits, -1)`` of float32 CPU rows (about 100x faster on a 262k vocabulary);
    None when the kernels or this tensor cannot take it (the caller uses torch's)."""
    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.shape[1] % 8 or load() is None):
        return None
    rows = logits.contiguous()
    out = torch.empty(rows.shape[0])
    if rows.shape[0]:
        _kernels().hkv_logsumexp(rows.shape[0], rows.shape[1], _ptr(rows), _ptr(out), torch.get_num_threads())
    return out


def attention_supported(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``attention`` takes these shapes and this cache dtype."""
    return (heads % kv_heads == 0 and heads // kv_heads <= 8 and head_dim % 32 == 0 and head_dim <= 512
            and dtype in (torch.float32, torch.bfloat16))


def attention(q: torch.Tensor, heads: int, kv_heads: int, head_dim: int, query_rows: torch.Tensor,
              key_slots: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
              out: torch.Tensor) -> None:
    """One attention part into ``out`` ``[T, heads * head_dim]``: the queries ``q`` ``[T, >= heads *
    head_dim]`` (float32 rows) of rows ``query_rows`` ``[B, Q]`` over the cache slots ``key_slots``
    ``[B, L]`` where ``mask`` ``[B, Q, L]``; ``k_cache``, ``v_cache`` ``[slots, kv_heads, head_dim]``
    float32 or bfloat16 (``cpu_kernels.c``, ``hkv_attention``, states the arithmetic)."""
    b, nq = query_rows.shape
    length = key_slots.shape[1]
    if not attention_supported(heads, kv_heads, head_dim, k_cache.dtype) or mask.shape != (b, nq, length):
        raise ValueError(f"attention of {heads}/{kv_heads} heads of {head_dim} over a {k_cache.dtype} cache, "
                         f"mask {tuple(mask.shape)} for {b} x {nq} queries and {length} keys")
    rows = query_rows.to(torch.int64).contiguous()
    slots = key_slots.to(torch.int64).contiguous()
    seen = mask.to(torch.bool).contiguous()
    _kernels().hkv_attention(b, nq, length, heads, kv_heads, head_dim, _ptr(q), _rows(q), _ptr(rows), _ptr(slots),
                             _ptr(seen), _ptr(k_cache), _ptr(v_cache), int(k_cache.dtype == torch.bfloat16), scale,
                             _ptr(out), _rows(out), torch.get_num_threads())


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def lane_major(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` as the kernels read them (``cpu_kernels.c``, ``wvec``): per block of 32 bytes,
    16-bit lane ``j`` holds the codes of weights ``16 v + j`` of the block, ``bits`` bits each (low
    first): byte ``2 j`` the codes of ``v = 0, 1`` (4-bit: ``v = 0`` low nibble) and byte ``2 j + 1``
    the next ones. Byte arithmetic on ``uint8`` views only (a 262,144 x 640 matrix in a fraction of a second)."""
    n, k = codes.shape
    per_lane = 16 // bits
    c = codes.to(torch.int8 if bits == 8 else torch.uint8).view(torch.uint8).view(n, k // (16 * per_lane), per_lane, 16)
    if bits == 4:  # pack v = 0, 1 into one byte and v = 2, 3 into the next
        c = (c[:, :, 0::2] | (c[:, :, 1::2] << 4))
    blocks = c.transpose(2, 3).contiguous()  # [N, block, 16 lanes, 2 bytes]
    return interleave(blocks.reshape(n, -1, 32)).reshape(n, k * bits // 8)


def interleave(per_column: torch.Tensor) -> torch.Tensor:
    """``[N, B, ...]`` (per output column, its blocks along the input) in the kernels' column order:
    tiles of 8 columns, the tile's blocks at one input offset next to each other: ``[N // 8, B, 8, ...]``."""
    n, b = per_column.shape[:2]
    return per_column.reshape(n // 8, 8, b, *per_column.shape[2:]).transpose(1, 2).contiguous()


class QuantMatrix:
    """A weight ``[N, K]`` as 4- or 8-bit codes in groups of 32 along ``K`` with a float32 (scale,
    zero) per ``group`` inputs of each row; ``matrix(x)`` is ``x @ W.T`` in float32."""

    __slots__ = ("bits", "group", "codes", "scale", "zero", "has_zero", "out_features", "in_features")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = 32) -> None:
        """``codes`` integer ``[N, K]`` (0..15: packed as 4-bit, else -128..127); ``scale``, ``zero``
        ``[N, K // group]``."""
        n, k = codes.shape
        if (n % 8 or k % 32 or group not in (32, 128) or k % group or scale.shape != (n, k // group)
                or zero.shape != scale.shape):
            raise ValueError(f"cannot hold a {n} x {k} weight in groups of {group} with scales {tuple(scale.shape)}")
        lo, hi = int(codes.min()), int(codes.max())
        self.bits = 4 if lo >= 0 and hi <= 15 else 8
        if self.bits == 8 and (lo < -128 or hi > 127):
            raise ValueError(f"codes {lo}..{hi} do not fit 8 bits")
        self.group, self.out_features, self.in_features = group, n, k
        if k % 64 and self.bits == 4:
            raise ValueError(f"a 4-bit weight's input dimension must be a multiple of 64, got {k}")
        self.codes = lane_major(codes, self.bits)
        self.scale = interleave(scale.float())
        self.zero = interleave(zero.float())
        self.has_zero = bool((self.zero != 0).any())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 ``[M, N]`` of ``x`` ``[M, K]`` (any float dtype)."""
        lib = _kernels()
        x = x.float().contiguous()
        m = x.shape[0]
        k = self.in_features
        out = torch.empty(m, self.out_features)
        scratch = torch.empty(m * (k // 2 + k // 32 + k // self.group))  # int16 codes, then scales and sums
        if m:
            lib.hkv_qmatmul(self.bits, m, self.out_features, k, self.group, _ptr(x), _ptr(self.codes),
                            _ptr(self.scale), _ptr(self.zero), int(self.has_zero), _ptr(out), _ptr(scratch),
                            torch.get_num_threads())
        return out

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * (self.scale.numel() + self.zero.numel())
