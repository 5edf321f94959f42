"""TEST AND DEMO ONLY: no module of the package imports these (tests/unit/test_layout.py); the tests
and the demo's scripts (scripts/make_demo_data.py) do.

    demo_task.py  the demo's synthetic task, tokenizer and tiny random-init model
    chain_task.py the chain task: worked sums of 2-10 terms, answers of 7-80 tokens, terminal reward
"""
