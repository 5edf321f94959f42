"""Test double of apex/multi_tensor_apply/multi_tensor_apply.py (NVIDIA/apex 6424da3), pure torch.

As Apex has it: `available` says whether the amp_C extension imports (lines 6-13, here the double
tests/doubles/apex/amp_C.py); calling the applier without it raises (lines 15-22); a call passes
its chunk size first, then the noop flag, the tensor lists and the op's own arguments (line 27).
"""

from __future__ import annotations


class MultiTensorApply:
    available = False
    warned = False

    def __init__(self, chunk_size):
        try:
            import amp_C  # noqa: F401

            MultiTensorApply.available = True
            self.chunk_size = chunk_size
        except ImportError as err:
            MultiTensorApply.available = False
            MultiTensorApply.import_err = err

    def check_avail(self):
        if not MultiTensorApply.available:
            raise RuntimeError("Attempted to call MultiTensorApply method, but MultiTensorApply is not available, "
                               "possibly because Apex was installed without --cpp_ext --cuda_ext.  Original import "
                               "error message:", MultiTensorApply.import_err)

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)
