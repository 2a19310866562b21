"""hybridkv's CPU kernels (``engine/cpu_kernels.c``) against torch references, and the one rule
they keep: a row's result is a function of that row alone (its count in the call, its neighbours,
the key width and the thread count never change a bit).

Also: the loader refuses a cache folder others can write, falls back to torch's kernels when the
kernels cannot be built, and the engine then still runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridkv.engine import cpu_kernels  # noqa: E402
from hybridkv.engine.model import apply_rope, rms_norm, tiled_attention  # noqa: E402
from hybridkv.engine.quant import GroupCodes, requantize_4bit  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def codes_of(n: int, k: int, bits: int, seed: int, zero: bool) -> GroupCodes:
    g = gen(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    c = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int16)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    z = torch.randn(n, k // 32, generator=g) * 0.05 if zero else torch.zeros(n, k // 32)
    return GroupCodes(c, scale, z)


# ---------------------------------------------------------------------- quantized matmul
@pytest.mark.parametrize("bits,zero", [(4, True), (8, False), (8, True)])
def test_quantized_matmul_matches_the_dequantized_weights(bits: int, zero: bool) -> None:
    codes = codes_of(72, 640, bits, 0, zero)
    m = cpu_kernels.QuantMatrix(codes.codes, codes.scale, codes.zero)
    assert m.bits == bits
    x = torch.randn(9, 640, generator=gen(1))
    x[3] *= 1e-4  # rows of very different sizes: the activations' scale is per row and group
    x[4, :32] = 0.0  # a group of zeros
    ref = x.double() @ codes.dequantize().double().T
    got = m(x).double()
    err = (got - ref).abs().amax(1) / ref.abs().amax(1)
    assert err.max().item() < 1e-4, err  # int16 activations: ~3e-5 of a row's largest output


def test_a_head_screen_with_scale_groups_of_128() -> None:
    codes = requantize_4bit(codes_of(64, 640, 8, 2, False), 128)
    m = cpu_kernels.QuantMatrix(codes.codes, codes.scale[:, ::4].contiguous(), codes.zero[:, ::4].contiguous(), 128)
    x = torch.randn(3, 640, generator=gen(3))
    ref = x.double() @ codes.dequantize().double().T
    assert ((m(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("bits", [4, 8])
def test_each_row_computes_the_same_bits_in_any_call(bits: int) -> None:
    codes = codes_of(136, 1024, bits, 4, bits == 4)
    m = cpu_kernels.QuantMatrix(codes.codes, codes.scale, codes.zero)
    x = torch.randn(70, 1024, generator=gen(5))
    every = m(x)
    for lo, hi in ((0, 1), (5, 6), (0, 2), (1, 4), (3, 8), (2, 7), (1, 70)):  # every tile shape and tail
        assert torch.equal(m(x[lo:hi]), every[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(m(x[:5]), every[:5])
    finally:
        torch.set_num_threads(threads)


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    c = codes_of(20, 640, 8, 6, False)  # 20 output rows: not a multiple of 8
    with pytest.raises(ValueError, match="cannot hold"):
        cpu_kernels.QuantMatrix(c.codes, c.scale, c.zero)
    c = codes_of(16, 96, 4, 6, False)  # 4-bit codes need the input in blocks of 64
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_kernels.QuantMatrix(c.codes, c.scale, c.zero)
    wide = torch.full((16, 64), 300, dtype=torch.int16)
    with pytest.raises(ValueError, match="do not fit 8 bits"):
        cpu_kernels.QuantMatrix(wide, torch.ones(16, 2), torch.zeros(16, 2))


# ---------------------------------------------------------------------- the rest of a layer
def test_rms_norm_and_its_residual_forms() -> None:
    x = torch.randn(5, 640, generator=gen(7)) * 3
    w = torch.rand(640, generator=gen(8)) + 0.5
    nxt = torch.rand(640, generator=gen(9)) + 0.5
    ref = rms_norm(x, w, 1e-6)
    assert torch.allclose(cpu_kernels.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(cpu_kernels.rms_norm(x, None, 1e-6), rms_norm(x, None, 1e-6), rtol=1e-5, atol=1e-6)
    res = torch.randn(5, 640, generator=gen(10))
    want = res + ref
    got = cpu_kernels.rms_norm(x, w, 1e-6, residual=res)
    assert got is res and torch.allclose(res, want, rtol=1e-5, atol=1e-5)
    res2 = want.clone() - ref
    normed = cpu_kernels.rms_norm(x, w, 1e-6, residual=res2, then=nxt)
    assert torch.allclose(res2, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(normed, rms_norm(want, nxt, 1e-6), rtol=1e-4, atol=1e-5)
    # columns of a wider tensor (a view): rows read with their stride
    wide = torch.randn(5, 900, generator=gen(11))
    assert torch.allclose(cpu_kernels.rms_norm(wide[:, :640], w, 1e-6), rms_norm(wide[:, :640], w, 1e-6),
                          rtol=1e-5, atol=1e-6)


def test_qk_norm_and_rope_in_place() -> None:
    from hybridkv.engine.model import rope_tables

    t, heads, d = 6, 5, 256
    qkv = torch.randn(t, heads * d + 3 * d, generator=gen(12))
    w = torch.rand(heads, d, generator=gen(13)) + 0.5
    cos, sin = rope_tables(torch.arange(100, 100 + t), d, 10_000.0, torch.float32)
    ref = apply_rope(rms_norm(qkv[:, :heads * d].reshape(t, heads, d), None, 1e-6) * w, cos, sin)
    tail = qkv[:, heads * d:].clone()
    cpu_kernels.qk_norm_rope(qkv, heads, d, w, 1e-6, cos.reshape(t, d), sin.reshape(t, d))
    assert torch.allclose(qkv[:, :heads * d].reshape(t, heads, d), ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(qkv[:, heads * d:], tail)  # the values are left alone


def test_geglu() -> None:
    gu = torch.randn(4, 2 * 2048, generator=gen(14)) * 4
    gu[0, :6] = torch.tensor([0.0, 1e-8, -60.0, 60.0, 200.0, -200.0])
    ref = F.gelu(gu[:, :2048].double(), approximate="tanh") * gu[:, 2048:].double()
    assert (cpu_kernels.gelu_mul(gu).double() - ref).abs().max().item() < 1e-4


# ---------------------------------------------------------------------- attention
def attention_case(dtype: torch.dtype, length: int = 384, queries: int = 5, seed: int = 15):
    g = gen(seed)
    heads, kvh, d = 4, 1, 256
    slots = 1024
    k_cache = torch.randn(slots, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, kvh, d, generator=g).to(dtype)
    key_slots = torch.randperm(slots, generator=g)[:length][None]
    q = torch.randn(queries, heads * d, generator=g)
    pos = torch.arange(length - queries, length)
    mask = (torch.arange(length)[None, :] <= pos[:, None])[None]  # causal: query i sees keys <= its position
    return q, k_cache, v_cache, key_slots, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_tiled_attention(dtype: torch.dtype) -> None:
    q, kc, vc, ks, mask = attention_case(dtype)
    n = q.shape[0]
    out = torch.empty(n, 4 * 256)
    cpu_kernels.attention(q, 4, 1, 256, torch.arange(n)[None], ks, mask, kc, vc, 0.0625, out)
    kp, vp = kc[ks[0]][None], vc[ks[0]][None]
    ref = tiled_attention(q.view(1, n, 4, 256), kp, vp, mask, 0.0625)[0].reshape(n, -1)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_a_query_attends_the_same_alone_and_among_others_whatever_the_key_width() -> None:
    q, kc, vc, ks, mask = attention_case(torch.bfloat16, queries=11)
    n = q.shape[0]
    together = torch.empty(n, 1024)
    cpu_kernels.attention(q, 4, 1, 256, torch.arange(n)[None], ks, mask, kc, vc, 0.0625, together)
    for i in (0, 4, 10):
        alone = torch.empty(n, 1024)
        cpu_kernels.attention(q, 4, 1, 256, torch.tensor([[i]]), ks, mask[:, i:i + 1], kc, vc, 0.0625, alone)
        assert torch.equal(alone[i], together[i])
        # more keys past its last visible one, masked, and masked keys holding NaN: nothing changes
        unused = torch.tensor([s for s in range(kc.shape[0]) if s not in set(ks[0].tolist())][:5])
        wide_slots = torch.cat([ks, unused[None]], 1)
        wide_mask = torch.cat([mask[:, i:i + 1], torch.zeros(1, 1, 5, dtype=torch.bool)], 2)
        poisoned = kc.clone()
        poisoned[unused] = float("nan")
        wide = torch.empty(n, 1024)
        cpu_kernels.attention(q, 4, 1, 256, torch.tensor([[i]]), wide_slots, wide_mask, poisoned, vc, 0.0625, wide)
        assert torch.equal(wide[i], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.empty(n, 1024)
        cpu_kernels.attention(q, 4, 1, 256, torch.arange(n)[None], ks, mask, kc, vc, 0.0625, single)
        assert torch.equal(single, together)
    finally:
        torch.set_num_threads(threads)


def test_a_query_that_sees_no_key_gets_zeros() -> None:
    q, kc, vc, ks, mask = attention_case(torch.float32, queries=2)
    out = torch.full((2, 1024), 7.0)
    cpu_kernels.attention(q, 4, 1, 256, torch.arange(2)[None], ks, torch.zeros_like(mask), kc, vc, 0.0625, out)
    assert torch.equal(out, torch.zeros(2, 1024))


# ---------------------------------------------------------------------- the loader
def test_a_cache_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="only this user"):
        cpu_kernels._private(shared)
    own = cpu_kernels._private(tmp_path / "own")
    assert own.is_dir() and not own.stat().st_mode & 0o022


def test_kernels_that_cannot_be_built_fall_back_with_a_reason(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path))
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'no such compiler' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    assert cpu_kernels.load() is None
    reason = cpu_kernels.unavailable_reason()
    assert reason is not None and "no such compiler" in reason
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind


def test_the_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("HYBRIDKV_CPU_KERNELS", "0")
    assert not cpu_kernels.available() and cpu_kernels.unavailable_reason() == "HYBRIDKV_CPU_KERNELS=0"


def test_a_fresh_build_in_a_new_folder_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path))
    assert cpu_kernels.load() is not None
    (built,) = (tmp_path / "kernels").iterdir()
    assert built.name.startswith("cpu_kernels-") and os.access(built, os.R_OK)
