"""Evaluation: greedy accuracy and the paper's sampled figures (avg@K, pass@k, maj@K).

    metrics.py   pass@k, majority vote, the summary of an evaluation (pure functions)
    sampled.py   greedy_accuracy and sample_eval over all DP ranks (the trainer's periodic eval)
    offline.py   vapo-eval's library part: a saved model on prompt files, outputs written atomically
"""
