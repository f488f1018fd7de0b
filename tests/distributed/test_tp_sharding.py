"""Tensor-parallel pieces that need no second process: divisibility errors, weight sharding,
and that one rank means plain layers and no collectives."""

from __future__ import annotations

import pytest
import torch

from sparse_core import LLM, EngineConfig, SamplingParams, SparsityConfig
from sparse_core.cli import build_parser, configs_from_args
from sparse_core.distributed import COLLECTIVE_CALLS, check_tp_divisibility
from sparse_core.distributed import parallel_state as ps
from sparse_core.kernels import REFERENCE_OPS
from sparse_core.models.config import DUMMY_PRESETS, ModelConfig
from sparse_core.models.dummy import dummy_weights
from sparse_core.models.llama import LlamaForCausalLM
from sparse_core.policy import plan_layers


def test_head_counts_that_do_not_divide_name_the_numbers():
    smollm2 = DUMMY_PRESETS["smollm2-135m"]  # 9 heads, 3 KV heads, intermediate 1536
    check_tp_divisibility(smollm2, 3)
    with pytest.raises(ValueError) as err:
        check_tp_divisibility(smollm2, 2)
    message = str(err.value)
    assert "tensor_parallel_size=2" in message
    assert "num_attention_heads=9" in message and "num_key_value_heads=3" in message
    assert "intermediate_size" not in message.split(" of model")[0]  # 1536 divides by 2
    assert "[1, 3]" in message  # the sizes that would work


@pytest.mark.parametrize(
    ("field", "value"),
    [("intermediate_size", 129), ("vocab_size", 511), ("num_key_value_heads", 1)],
)
def test_each_sharded_size_is_checked(field, value):
    config = ModelConfig(**{**vars(DUMMY_PRESETS["tiny"]), field: value})
    with pytest.raises(ValueError, match=f"{field}={value}"):
        check_tp_divisibility(config, 2)


def test_engine_rejects_a_bad_size_before_starting_workers():
    with pytest.raises(ValueError, match="num_attention_heads=4, num_key_value_heads=2"):
        LLM("dummy:tiny", tensor_parallel_size=3, kv_cache_memory_gb=0.01)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


def test_cli_flag():
    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2"])
    assert configs_from_args(args)[0].tensor_parallel_size == 2


def build_rank(config: ModelConfig, rank: int, size: int, monkeypatch) -> LlamaForCausalLM:
    """The model rank `rank` of `size` builds, with the full dummy checkpoint loaded."""
    monkeypatch.setattr(ps, "_STATE", ps.TensorParallelState(rank, size))
    plan = plan_layers(SparsityConfig(policy="dense"), config.num_hidden_layers, config.name)
    model = LlamaForCausalLM(config, plan, REFERENCE_OPS, 64)
    model.load_weights(dummy_weights(config, 0, torch.device("cpu")))
    return model


def test_ranks_hold_whole_heads_and_their_slices_rebuild_the_model(monkeypatch):
    config = ModelConfig(**{**vars(DUMMY_PRESETS["tiny"]), "attention_bias": True})
    full = build_rank(config, 0, 1, monkeypatch)
    ranks = [build_rank(config, r, 2, monkeypatch) for r in range(2)]
    attn = ranks[0].model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert ranks[1].kv_heads == (1, 2)  # rank 1 holds KV head 1 of 2
    d = config.head_dim
    for name in ("weight", "bias"):
        q, k, v = getattr(full.model.layers[1].self_attn.qkv_proj, name).split(
            [4 * d, 2 * d, 2 * d]
        )
        parts = [
            getattr(m.model.layers[1].self_attn.qkv_proj, name).split([2 * d, d, d]) for m in ranks
        ]
        for i, whole in enumerate((q, k, v)):  # [q_r | k_r | v_r], rank 0 first
            assert torch.equal(torch.cat([p[i] for p in parts]), whole)
    gate, up = full.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    parts = [m.model.layers[0].mlp.gate_up_proj.weight.chunk(2) for m in ranks]
    assert torch.equal(torch.cat([p[0] for p in parts]), gate)
    assert torch.equal(torch.cat([p[1] for p in parts]), up)
    for name in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: input columns split
        whole = full.model.layers[0].get_submodule(name).weight
        assert torch.equal(
            torch.cat([m.model.layers[0].get_submodule(name).weight for m in ranks], 1), whole
        )
    for name in ("model.embed_tokens", "lm_head"):  # vocabulary rows split
        whole = full.get_submodule(name).weight
        assert torch.equal(torch.cat([m.get_submodule(name).weight for m in ranks]), whole)


def test_tied_embeddings_share_one_shard(monkeypatch):
    config = ModelConfig(**{**vars(DUMMY_PRESETS["tiny"]), "tie_word_embeddings": True})
    model = build_rank(config, 1, 2, monkeypatch)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (config.vocab_size // 2, config.hidden_size)


def test_one_rank_issues_no_collectives():
    COLLECTIVE_CALLS.clear()
    llm = LLM(
        "dummy:tiny",
        sparsity=SparsityConfig(policy="snapkv", budget=48, window=8, full_layers=1),
        max_model_len=256,
        kv_cache_memory_gb=0.01,
    )
    llm.generate([list(range(1, 120))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not COLLECTIVE_CALLS
    llm.shutdown()  # nothing to stop: a no-op
