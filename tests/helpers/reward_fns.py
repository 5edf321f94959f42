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


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("even the message fails")


def hostile(prompt: str, response: str, ground_truth: str):
    """Every way a user reward function can fail, chosen by the response text."""
    import os

    import numpy as np

    if response == "exit":
        raise SystemExit(3)
    if response == "interrupt":
        raise KeyboardInterrupt
    if response == "unprintable":
        raise _Unprintable()
    if response == "die":
        os._exit(7)  # the worker process vanishes mid-task
    if response == "recurse":
        return hostile(prompt, response, ground_truth)
    if response == "memory":
        raise MemoryError("simulated")
    if response == "huge_message":
        raise ValueError("x" * 5_000_000)
    if response == "unpicklable":
        return lambda: 1.0
    if response == "inf":
        return float("inf")
    if response == "np32":
        return np.float32(0.5)
    return response.strip() == ground_truth


def coin(prompt: str, response: str, ground_truth: str):
    """A deterministic coin per response text: an untrained model's groups come out mixed or
    single-valued at random, which gives dynamic sampling both kinds to sort."""
    import zlib

    return zlib.crc32(response.encode()) % 2 == 0
