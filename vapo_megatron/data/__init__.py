"""Data: prompt files, the run's datasets, rollout batches as tensors, micro-batch planning.

    prompts.py     JSONL / Parquet prompt files ({prompt, answer} or DAPO-Math), bad rows skipped
                   with file:line; the prompt sampler and its resumable position
    datasets.py    the tokenizer and every split of a run, loaded and checked at start-up
    model_files.py a model directory's tokenizer, chat template and generation config, loaded once
                   by every command's checks (a file that parses but does not load: one line)
    batch.py       RolloutBatch: sequence vs response layouts, prediction positions
    microbatch.py  token-budget micro-batch planning
    routes.py      routing replay's data: the experts each token was routed to (MoE models)
    carry_over.py  partial rollout's groups in flight between steps, and their checkpoint file
"""
