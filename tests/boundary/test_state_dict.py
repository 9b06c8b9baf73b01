"""The state-dict boundary (loading/state_dict.py): ``load_state_dict`` in either layout, Trainer resume, streaming."""

from __future__ import annotations

import pytest
import torch

import modelpatch
from support.compare import assert_bitwise_equal, assert_outputs_close
from support.files import read_tensors

FUSED = {"qkv": True, "gate_up": True}


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in state.items()}


def test_a_stock_state_dict_loads_into_a_fused_model(tiny):
    checkpoint = tiny("llama")
    fused = checkpoint.load(FUSED)
    stock = checkpoint.model_class.from_pretrained(checkpoint.path)
    new = _perturbed(stock.state_dict(), 1)
    stock.load_state_dict(new)
    result = fused.load_state_dict(new)
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        assert torch.equal(fused(**checkpoint.inputs()).logits, stock(**checkpoint.inputs()).logits)
    assert_bitwise_equal(dict(modelpatch.iter_original_state_dict(fused)), stock.state_dict())


def test_its_own_layout_still_loads(tiny):
    checkpoint = tiny("llama")
    fused = checkpoint.load(FUSED)
    other = checkpoint.load(FUSED)
    new = _perturbed(other.state_dict(), 2)
    fused.load_state_dict(new)
    assert_bitwise_equal(fused.state_dict(), new)


def test_strict_reports_missing_and_unexpected_keys_in_the_callers_names(tiny):
    checkpoint = tiny("llama")
    fused = checkpoint.load(FUSED)
    stock_state = checkpoint.stock().state_dict()
    partial = {k: v for k, v in stock_state.items() if "layers.0.self_attn.k_proj" not in k}
    partial["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as raised:
        fused.load_state_dict(partial)
    message = str(raised.value)
    assert '"model.layers.0.self_attn.k_proj.weight"' in message and '"extra.weight"' in message
    assert "qkv_proj" not in message
    result = fused.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["model.layers.0.self_attn.k_proj.weight"]
    assert result.unexpected_keys == ["extra.weight"]


def test_a_partial_original_dict_changes_exactly_what_it_names(tiny):
    """Trainer loads shards with strict=False: q in one shard, k and v in another must each land in qkv_proj."""
    checkpoint = tiny("llama")
    fused = checkpoint.load(FUSED)
    stock = checkpoint.model_class.from_pretrained(checkpoint.path)
    new = _perturbed(stock.state_dict(), 3)
    names = sorted(new)
    first, second = names[::2], names[1::2]
    for part in (first, second):
        piece = {k: new[k] for k in part}
        stock.load_state_dict(piece, strict=False)
        result = fused.load_state_dict(piece, strict=False)
        assert sorted(result.missing_keys) == sorted(set(names) - set(part))
    assert_bitwise_equal(dict(modelpatch.iter_original_state_dict(fused)), stock.state_dict())


def test_a_wrong_shape_in_a_group_is_a_size_mismatch_naming_the_original_key(tiny):
    checkpoint = tiny("llama")
    fused = checkpoint.load(FUSED)
    state = dict(checkpoint.stock().state_dict())
    state["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(3, 3)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"size mismatch for model\.layers\.0\.self_attn\.v_proj\.weight"):
        fused.load_state_dict(state, strict=False)
    assert_bitwise_equal(fused.state_dict(), before)


LINEAR_EXPERTS = {"linear_experts": True}
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen2_moe_3d", "mixtral"])
def test_a_stock_moe_models_state_dict_loads_into_linear_experts(tiny, tmp_path, name):
    """transformers 5's MoE models hold their experts as 3-D tensors: their ``state_dict()`` fills per-expert Linears
    exactly as a load of a checkpoint of those 3-D tensors does, whatever layout the fused model was loaded from."""
    checkpoint = tiny(name)
    fused = checkpoint.load(LINEAR_EXPERTS)
    stock = checkpoint.model_class.from_pretrained(checkpoint.path)
    new = _perturbed(stock.state_dict(), 4)
    assert GATE_UP in new
    result = fused.load_state_dict(new)
    assert result.missing_keys == [] and result.unexpected_keys == []
    stock.load_state_dict(new)
    stock.save_pretrained(tmp_path, save_original_format=False)  # the 3-D tensors, as the stock model holds them
    assert_bitwise_equal(fused.state_dict(), checkpoint.load(LINEAR_EXPERTS, path=tmp_path).state_dict())
    assert_outputs_close(checkpoint.outputs(fused), checkpoint.outputs(stock))


def test_a_partial_stock_moe_dict_changes_exactly_what_it_names(tiny):
    checkpoint = tiny("qwen2_moe")
    fused = checkpoint.load(LINEAR_EXPERTS)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    new = _perturbed(checkpoint.stock().state_dict(), 5)
    result = fused.load_state_dict({GATE_UP: new[GATE_UP]}, strict=False)
    named = {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj")}
    assert {k for k in before if not torch.equal(before[k], fused.state_dict()[k])} == named
    # (The model's checkpoint is per expert: its missing keys are named so.)
    assert result.unexpected_keys == [] and result.missing_keys == [k for k in before if k not in named]
    gate, up = new[GATE_UP].chunk(2, dim=1)  # transformers' experts read the gate rows first
    for expert in range(4):
        assert torch.equal(fused.state_dict()[f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"], gate[expert])
        assert torch.equal(fused.state_dict()[f"model.layers.0.mlp.experts.{expert}.up_proj.weight"], up[expert])


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        (
            (4, 30, 32),
            r"size mismatch for model\.layers\.0\.mlp\.experts\.gate_up_proj: copying a param with shape "
            r"\[4, 30, 32\]",
        ),
        ((3, 32, 32), r"size mismatch for model\.layers\.0\.mlp\.experts\.gate_up_proj: .*expected 4 entries"),
    ],
    ids=["rows", "experts"],
)
def test_stock_moe_experts_of_another_shape_are_a_size_mismatch(tiny, shape, match):
    checkpoint = tiny("qwen2_moe")
    fused = checkpoint.load(LINEAR_EXPERTS)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    state = dict(checkpoint.stock().state_dict())
    assert tuple(state[GATE_UP].shape) != shape
    state[GATE_UP] = torch.zeros(shape)
    with pytest.raises(RuntimeError, match=match):
        fused.load_state_dict(state, strict=False)
    assert_bitwise_equal(fused.state_dict(), before)


def test_stock_moe_experts_of_a_layer_the_model_lacks_are_unexpected(tiny):
    checkpoint = tiny("qwen2_moe")
    fused = checkpoint.load(LINEAR_EXPERTS)
    state = dict(checkpoint.stock().state_dict())
    state["model.layers.7.mlp.experts.gate_up_proj"] = state[GATE_UP]
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "model\.layers\.7\.mlp\.experts'):
        fused.load_state_dict(state)
    assert fused.load_state_dict(state, strict=False).unexpected_keys == ["model.layers.7.mlp.experts.gate_up_proj"]


@pytest.mark.parametrize(
    ("name", "fusion_config"),
    [("llama", FUSED), ("qwen2_moe", {"linear_experts": True})],
)
def test_the_stream_equals_the_saved_files(tiny, tmp_path, name, fusion_config):
    checkpoint = tiny(name)
    model = checkpoint.load(fusion_config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5)  # trained: the stream must read the current values
    modelpatch.save_pretrained(model, tmp_path)
    streamed: dict[str, torch.Tensor] = {}
    for key, tensor in modelpatch.iter_original_state_dict(model):
        assert key not in streamed
        streamed[key] = tensor
    assert_bitwise_equal(streamed, read_tensors(tmp_path))


def _trainer_run(model, data, out_dir, *, max_steps, resume=None, best=False):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",  # the interrupted run stops at step 2: a decaying schedule would differ
        save_steps=2,
        save_strategy="steps",
        eval_strategy="steps" if best else "no",
        eval_steps=2,
        load_best_model_at_end=best,
        metric_for_best_model="loss" if best else None,
        greater_is_better=False if best else None,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data if best else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab_size: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size - 8, (8, 10), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


@pytest.mark.parametrize(
    ("name", "fusion_config"),
    [("llama", FUSED), ("qwen2_moe", {"linear_experts": True}), ("llama", None)],
)
def test_trainer_resume_ends_where_an_uninterrupted_run_ends(tiny, tmp_path, name, fusion_config):
    checkpoint = tiny(name)
    data = _Tokens(checkpoint.vocab_size)
    straight = checkpoint.load(fusion_config)
    _trainer_run(straight, data, tmp_path / "straight", max_steps=4)
    interrupted = checkpoint.load(fusion_config)
    _trainer_run(interrupted, data, tmp_path / "resumed", max_steps=2)
    resumed = checkpoint.load(fusion_config)  # a fresh process would start from the source weights
    _trainer_run(resumed, data, tmp_path / "resumed", max_steps=4, resume=str(tmp_path / "resumed" / "checkpoint-2"))
    assert_bitwise_equal(resumed.state_dict(), straight.state_dict())


def test_load_best_model_at_end_restores_the_best_checkpoint(tiny, tmp_path):
    checkpoint = tiny("llama")
    data = _Tokens(checkpoint.vocab_size)
    model = checkpoint.load(FUSED)
    trainer = _trainer_run(model, data, tmp_path / "run", max_steps=6, best=True)
    best = trainer.state.best_model_checkpoint
    assert best is not None
    expected = checkpoint.model_class.from_pretrained(best)
    assert_bitwise_equal(dict(modelpatch.iter_original_state_dict(model)), expected.state_dict())
