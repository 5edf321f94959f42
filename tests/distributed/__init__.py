"""Tests on real ranks: spawned gloo processes running megatron-core at TP/PP/DP layouts."""
