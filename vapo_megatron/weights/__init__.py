"""Weights between Hugging Face and Megatron: one parameter iterator, HF read and write, conversion.

    params.py           the parameter iterator everything shares: each Megatron parameter with its
                        table row and global layer, TP-gathered, as HF-named tensors
    hf_read.py          HF safetensors -> this rank's shards (trainer start, hf-to-mcore)
    hf_write.py         HF directories: shards, index, config, tokenizer files (atomic)
    from_checkpoint.py  a dist checkpoint read as HF tensors in bounded groups (mcore-to-hf)
    convert.py          hf_to_mcore / mcore_to_hf / export_hf_dir: vapo-convert's library part

Every direction goes through the family's name table (model_providers), the same table weight
sync uses (rollout/weight_sync.py).
"""
