"""TEST AND DEMO ONLY: nothing here runs in a production job unless a test or the demo asks.

    faults.py     fault injection at named points (VAPO_FAULT; a no-op without it)
    demo_task.py  the demo's synthetic task, tokenizer and tiny random-init model
    chain_task.py the chain task: worked sums of 2-10 terms, answers of 7-80 tokens, terminal reward
"""
