"""Test doubles of the GPU nodes' libraries (never shipped): pure-torch stand-ins for what
megatron-core imports from Transformer Engine (te/transformer_engine) and Apex (apex/apex), put
first on PYTHONPATH by tests/helpers/worlds.py to run megatron-core's TE and Apex branches on the CPU.

    fused_adam_math.py   the arithmetic of both libraries' multi_tensor_adam kernel
"""
