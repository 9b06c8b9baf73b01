"""``modelpatch.iter_original_state_dict``: peak memory added while streaming a fused model's original layout.

A ~400 MB (bf16) Llama-shaped model (``fuse_live.py``'s) is written with stock ``save_pretrained``, loaded fused
(``qkv`` + ``gate_up``) with ``modelpatch.from_pretrained``, its tensors moved into process memory (as after training),
then streamed to a consumer that copies every tensor into weights it holds, as an inference engine's
``load_weights`` does.
Reported: the peak resident memory added during the stream (sampled every millisecond from /proc), beside the
largest conversion group (one layer's ``gate_up_proj``) and the whole model. The target: about one group, not the model.
``--lora``: the model carries a LoRA adapter (``"all-linear"``, r=16) and its merged weights are streamed, beside the
one route before (a merged copy: ``copy.deepcopy(peft_model).merge_and_unload()``, then its stream).

Usage::

    python benchmarks/stream.py            # ~400 MB model
    python benchmarks/stream.py --quick    # tiny model, to check the script itself
    python benchmarks/stream.py --lora     # a LoRA model's merged weights
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile

from fuse_live import FUSIONS, LLAMA, LLAMA_QUICK, PeakRss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model")
    parser.add_argument("--lora", action="store_true", help="a LoRA model's merged weights, beside a merged copy's")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import modelpatch

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**(LLAMA_QUICK if args.quick else LLAMA), dtype="bfloat16")).to(
            torch.bfloat16
        ).save_pretrained(tmp)
        model = modelpatch.from_pretrained(AutoModelForCausalLM, tmp, fusion_config=FUSIONS)
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()  # in process memory, not views of the mapped file
        total = sum(t.nbytes for t in model.state_dict().values())
        group = max(layer.mlp.gate_up_proj.weight.nbytes for layer in model.model.layers)
        if args.lora:
            from peft import LoraConfig

            lora = LoraConfig(r=16, target_modules="all-linear", init_lora_weights=False)
            model = modelpatch.get_peft_model(model, lora)
        # The consumer: an engine copying each tensor into weights it already holds (allocated and touched before
        # measuring: zeros, not empty, whose pages would be committed by the first copy).
        engine = {name: torch.zeros_like(tensor) for name, tensor in modelpatch.iter_original_state_dict(model)}
        with PeakRss() as rss:
            for name, tensor in modelpatch.iter_original_state_dict(model):
                engine[name].copy_(tensor)
                del tensor
        result = {
            "model_bytes": total,
            "largest_group_bytes": group,
            "stream_peak_added_bytes": rss.peak - rss.start,
            "tensors": len(engine),
        }
        if args.lora:
            with PeakRss() as rss:
                merged = copy.deepcopy(model).merge_and_unload()
                for name, tensor in modelpatch.iter_original_state_dict(merged):
                    engine[name].copy_(tensor)
                    del tensor
                del merged
            result["merged_copy_peak_added_bytes"] = rss.peak - rss.start
        print(json.dumps(result))


if __name__ == "__main__":
    main()
