"""Test doubles of the GPU nodes' libraries, in pure torch, never shipped: te/ (Transformer Engine)
and apex/ (Apex), each put first on PYTHONPATH by tests/helpers/worlds.py in its world's processes;
fused_adam_math.py, the Adam kernel both libraries' FusedAdam doubles share."""
