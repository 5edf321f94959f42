"""What a failed checkpoint save says (checkpoint/manager.py): the error it started with, through
the wrapping of megatron's checkpoint writer and torch DCP, and the file system only when the file
system failed. Issue 63, defect 6: an engine's death landing in the save (EngineDied, raised by the
SIGQUIT handler of the time inside megatron's writer) was reported as `RuntimeError: Worker failure:
...` followed by the free space, which read as a disk fault on a healthy disk."""

from __future__ import annotations

import errno
import queue

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint.api import CheckpointException

from vapo_megatron.checkpoint.manager import os_error_of, save_reason
from vapo_megatron.rollout.engine_signals import EngineDied


def _failed_write(tmp_path, error: Exception) -> CheckpointException:
    """`error` raised in one of megatron's writer workers, as megatron's own result check wraps it
    (FileSystemWriterAsync.retrieve_write_results: `RuntimeError("Worker failure: ...") from` it) and
    torch DCP's save reports it (a CheckpointException holding rank 0's wrapped failure)."""
    writer = FileSystemWriterAsync(str(tmp_path))
    writer.write_buckets = [None]  # one worker's bucket: the one that failed
    writer.results_queue = queue.Queue()
    writer.results_queue.put(error)  # what the worker puts there instead of its results
    return CheckpointException("write_data", {0: writer.retrieve_write_results()})


def test_a_save_failure_names_its_first_error_and_blames_the_disk_only_when_the_disk_failed(tmp_path):
    died = _failed_write(tmp_path,
                         EngineDied("SGLang engine of trainer ranks [0] died: one of its processes sent SIGQUIT"))
    assert save_reason(died) == "EngineDied: SGLang engine of trainer ranks [0] died: one of its processes sent SIGQUIT"
    assert os_error_of(died) is None  # no free-space figures in the message (CheckpointManager.save)

    full = _failed_write(tmp_path, OSError(errno.ENOSPC, "No space left on device", "/ckpt/__0_0.distcp"))
    assert save_reason(full) == "No space left on device (errno 28): /ckpt/__0_0.distcp"
    assert os_error_of(full) is not None
