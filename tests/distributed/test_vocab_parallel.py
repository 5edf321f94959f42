"""Vocab-parallel log-probs/entropy against torch.log_softmax on the gathered logits."""

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from vapo_megatron.mcore.vocab_parallel import vocab_parallel_logprobs_entropy

V, TEMP = 50, 0.7


def reference(full_logits, targets, weights):
    """log_softmax(logits / T) on the full vocabulary: logp, entropy, d(sum w * logp)/d logits."""
    x = full_logits.detach().double().requires_grad_()
    logsm = torch.log_softmax(x / TEMP, dim=-1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    (logp * weights).sum().backward()
    return logp.detach(), entropy.detach(), x.grad


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    # [S=7, B=3, V] like Megatron's output, passed on as a [B, S, V] transposed view;
    # 21 tokens with chunk_tokens=4: chunks do not divide the token count.
    full = (torch.randn(7, 3, V, generator=g) * 4).to(dtype).transpose(0, 1)
    targets = torch.randint(0, V, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)
    return full, targets, weights


def check_rank(tp):
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(tp, 1)
    rank, size, group = parallel.tp_rank(), parallel.tp_size(), parallel.tp_group()
    assert size == tp
    for dtype in (torch.float32, torch.bfloat16):
        check_dtype(rank, size, group, dtype)
    return True


def check_dtype(rank, size, group, dtype):
    full, targets, weights = inputs(dtype)
    shard_width = V // size
    shard = full[..., rank * shard_width : (rank + 1) * shard_width].detach().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_entropy(
        shard, targets, tp_group=group, vocab_start=rank * shard_width, temperature=TEMP, chunk_tokens=4
    )
    (logp * weights).sum().backward()
    ref_logp, ref_entropy, ref_grad = reference(full, targets, weights)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == (3, 7)
    assert not entropy.requires_grad
    atol = 1e-5 if dtype == torch.float32 else 1e-4  # bf16: same bf16 inputs, float32 math
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=atol)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=atol)
    my_ref_grad = ref_grad[..., rank * shard_width : (rank + 1) * shard_width]
    assert shard.grad.dtype == dtype
    # bf16 gradients are rounded to bf16 (relative 2^-8).
    grad_tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(shard.grad.double(), my_ref_grad, **grad_tol)


def test_tp2_matches_full_vocabulary_fp32_and_bf16():
    assert run_ranks(2, check_rank, 2) == [True, True]


def test_single_process_and_bad_targets():
    full, targets, weights = inputs(torch.float32)
    x = full.detach().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_entropy(x, targets, tp_group=None, vocab_start=0, temperature=TEMP,
                                                    chunk_tokens=5)
    (logp * weights).sum().backward()
    ref_logp, ref_entropy, ref_grad = reference(full, targets, weights)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    _, none = vocab_parallel_logprobs_entropy(x, targets, tp_group=None, vocab_start=0, with_entropy=False)
    assert none is None
    bad = targets.clone()
    bad[1, 2] = V
    with pytest.raises(ValueError, match=f"token id {V} is outside"):
        vocab_parallel_logprobs_entropy(x, bad, tp_group=None, vocab_start=0)


def check_padded(real_vocab):
    """Megatron pads the vocabulary; padded columns (garbage logits here) must not count."""
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(2, 1)
    rank, group = parallel.tp_rank(), parallel.tp_group()
    width = 32  # padded vocabulary 64 over TP=2
    g = torch.Generator().manual_seed(3)
    full = torch.randn(3, 7, 2 * width, generator=g) * 4
    full[..., real_vocab:] = 50.0  # large logits in the padding: any leak dominates the softmax
    targets = torch.randint(0, real_vocab, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)
    shard = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_entropy(
        shard, targets, tp_group=group, vocab_start=rank * width, temperature=TEMP, chunk_tokens=4,
        num_valid=real_vocab - rank * width,
    )
    (logp * weights).sum().backward()
    ref_logp, ref_entropy, ref_grad = reference(full[..., :real_vocab], targets, weights)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    padded_ref = torch.nn.functional.pad(ref_grad, (0, 2 * width - real_vocab))
    torch.testing.assert_close(shard.grad.double(), padded_ref[..., rank * width : (rank + 1) * width], rtol=1e-5,
                               atol=1e-6)
    return True


@pytest.mark.parametrize("real_vocab", [50, 20])  # rank 1 holds some real columns / none at all
def test_vocabulary_padding_is_excluded(real_vocab):
    assert run_ranks(2, check_padded, real_vocab) == [True, True]


@pytest.mark.parametrize("chunk", [8, 100])
def test_plan_counts_the_work_buffer_the_kernel_allocates(chunk):
    """vapo-plan's logprob_buffer_bytes against the largest float32 [rows, V] tensor the kernel
    really creates in forward and backward (every op's output, seen by a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from vapo_megatron.sizing.memory import logprob_buffer_bytes

    class LargestFloat32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2:
                    self.largest = max(self.largest, t.numel() * 4)
            return out

    T, V = 50, 300
    x = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    with LargestFloat32() as mode:
        logp, _ = vocab_parallel_logprobs_entropy(x, targets, tp_group=None, vocab_start=0, chunk_tokens=chunk)
        logp.sum().backward()
    assert mode.largest == logprob_buffer_bytes(T, V, chunk)
