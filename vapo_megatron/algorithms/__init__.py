"""VAPO's math as pure functions of tensors (see ../../shared/VAPO.md and arXiv 2504.05118)."""
