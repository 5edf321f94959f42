"""The learning benchmark (issues 31, 45, 47, 54; docs/benchmarks.md): rows of settings x seeds on
the chain task, trained, evaluated and summarised; or a pre-registered study. One entry point:

    python -m benchmarks.learning --study oracle --out DIR     (--report: the tables from the summaries)

    studies.yaml   the rows (variants), the critics' own trunks and the studies, as data
    variants.py    reads and checks studies.yaml; a row's overrides and the trainer's checks of them
    cli.py         the command: flags, a study's order, --dry-run, --report, the table
    harness.py     the runs: where they live, their records, data, warm starts, training, vapo-eval
    runs.py        what is read and recorded of one run (records, figures, a child that dies with us)
    report.py      tables, paired differences, decision rules, figures
    stats.py       Student's t, Holm, Fieller
    oracle.py      the positive control's oracle critic (launched as scripts/bench_oracle.py)
    credit.py      credit-assignment diagnostics of a finished run with a critic
"""
