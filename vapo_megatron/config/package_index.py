"""Which distribution provides which top-level package, without a stat per installed file.

transformers (5.x, utils/import_utils.py) calls `importlib.metadata.packages_distributions()` when
it is imported, in every rank of every command. For a distribution without a top_level.txt (torch's
wheel has none, nor do numpy's, wandb's, matplotlib's...) Python 3.12 infers the names from the
RECORD: it builds a path object for each of the ~15,000 listed files of torch alone and stats each
one (`skip_missing_files`). That is about 1 s of CPU per process here, a tenth of a rank's start-up,
and on a cluster's shared filesystem it is 15,000 metadata lookups per rank at once.

`install()` replaces that function, for this process, with `packages_distributions`, which reads
the same files (top_level.txt, else RECORD) and takes each RECORD entry's first path component as
the standard library does, without checking that the file is on disk. On an intact installation the
answer is the same mapping (the suite compares the two on its environment);
a RECORD listing files that were since deleted names a package that is gone, which only makes a
library believe an uninstalled optional package is there, as a damaged install does anyway.
"""

from __future__ import annotations

import collections
import csv
import importlib.metadata
import inspect


def _top_level(dist: importlib.metadata.Distribution) -> list[str]:
    declared = (dist.read_text("top_level.txt") or "").split()
    if declared:
        return declared
    record = dist.read_text("RECORD")
    if not record:  # as the standard library: no RECORD (an egg-info), nothing inferred
        return []
    names = set()
    for row in csv.reader(record.splitlines()):
        if not row:
            continue
        parts = row[0].split("/")
        name = parts[0] if len(parts) > 1 else inspect.getmodulename(parts[0])
        if name and "." not in name:  # e.g. foo-1.0.dist-info, ../../bin: not importable
            names.add(name)
    return sorted(names)


def packages_distributions() -> dict[str, list[str]]:
    """importlib.metadata.packages_distributions()'s mapping (top-level name -> distribution names)."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for dist in importlib.metadata.distributions():
        for name in _top_level(dist):
            out[name].append(dist.metadata["Name"])
    return dict(out)


def install() -> None:
    """importlib.metadata.packages_distributions becomes the function above, for this process."""
    importlib.metadata.packages_distributions = packages_distributions


__all__ = ["install", "packages_distributions"]
