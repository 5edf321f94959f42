"""Benchmarks and the tools that read a run, run from the repository's root (`python -m benchmarks.<name>`);
not part of the installed package. Each micro-benchmark prints its figures against a baseline run
side by side in the same process (docs/benchmarks.md; `make bench` runs the first four):

    algo.py             GAE's time and the vocab-parallel log-prob's memory against the usual code (make bench)
    weight_sync.py      weight sync into the embedded engine against a plain memory copy (make bench)
    convert.py          vapo-convert's peak memory and time against the model's size (make bench)
    estimators.py       what the critic costs per step: gae vs grpo on the demo (make bench)
    partial_rollout.py  partial rollout's rollout time per trained sample against the synchronous one
    plan_search.py      vapo-plan --search's time per world size
    startup.py          a trainer rank's start-up CPU time against a plain `import megatron.core`
    peak_rss.py         this process's resident set (VmRSS, VmHWM and its reset): algo.py, weight_sync.py
    learning/           the learning benchmark and its pre-registered studies on the chain task
                        (`python -m benchmarks.learning`, studies as data in learning/studies.yaml)

    plot_metrics.py     a run's curves (RUN_DIR/curves.png; `make demo` draws the demo's)
    demo_report.py      `make demo`'s verdict: held-out accuracy before and after VAPO, the time
"""
