"""Rollout engines (embedded transformers on the CPU, SGLang on GPUs) and weight sync into them."""
