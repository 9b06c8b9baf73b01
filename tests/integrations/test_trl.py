"""TRL's recipe on fused models: ``trl.SFTTrainer(model=<fused>, peft_config=LoraConfig(target_modules="all-linear"))``
(TRL calls stock ``peft.get_peft_model`` itself) is refused by name with the remedy, before any adapter layer exists;
the remedy (the model ``modelpatch.get_peft_model`` adapted, given to the trainer without a ``peft_config``) trains.
"""

from __future__ import annotations

import datasets
import pytest
import tokenizers
import torch
import trl
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer

import modelpatch
from modelpatch.errors import PeftIntegrationError
from support.models import VOCAB

REFUSED = r"'all-linear' would adapt the fused layers .*modelpatch\.get_peft_model.*modelpatch\.load_adapter"


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB)}
    model = tokenizers.models.WordLevel(vocab=words, unk_token="w0")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", pad_token="w1", eos_token="w2")


def _trainer(model, tmp_path, peft_config=None):
    texts = [" ".join(f"w{(3 + i * 7 + j) % (VOCAB - 3) + 3}" for j in range(10)) for i in range(4)]
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True, seed=0
    )
    return trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=_tokenizer(),
        peft_config=peft_config,
    )


# llama: fused projections; qwen2_moe: the experts of linear_experts alone.
@pytest.mark.parametrize(
    "name, fusion_config", [("llama", {"qkv": True, "gate_up": True}), ("qwen2_moe", {"linear_experts": True})]
)
def test_sft_trainer_all_linear_on_a_fused_model_is_refused_with_the_remedy(tiny, tmp_path, name, fusion_config):
    model = tiny(name).load(fusion_config)
    with pytest.raises(PeftIntegrationError, match=REFUSED):
        _trainer(model, tmp_path, LoraConfig(r=4, target_modules="all-linear"))
    assert not any(isinstance(module, BaseTunerLayer) for module in model.modules())

    # The remedy: the adapted model, given to the trainer as it is.
    adapted = modelpatch.get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in adapted.named_parameters() if p.requires_grad}
    _trainer(adapted, tmp_path).train()
    after = dict(adapted.named_parameters())
    assert any(not torch.equal(after[n], p) for n, p in before.items()), "one step changed the adapter"
