"""User reward functions for tests/test_rewards.py (imported by spawned reward workers)."""

import time


def flaky(prompt: str, response: str, ground_truth: str):
    if response == "boom":
        raise ValueError("user function exploded")
    if response == "key":
        raise KeyError("missing")
    if response == "none":
        return None
    if response == "slow":
        time.sleep(60)
    if response.startswith("partial"):
        return float(response.split()[1])
    return response.strip() == ground_truth
