"""Capacity planner: config parsing, presets, truthful capacity (the real manager agrees), CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv import KVCacheLayout, KVCacheManager, Sequence, capacity_report, plan_layout
from hybridkv.cli import main
from hybridkv.core import FullAttentionSpec, MambaSpec
from hybridkv.planning import PRESETS, ConfigError, get_preset, layer_specs, parse_config
from hybridkv.planning.hardware import HARDWARE, GiB
from hybridkv.planning.planner import PlanInput, make_plan

# ---------------------------------------------------------------------- config parsing


def test_gemma3_pattern_makes_every_sixth_layer_global() -> None:
    cfg = {"text_config": {"num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
                           "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6}}
    m = parse_config(cfg)
    assert [i for i, k in enumerate(m.layer_kinds) if k == "full"] == [5, 11]
    assert (m.num_kv_heads, m.head_size, m.sliding_window) == (1, 256, 512)


def test_layer_types_win_and_unknown_types_name_the_field() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}
    assert parse_config(cfg).layer_kinds == ("sliding", "full")
    assert parse_config(cfg).head_size == 128
    with pytest.raises(ConfigError, match=r"layer_types\[1\]"):
        parse_config({**cfg, "layer_types": ["sliding_attention", "weird"]})
    with pytest.raises(ConfigError, match="layer_types"):
        parse_config({**cfg, "layer_types": ["full_attention"]})


def test_missing_fields_are_named() -> None:
    with pytest.raises(ConfigError, match="'num_hidden_layers'"):
        parse_config({"num_attention_heads": 8})
    with pytest.raises(ConfigError, match="'hidden_size'"):
        parse_config({"num_hidden_layers": 2, "num_attention_heads": 8})
    with pytest.raises(ConfigError, match="'sliding_window'"):
        parse_config({"num_hidden_layers": 1, "num_attention_heads": 8, "head_dim": 64,
                      "layer_types": ["sliding_attention"]})


def test_llama4_rope_layers_are_chunked_and_every_fourth_is_global() -> None:
    cfg = {"num_hidden_layers": 8, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
           "attention_chunk_size": 8192}
    assert parse_config(cfg).layer_kinds == ("chunked",) * 3 + ("full",) + ("chunked",) * 3 + ("full",)


def test_tensor_parallel_divides_kv_heads_and_replicates_when_fewer() -> None:
    cfg = {"num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert parse_config(cfg, tensor_parallel_size=4).num_kv_heads == 2
    assert parse_config(cfg, tensor_parallel_size=16).num_kv_heads == 1
    with pytest.raises(ConfigError, match="not divisible"):
        parse_config(cfg, tensor_parallel_size=3)


def test_mla_latent_is_one_vector_per_token() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    specs = layer_specs(parse_config(cfg), kv_dtype_bytes=1)
    assert all(s.kind == "mla" and s.page_size_bytes == 16 * 576 for s in specs.values())


def test_jamba_layout_and_state_size() -> None:
    cfg = {"num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
           "mamba_expand": 2}
    m = parse_config(cfg)
    assert m.layer_kinds.count("full") == 1 and m.layer_kinds[4] == "full"
    assert m.mamba_state_elements == 8192 * 3 + 8192 * 16


def test_mamba2_state_is_conv_plus_ssm_and_tensor_parallel_splits_heads_and_groups() -> None:
    # Nemotron-H spelling. conv: (d_conv - 1) x (inner + 2 x groups x d_state); SSM: heads x head_dim x d_state.
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
           "hidden_size": 4096, "hybrid_override_pattern": "M*-", "mamba_num_heads": 128, "mamba_head_dim": 64,
           "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4}
    m = parse_config(cfg)
    assert m.layer_kinds == ("mamba", "full", "none")
    assert m.head_size == 128
    assert m.mamba_state_elements == 3 * (8192 + 2 * 8 * 128) + 128 * 64 * 128
    assert parse_config(cfg, tensor_parallel_size=4).mamba_state_elements == (
        3 * (8192 + 2 * 8 * 128) // 4 + 32 * 64 * 128)
    assert set(layer_specs(m)) == {"model.layers.0", "model.layers.1"}
    with pytest.raises(ConfigError, match="'mamba_num_heads'=120 is not divisible"):
        parse_config({**cfg, "mamba_num_heads": 120}, tensor_parallel_size=16)


def test_mamba2_with_one_group_replicates_it_on_every_rank() -> None:
    # Granite 4.0-H spelling: inner = mamba_expand x hidden_size (vLLM's granitemoehybrid).
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 1536,
           "layer_types": ["mamba", "attention"], "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128,
           "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
    m = parse_config(cfg)
    assert m.layer_kinds == ("mamba", "full")
    assert m.mamba_state_elements == 3 * (3072 + 2 * 128) + 48 * 64 * 128
    # vLLM extra_groups_for_head_shards: 1 group on 4 ranks becomes 4 groups, one per rank.
    assert parse_config(cfg, tensor_parallel_size=4).mamba_state_elements == (
        3 * (3072 + 2 * 4 * 128) // 4 + 12 * 64 * 128)
    with pytest.raises(ConfigError, match="do not match"):
        parse_config({**cfg, "mamba_d_head": 32})


def test_falcon_h1_layers_keep_a_kv_cache_and_a_state() -> None:
    cfg = {"model_type": "falcon_h1", "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 2,
           "head_dim": 128, "hidden_size": 3072, "mamba_d_ssm": 3072, "mamba_expand": 2, "mamba_n_heads": 24,
           "mamba_d_head": 128, "mamba_d_state": 256, "mamba_n_groups": 1, "mamba_d_conv": 4}
    m = parse_config(cfg)
    assert m.layer_kinds == ("full+mamba",) * 2
    assert (m.count("full"), m.count("mamba"), m.num_layers) == (2, 2, 2)
    assert m.mamba_state_elements == 3 * (3072 + 2 * 256) + 24 * 128 * 256  # mamba_d_ssm, not expand x hidden
    specs = layer_specs(m, kv_dtype_bytes=1, state_dtype_bytes=2)
    assert list(specs) == ["model.layers.0.self_attn", "model.layers.0.mamba",
                           "model.layers.1.self_attn", "model.layers.1.mamba"]
    assert isinstance(specs["model.layers.1.self_attn"], FullAttentionSpec)
    assert isinstance(specs["model.layers.1.mamba"], MambaSpec)
    assert specs["model.layers.1.mamba"].state_bytes == 2 * m.mamba_state_elements


# ---------------------------------------------------------------------- presets


def test_every_required_preset_exists() -> None:
    required = {"gemma-3-270m", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gemma-2-9b",
                "gemma-2-27b", "gpt-oss-20b", "gpt-oss-120b", "mistral-7b-v0.1", "llama-3.1-8b", "llama-3.1-70b",
                "llama-4-scout", "qwen3-next-80b-a3b", "jamba-mini", "deepseek-v3", "phi-3-mini"}
    assert required <= set(PRESETS)
    with pytest.raises(ValueError, match="known presets"):
        get_preset("gpt-5")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_parses(preset: str) -> None:
    m = parse_config(PRESETS[preset].config)
    assert m.num_layers > 0 and m.head_size > 0


# ---------------------------------------------------------------------- truthful by test

TRUTH_LEN = 2049  # one token, then 8 chunks of 256: the last chunk starts off a block boundary
TRUTH_BATCH = 256


def _small_layout(preset: str, concurrency: int) -> KVCacheLayout:
    """A pool with room for ``concurrency`` peak requests of TRUTH_LEN tokens, and half of one more."""
    specs = layer_specs(parse_config(PRESETS[preset].config))
    probe = plan_layout(specs, 1 << 40, max_model_len=TRUTH_LEN, max_num_batched_tokens=TRUTH_BATCH)
    rep = capacity_report(probe, max_model_len=TRUTH_LEN, max_num_batched_tokens=TRUTH_BATCH)
    per_request = sum(rep.blocks_per_request)
    bytes_per_block = probe.page_size_bytes * probe.group_size
    budget = (concurrency * per_request + per_request // 2 + 1) * bytes_per_block
    return plan_layout(specs, budget, max_model_len=TRUTH_LEN, max_num_batched_tokens=TRUTH_BATCH)


def _run_lockstep(mgr: KVCacheManager, n: int) -> bool:
    """Admit n sequences of TRUTH_LEN tokens together and prefill them in interleaved chunks."""
    seqs = [Sequence(f"s{i}", [(i * 7919 + t) % 50000 + 1 for t in range(TRUTH_LEN)]) for i in range(n)]
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        for s in seqs:
            left = s.num_tokens - s.num_computed_tokens
            if not left:
                continue
            step = 1 if s.num_computed_tokens == 0 else min(TRUTH_BATCH, left)
            if mgr.allocate(s, step) is None:
                return False
            s.num_computed_tokens += step
        mgr.check_invariants()
    return True


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_reported_max_concurrency_is_exact_on_the_real_manager(preset: str) -> None:
    layout = _small_layout(preset, concurrency=2)
    rep = capacity_report(layout, max_model_len=TRUTH_LEN, max_num_batched_tokens=TRUTH_BATCH)
    n = rep.max_concurrency
    assert n == 2
    # Prefix caching on (distinct prompts: no hits): a recurrent group's peak includes the checkpoint
    # its last chunk writes at the prompt's end, as the per-request bound counts it.
    ok = KVCacheManager(layout, TRUTH_LEN, TRUTH_BATCH)
    assert _run_lockstep(ok, n), f"{n} sequences should run to the end"
    over = KVCacheManager(layout, TRUTH_LEN, TRUTH_BATCH)
    assert not _run_lockstep(over, n + 1), f"{n + 1} sequences at their peak should not fit"


def test_full_attention_token_capacity_is_every_usable_block() -> None:
    plan = make_plan(PlanInput(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192))
    r = plan.to_json()
    assert r["kv_capacity_tokens"] == (r["num_blocks"] - 1) * r["block_size"]


def test_hybrid_capacity_beats_the_naive_rule() -> None:
    r = make_plan(PlanInput(model="gemma-3-27b", gpu="h100-80gb", max_model_len=131072)).to_json()
    assert len(r["groups"]) > 1
    assert r["kv_capacity_tokens"] > r["naive_capacity_tokens"]
    assert 0 < r["bounded_groups_share"] < 1


def test_plan_reports_the_largest_length_that_fits() -> None:
    plan = make_plan(PlanInput(model="llama-3.1-8b", gpu_memory_bytes=20 * GiB, max_model_len=1 << 24))
    assert not plan.fits
    assert 0 < plan.max_model_len_that_fits < 1 << 24
    ok = make_plan(PlanInput(model="llama-3.1-8b", gpu_memory_bytes=20 * GiB,
                             max_model_len=plan.max_model_len_that_fits))
    assert ok.fits and ok.to_json()["max_concurrency"] == 1


def test_weights_that_do_not_fit_name_the_smallest_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match="smallest tensor-parallel size that fits is 2"):
        make_plan(PlanInput(model="llama-3.1-70b", gpu="h200-141gb"))


# ---------------------------------------------------------------------- CLI


def test_cli_plan_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--max-model-len", "131072",
                 "--request-len", "4096", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("num_blocks", "block_size", "groups", "kv_capacity_tokens", "max_concurrency", "bytes_per_block",
                "naive_capacity_tokens", "concurrency_at_request_len", "padding_waste_bytes", "memory"):
        assert key in doc
    assert doc["concurrency_at_request_len"]["4096"] >= doc["max_concurrency"]


@pytest.mark.parametrize(("preset", "attention", "states"), [
    ("nemotron-h-8b", 4, 24), ("granite-4.0-h-tiny", 4, 36), ("falcon-h1-7b", 44, 44)])
def test_cli_plans_the_recurrent_hybrids_on_an_h100(preset: str, attention: int, states: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", preset, "--gpu", "h100-80gb", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["max_concurrency"] >= 1
    layers = {kind: [name for g in doc["groups"] if g["kind"] == kind and not g.get("state_part")
                     for name in g["layers"]] for kind in ("full", "mamba_align")}
    assert (len(layers["full"]), len(layers["mamba_align"])) == (attention, states)
    # A state spans several pages, one group each; attention keeps its 16-token blocks.
    assert {g["block_size"] for g in doc["groups"]} == {16}
    for st in doc["recurrent_states"]:
        assert st["pages_per_state"] == -(-st["state_bytes"] // doc["groups"][0]["page_size_bytes"]) > 1
        assert [doc["groups"][g]["state_part"] for g in st["groups"]] == list(range(st["pages_per_state"]))
    assert all(not g["grows_with_sequence"] for g in doc["groups"] if g["kind"] == "mamba_align")
    if preset == "falcon-h1-7b":  # both caches of each parallel layer, named apart
        assert sorted(layers["full"]) == sorted(f"model.layers.{i}.self_attn" for i in range(44))
        assert sorted(layers["mamba_align"]) == sorted(f"model.layers.{i}.mamba" for i in range(44))
    assert main(["plan", "--model", preset, "--gpu", "h100-80gb"]) == 0  # the table too


def test_cli_plan_reads_a_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(get_preset("mistral-7b-v0.1").config))
    assert main(["plan", "--model", str(cfg), "--num-params", "7241732096", "--gpu", "l4-24gb",
                 "--max-model-len", "8192", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"][0]["kind"] == "sliding_window"


def test_cli_plan_lists_models_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list-models"]) == 0
    assert "gemma-3-27b" in capsys.readouterr().out
    assert main(["plan", "--model", "nope"]) == 2
    assert "known presets" in capsys.readouterr().err
    assert main(["plan", "--model", "gemma-3-1b", "--gpu", "tpu-v9"]) == 2
    assert set(HARDWARE) <= set(capsys.readouterr().err.replace(",", " ").split())
