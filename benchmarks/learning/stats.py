"""The statistics of a study with several primary comparisons (issue 54; report.py).

    t_quantile(df)               t(0.975, df), the two-sided 95% critical value
    t_test(values)               (mean, 95% interval, two-sided p) of paired differences against 0
    holm(pvalues)                Holm's step-down adjusted p-values (family-wise error, any dependence)
    fieller(num, den)            the ratio mean(num) / mean(den) of paired differences and its 95% Fieller interval

The Student-t distribution comes from mpmath's regularized incomplete beta (mpmath is installed with
sympy, which math-verify needs), not from a hand-written series.
"""

from __future__ import annotations

import functools
import math
import statistics


def t_sf2(t: float, df: int) -> float:
    """Two-sided tail P(|T| >= |t|) of Student's t with df degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    import mpmath

    return float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


@functools.cache  # a report asks for the same few df hundreds of times, each 60 betainc calls
def t_quantile(df: int, level: float = 0.95) -> float:
    """The t such that P(|T| >= t) = 1 - level (bisection on t_sf2; monotone in t)."""
    lo, hi = 0.0, 1000.0
    for _ in range(60):  # 1000 / 2^60: far below any digit printed
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf2(mid, df) > 1 - level else (lo, mid)
    return (lo + hi) / 2


def t_test(values: list[float]) -> tuple[float, float, float, float] | None:
    """(mean, low, high, p): the mean of paired differences, its 95% t-interval and the two-sided
    p-value of mean = 0; None for fewer than 2 values. p = 1 when every difference is 0."""
    n = len(values)
    if n < 2:
        return None
    m, sd = statistics.fmean(values), statistics.stdev(values)
    se = sd / math.sqrt(n)
    half = t_quantile(n - 1) * se
    p = 1.0 if se == 0 and m == 0 else 0.0 if se == 0 else t_sf2(m / se, n - 1)
    return m, m - half, m + half, p


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's adjusted p-values: sorted ascending, p_(i) x (m - i + 1), made monotone, capped at 1.
    A comparison resolves at family-wise level alpha when its adjusted p is below alpha."""
    order = sorted(pvalues, key=pvalues.get)
    m, out, running = len(order), {}, 0.0
    for i, key in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[key]))
        out[key] = running
    return out


def fieller(num: list[float], den: list[float]) -> tuple[float, float | None, float | None]:
    """(ratio, low, high) of mean(num) / mean(den) for paired per-seed values, with the 95% Fieller
    interval: every theta for which the paired t-test of num - theta x den does not reject 0 at 5%.
    (None, None) bounds when that set is unbounded (the denominator's own interval contains 0)."""
    n = len(num)
    if n != len(den) or n < 2:
        raise ValueError(f"fieller: needs two paired lists of at least 2 values, got {len(num)} and {len(den)}")
    a, b = statistics.fmean(num), statistics.fmean(den)
    saa, sbb = statistics.variance(num) / n, statistics.variance(den) / n
    sab = statistics.covariance(num, den) / n
    t2 = t_quantile(n - 1) ** 2
    qa, qb, qc = b * b - t2 * sbb, a * b - t2 * sab, a * a - t2 * saa  # qa x th^2 - 2 qb x th + qc <= 0
    ratio = a / b if b else math.inf
    if qa <= 0:
        return ratio, None, None
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))
    return ratio, (qb - root) / qa, (qb + root) / qa
