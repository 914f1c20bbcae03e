"""
ZeRO stage 3's other half (zero.py has the rest): the parameters sharded. At rest a rank keeps only its chunk
of each block's flat bucket; a block's parameters are all-gathered just before its forward and freed just
after, gathered again just before its backward and freed once backward has made all its gradients, as their
reduce-scatter is posted (zero.reduce_stage_3). The root bucket (embeddings, final norm, head) is gathered
for the whole forward and again for the whole backward. So a rank holds the root and one block in full (k
more with prefetching), plus its chunk of the rest: the 1/N of stage 3, paid for with a second all-gather per
block per micro-step.

With prefetch_blocks = k the gathers of the next k blocks (in forward order during forward, in backward order
during backward) are posted while this block computes, as FSDP's and DeepSpeed's prefetching do: the wait
moves off the critical path, and k more blocks' parameters are held at the peak.

z is zero.py's engine (Zero: its comm, buckets and prefetch_blocks), b one of its Buckets (flat: the block's
parameters, laid end to end; shard: this rank's chunk of them). Run it: torchrun ... zero.py --stage=3
"""

import torch

from common.distributed import all_gather_direct, return_freed_buffers_to_the_os


def block_groups(model, named):
    """The buckets' (name, parameter) groups, in the order backward reaches them: one per block, the last
    block's first, then one for the rest (embeddings, final norm, head), which the whole model uses."""
    blocks = [list(block.named_parameters(prefix=f'transformer.h.{i}'))
              for i, block in enumerate(model.transformer.h)]
    in_blocks = {id(p) for group in blocks for _, p in group}
    return blocks[::-1] + [[(n, p) for n, p in named if id(p) not in in_blocks]]


def start_sharded(b):
    """A new bucket's stage-3 state, and its full buffer freed: at rest a rank keeps only its chunk, b.shard.
    gathered: flat holds the parameters now (free sets it); gathering: the gather filling flat (posted, not
    yet waited for); in_backward: the block's backward has begun (a recomputation must not free it then)."""
    b.gathering, b.in_backward = None, False
    free(b)


def end_backward(b):
    """Backward is over: every bucket freed (the root's was kept through it), ready for the next forward."""
    b.in_backward = False
    free(b)


def start_gather(z, b):
    """Give the bucket its full storage back and post the all-gather into it (asynchronously)."""
    if not b.gathered and b.gathering is None:
        b.flat.untyped_storage().resize_(b.padded * b.flat.element_size())
        # write through .data: the gather is not an autograd in-place op on the views saved for backward.
        # (all_gather_direct: on gloo, sends and receives straight into flat, no full-size temporary)
        b.gathering = all_gather_direct(z.comm, b.flat.data, b.shard, tag=z.buckets.index(b))


def gather(z, b, order=()):
    """The bucket's parameters, complete (posted now unless a prefetch did, and waited for); then the gathers
    of the prefetch_blocks buckets after b in `order` posted."""
    start_gather(z, b)
    wait_gather(b)
    b.gathered = True
    i = order.index(b) if b in order else len(order)
    for nxt in order[i + 1:i + 1 + z.prefetch_blocks]:
        start_gather(z, nxt)


def wait_gather(b):
    for work in b.gathering or ():
        work.wait()
    b.gathering = None


def free(b):
    # the views (p.data) and the tensors autograd saved keep pointing at this storage; it just holds no bytes
    # until the next gather refills it
    wait_gather(b)
    b.flat.untyped_storage().resize_(0)
    b.gathered = False


def after_forward(z, b, out):
    """A block's forward (or the whole model's: out is the loss) is over: free its parameters, and hook its
    output's gradient. Every node of the block's backward hangs below that output, so the hook runs first: the
    place to all-gather them again, just in time. A recomputation (activation checkpointing) keeps them."""
    if not b.in_backward:
        free(b)
        if out is not None and torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: before_backward(z, b))
    return out


def before_backward(z, b):
    """The gradient of b's output has arrived: gather b for its backward, and prefetch the next blocks."""
    b.in_backward = True
    gather(z, b, z.backward_order)


def install_stage_3_hooks(z, model):
    """Each block gathers its bucket before its forward (prefetching the blocks after it) and frees it after;
    the root bucket (embeddings, final norm, head) is gathered for the whole model's forward."""
    return_freed_buffers_to_the_os()  # (host memory; stages 0-2 free no block-sized buffers: it'd slow them)
    *blocks, root = z.buckets  # in backward order: the last block's first
    z.backward_order, forward = [root] + blocks, [root] + blocks[::-1]  # (the root's gather prefetches too)
    for block, b in zip(model.transformer.h, forward[1:]):
        # (a recomputation inside backward prefetches nothing: the blocks after it have run backward)
        block.register_forward_pre_hook(lambda m, a, b=b: gather(z, b, () if b.in_backward else forward))
        block.register_forward_hook(lambda m, a, out, b=b: after_forward(z, b, out))
    model.register_forward_pre_hook(lambda m, args: gather(z, root, forward))
    model.register_forward_hook(lambda m, args, out: (out[0], after_forward(z, root, out[1])))
