"""Data: prompt files, the run's datasets, rollout batches as tensors, micro-batch planning.

    prompts.py     JSONL / Parquet prompt files ({prompt, answer} or DAPO-Math), bad rows skipped
                   with file:line; the prompt sampler and its resumable position
    datasets.py    the tokenizer and every split of a run, loaded and checked at start-up
    batch.py       RolloutBatch: sequence vs response layouts, prediction positions
    microbatch.py  token-budget micro-batch planning
"""
