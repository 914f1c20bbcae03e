"""
Pipeline parallelism: train.py with the model's blocks split over pp stages, by hand with point-to-point
send/recv. Stage 0 holds the embedding, the last stage the final norm, head and loss; each micro-step's batch
is cut into n_microbatches that flow through the stages. Four schedules, one straight-line function each:
GPipe, 1F1B, Megatron's interleaved 1F1B and the zero-bubble ZB-H1. Composes with data parallelism (world =
dp x pp). A measured step (the first, every --measure_every-th) prints the executed schedules and bubbles.

    torchrun --nproc_per_node=2 pipeline.py --pp=2 --schedule=1f1b --n_microbatches=4
    torchrun --nproc_per_node=4 pipeline.py --pp=2 --gradient_accumulation_steps=2   # dp=2 x pp=2
    python consolidate.py out-pp    # the stage checkpoints in out-pp/ -> out-pp/ckpt.pt, train.py's format
"""

import contextlib
from types import SimpleNamespace

import torch

from common.config import config_defaults, configure
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, outputs_line, profiled, run_main, run_shape, start_run,
                             training_loop)
from common.checkpoints import (CheckpointWriter, gather_rng_states, init_model, init_params, materialize,
                                rank_path, restore_rng, seed_dropout, train_checkpoint)
from common.distributed import clip_grad_norm, finish_distributed, world_size_from_env
from common.model_parallel import (average_gradients, check_pipeline, configure_adamw, embed_comm,
                                   held_pieces, keep_own, print_grid, process_grid)
from model import MoE, balance_routers, moe_loss

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-pp'              # each script its own folder: runs never overwrite one another
init_from = 'scratch'           # 'scratch' or 'resume' (out_dir/ckpt_stage{r}.pt)
sample_at_end = False           # (no sampling here: consolidate, then python sample.py)
dist_timeout = 60               # seconds before a rank gives up on a dead peer
measure_every = 0               # measure and report every this many steps too; 0: the first step only
pp = 2                          # pipeline stages; world size = dp * pp
schedule = '1f1b'               # 'gpipe', '1f1b', 'interleaved' (Megatron's interleaved 1F1B), 'zb1' (ZB-H1)
virtual_stages = 1              # interleaved: model chunks per rank (v non-adjacent groups of layers each)
n_microbatches = 4              # microbatches per micro-step: batch_size sequences cut into this many
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def keep_stage(model, stage, pp_size, virtual_stages=1):
    """Cut the GPT to this stage's part, in place: its blocks (the rest Identity: names stay the whole
    model's), the embedding on stage 0, ln_f and lm_head on the last (tied: two copies, their gradients
    summed, as Megatron does). Returns its chunks of layers (chunk c is virtual stage c·pp + stage)."""
    n = model.config.n_layer // (pp_size * virtual_stages)
    chunks = [range((c * pp_size + stage) * n, (c * pp_size + stage + 1) * n) for c in range(virtual_stages)]
    for i in range(model.config.n_layer):
        if not any(i in chunk for chunk in chunks):
            model.transformer.h[i] = torch.nn.Identity()
    if stage != 0:
        model.transformer['wte'], model.transformer['wpe'] = None, None
    if stage != pp_size - 1:
        model.transformer['ln_f'], model.lm_head = None, None
    return chunks


class Stage:
    """One pipeline stage: its part of the model, its neighbours, what it holds. observer: a measured step's
    (see timed), None on every other step."""

    def __init__(self, model, chunks, index, pp_size, grid_row, act_shape, device, ctx, pp_comm,
                 act_dtype=torch.float32):
        self.model, self.chunks, self.index, self.pp = model, chunks, index, pp_size
        self.is_first, self.is_last = index == 0, index == pp_size - 1  # the embedding / the head and loss
        ring = len(chunks) > 1  # with chunks, a ring: the last stage's chunk c feeds the first's c + 1
        self.prev_rank = None if self.is_first and not ring else int(grid_row[(index - 1) % pp_size])
        self.next_rank = None if self.is_last and not ring else int(grid_row[(index + 1) % pp_size])
        self.act_shape, self.device, self.ctx, self.comm = act_shape, device, ctx, pp_comm
        # the stream between stages: fp32 under autocast, but bf16 where the parameters are (parallel_4d.py's
        # ZeRO in bf16), and the buffers it arrives in must match
        self.act_dtype = act_dtype
        self.embed, self.head = model.embed, model.head  # (parallel_4d.py brings vocabulary-parallel ones)
        # loss_sum: the last stage's losses, and each stage's MoE auxiliary loss
        self.observer, self.loss_sum = None, torch.zeros((), device=device)
        self.held = {}           # microbatch (and chunk) -> what its backward needs; its graph is alive
        self.output_grads = {}   # zb1: microbatch -> its weight modules' output gradients, from B until W
        self.pending_sends = []  # sends not yet complete: each holds its tensor until it is


def timed(stage, op, key=None):
    """Each op of the schedule: F, B or W of a microbatch (key), a send/recv, the whole schedule. A measured
    step's observer (stage.observer, attached by the training loop) records when it ran and what the stage
    holds after it: the schedule's timeline. Every other step runs the op alone."""
    return stage.observer.op(op, key) if stage.observer is not None else contextlib.nullcontext()


# -----------------------------------------------------------------------------
# point-to-point communication: activations go to the next stage, their gradients back to the previous one

def communicate(stage, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
    """Post this stage's sends and receives together (one batch_isend_irecv), wait for the receives; a send
    is waited for at the next exchange, overlapping the compute between. Returns (from_prev, from_next)."""
    with timed(stage, 'send/recv'):
        finish_sends(stage)  # the previous exchange's: their peers have posted the matching receives by now
        # tag 0: activations, tag 1: gradients (on a ring of two stages both go to one peer)
        sends = [(t.detach().contiguous(), peer, tag) for t, peer, tag in
                 ((send_next, stage.next_rank, 0), (send_prev, stage.prev_rank, 1)) if t is not None]
        buffer = lambda: torch.empty(stage.act_shape, dtype=stage.act_dtype, device=stage.device)
        from_prev, from_next = buffer() if recv_prev else None, buffer() if recv_next else None
        recvs = [(t, peer, tag) for t, peer, tag in
                 ((from_prev, stage.prev_rank, 0), (from_next, stage.next_rank, 1)) if t is not None]
        send_works, recv_works = stage.comm.send_recv(sends, recvs)
        for w in recv_works:
            w.wait()
        stage.pending_sends += [(w, t) for w, (t, _, _) in zip(send_works, sends)]
    return from_prev, from_next


def finish_sends(stage):
    for w, _ in stage.pending_sends:
        w.wait()
    stage.pending_sends = []


def recv_forward(stage):
    return None if stage.is_first else communicate(stage, recv_prev=True)[0]


def send_forward(stage, y):
    return None if stage.is_last else communicate(stage, send_next=y)


def recv_backward(stage):
    return None if stage.is_last else communicate(stage, recv_next=True)[1]


def send_backward(stage, dx):
    return None if stage.is_first else communicate(stage, send_prev=dx)


def send_forward_recv_backward(stage, y):  # 1F1B's steady state: an output goes on, a gradient comes back
    return None if stage.is_last else communicate(stage, send_next=y, recv_next=True)[1]


# -----------------------------------------------------------------------------
# one microbatch's forward (F) and backward: whole (B), or (zb1) split into the input's (B) and weights' (W)

def forward_step(stage, i, x, idx, targets, loss_scale, chunk=0, split=False):
    """F of microbatch i (with chunks: i is (microbatch, chunk)): embed or take the received activation, run
    the chunk's blocks, the head and loss after the model's last. Keeps what backward needs (split: with each
    weight module's output, where W starts); returns what to send on (the fp32 residual stream)."""
    model, microbatch = stage.model, i[0] if isinstance(i, tuple) else i
    first, last = stage.is_first and chunk == 0, stage.is_last and chunk == len(stage.chunks) - 1
    with timed(stage, 'F', i), stage.ctx, module_outputs(model, split) as outputs:
        if first:
            x, h = None, stage.embed(idx[microbatch])
        else:
            h = x.requires_grad_(True)
        for layer in stage.chunks[chunk]:
            h = model.run_block(model.transformer.h[layer], h)
        extra = chunk_moe_loss(stage, chunk, loss_scale)  # (MoE: this chunk's auxiliary loss, else None)
        if last:  # the loss (its gradient: the global batch's mean), the last chunk's auxiliary loss in it
            h = stage.head(h, targets[microbatch])[1] * loss_scale + (0 if extra is None else extra)
            extra = None
        if last or extra is not None:
            stage.loss_sum += (h if last else extra).detach()
        stage.held[i] = (x, h, outputs, extra)
    return None if last else h


def chunk_moe_loss(stage, chunk, scale):
    """A mixture of experts: the auxiliary loss of this chunk's MoE layers in the forward just run, their
    part of the model's (moe_loss: a mean over all its MoE layers, whichever stage holds them), times scale;
    None for a dense chunk. Its gradient reaches only these routers: each stage backpropagates its own."""
    blocks, config = [stage.model.transformer.h[i] for i in stage.chunks[chunk]], stage.model.config
    layers = [block.mlp for block in blocks if isinstance(block.mlp, MoE)]
    n_moe = sum(config.is_moe(i) for i in range(config.n_layer))
    return moe_loss(layers, config, n_moe)[0] * scale if layers else None


@contextlib.contextmanager
def module_outputs(model, keep):
    """keep: collect (module, output) from every call of a module that holds weights of its own."""
    outputs = []
    hooks = [m.register_forward_hook(lambda module, _, y: outputs.append((module, y)))
             for m in (model.modules() if keep else ()) if list(m.parameters(recurse=False))]
    yield outputs
    for hook in hooks:
        hook.remove()


def backward_step(stage, i, grad_output, chunk=0):
    """B of microbatch i: backpropagate from its loss or its output's gradient; return its input's."""
    with timed(stage, 'B', i):
        x, out, _, extra = stage.held.pop(i)
        # (out the loss: the schedules receive no gradient for it; extra, a MoE chunk's auxiliary loss)
        roots, root_grads = ([out], [grad_output]) if extra is None else ([out, extra], [grad_output, None])
        torch.autograd.backward(roots, root_grads)
    return None if stage.is_first and chunk == 0 else x.grad


def backward_input_step(stage, i, grad_output):
    """zb1's B of microbatch i: its input's gradient alone, which the previous stage waits for. Asked for no
    weight, autograd skips the weights' matmuls, and gives on its way each weight module's output gradient,
    kept with the graph (retain_graph) for W. A trainable weight that no weight module's forward hook saw
    (none in this repo's models) gets its whole gradient here."""
    with timed(stage, 'B', i):
        x, out, outputs, extra = stage.held[i]
        own = {p for module, _ in outputs for p in module.parameters(recurse=False)}
        rest = [p for p in stage.model.parameters() if p.requires_grad and p not in own]
        inputs = [y for _, y in outputs] + rest + ([] if stage.is_first else [x])
        roots, root_grads = ([out], [grad_output]) if extra is None else ([out, extra], [grad_output, None])
        grads = torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
        for p, g in zip(rest, grads[len(outputs):]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        stage.held[i] = outputs  # each weight module's output, where W starts, and its gradient: W's input
        stage.output_grads[i] = grads[:len(outputs)]
    return None if stage.is_first else grads[-1]


def backward_weight_step(stage, i):
    """zb1's W of microbatch i: each weight module's gradients, by a short backward from its output (with the
    gradient B kept) to its own weights: the matmuls B skipped, the same operations on the same values as a
    whole backward, so the same gradients. Then the microbatch's activations go."""
    with timed(stage, 'W', i):
        for (module, y), dy in zip(stage.held.pop(i), stage.output_grads.pop(i)):
            if dy is not None:
                torch.autograd.backward(y, dy, inputs=list(module.parameters(recurse=False)))


# -----------------------------------------------------------------------------
# the schedules; idx and targets are lists of the m microbatches (only the first and last stage read them)

def gpipe(stage, m, idx, targets, loss_scale):
    """GPipe: every microbatch forward, then every microbatch backward. A stage holds all m microbatches'
    activations; the bubble is (p-1) forward slots at the start plus (p-1) backward slots at the end."""
    for i in range(m):
        send_forward(stage, forward_step(stage, i, recv_forward(stage), idx, targets, loss_scale))
    for i in range(m):
        send_backward(stage, backward_step(stage, i, recv_backward(stage)))


def one_f_one_b(stage, m, idx, targets, loss_scale):
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule). Stage r first does p-r-1 forwards to fill
    the pipeline, then alternates one forward and one backward, then drains the last backwards. GPipe's
    bubble, but a stage never holds more than p-r microbatches' activations."""
    warmup = min(stage.pp - stage.index - 1, m)
    for i in range(warmup):  # warm-up: forwards only
        send_forward(stage, forward_step(stage, i, recv_forward(stage), idx, targets, loss_scale))
    for k in range(m):  # the backward of microbatch k, after the forward of microbatch warmup + k if any
        if warmup + k < m:
            dy = send_forward_recv_backward(stage, forward_step(stage, warmup + k, recv_forward(stage), idx,
                                                                targets, loss_scale))
        else:  # cool-down: the backwards of the last microbatches
            dy = recv_backward(stage)
        send_backward(stage, backward_step(stage, k, dy))


def zero_bubble_h1(stage, m, idx, targets, loss_scale):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split in two: B,
    the gradient of the stage's input, which the previous stage waits for, and W, the weights' gradients,
    which nobody waits for. Stage r runs each W r backwards late, after sending a B's gradient: where 1F1B's
    stage waits for its next input or gradient it computes a W, and its last r W's fill 1F1B's idle cool-down.
    The bubble shrinks from (p-1)(F+B+W) to (p-1)(F+B-W); a microbatch is held until its W, so each stage
    holds p microbatches at most: 1F1B's most, on stage 0."""
    r = stage.index
    warmup = stage.pp - r - 1  # (m >= p: check_pipeline)
    for i in range(warmup):  # warm-up: forwards only, as 1F1B
        send_forward(stage, forward_step(stage, i, recv_forward(stage), idx, targets, loss_scale, split=True))
    for k in range(m):  # B of microbatch k, after the forward of microbatch warmup + k if any is left
        if warmup + k < m:
            dy = send_forward_recv_backward(stage, forward_step(stage, warmup + k, recv_forward(stage), idx,
                                                                targets, loss_scale, split=True))
        else:
            dy = recv_backward(stage)
        send_backward(stage, backward_input_step(stage, k, dy))  # at once: the previous stage waits for it
        if k >= r:
            backward_weight_step(stage, k - r)  # while the neighbours compute what this stage needs next
    for k in range(m - r, m):  # the cool-down, filled
        backward_weight_step(stage, k)


def forward_key(k, p, v):
    """Interleaved 1F1B's k-th forward, (microbatch, chunk): groups of p microbatches, each through one chunk,
    then the next chunk."""
    group, place = divmod(k, p * v)
    return group * p + place % p, place // p


def backward_key(k, p, v):
    """Its k-th backward: the same microbatches, through the chunks in reverse order."""
    microbatch, chunk = forward_key(k, p, v)
    return microbatch, v - 1 - chunk


def input_arriving(k, p, v, r, warmup):
    """Interleaved 1F1B's steady step k on stage r: the chunk whose input comes with its exchange, or None.
    Stage r > 0 gets the previous stage's output: the input of its own next forward. Stage 0's comes around
    the ring from the last stage, p - 1 forwards behind it: the output of its chunk c is the input of chunk
    c + 1 here (its last chunk's output is the loss: nothing comes)."""
    if r > 0:
        return forward_key(k + warmup + 1, p, v)[1]
    chunk = forward_key(k + warmup - (p - 1), p, v)[1] + 1
    return chunk if chunk < v else None


def gradient_arriving(k, p, v, r):
    """Its steady step k on stage r: the chunk whose output gradient comes with the exchange, or None. Stage
    r < p - 1 gets the next stage's input gradient: the one its own next backward needs. The last stage's
    comes around the ring from stage 0, p - 1 backwards behind it: the gradient of its chunk c's input is
    that of chunk c - 1's output here (chunk 0's input is the embedding: nothing comes)."""
    if r < p - 1:
        return backward_key(k + 1, p, v)[1]
    chunk = backward_key(k - (p - 1), p, v)[1] - 1
    return chunk if chunk >= 0 else None


def interleaved_1f1b(stage, m, idx, targets, loss_scale):
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v chunks per stage, chunk c of stage r virtual
    stage c·p + r, a microbatch goes round the ring v times (forward_key, backward_key: the order). Warm-up
    2(p-r-1) + (v-1)·p forwards, then 1F1B, then the rest of the backwards; what arrives queues per chunk
    (input_arriving, gradient_arriving: which chunk an exchange brings). Bubble / v."""
    p, v, r = stage.pp, len(stage.chunks), stage.index
    total, warmup = m * v, min(2 * (p - r - 1) + (v - 1) * p, m * v)
    inputs, grads = [[] for _ in range(v)], [[] for _ in range(v)]  # arrived, waiting for their F / B

    def forward(k):  # (the embedding's chunk takes no input; forward_step sends nothing from the loss's)
        key = forward_key(k, p, v)
        x = None if r == 0 and key[1] == 0 else inputs[key[1]].pop(0)
        return forward_step(stage, key, x, idx, targets, loss_scale, key[1])

    def backward(k):
        key = backward_key(k, p, v)
        dy = None if r == p - 1 and key[1] == v - 1 else grads[key[1]].pop(0)
        return backward_step(stage, key, dy, key[1])

    inputs[0] += [communicate(stage, recv_prev=True)[0]] if r != 0 else []
    for k in range(warmup):  # warm-up: forwards only (the last one also receives the first gradient)
        y, chunk = forward(k), forward_key(k + 1, p, v)[1]  # (none after the last, nor the embedding's)
        chunk = None if k == total - 1 or (r == 0 and chunk == 0) else chunk
        first_gradient = k == warmup - 1 and warmup < total and r != p - 1
        x, dy = communicate(stage, send_next=y, recv_prev=chunk is not None, recv_next=first_gradient)
        if chunk is not None:
            inputs[chunk].append(x)
        if first_gradient:
            grads[v - 1].append(dy)
    for k in range(total - warmup):  # steady state: forward k + warmup, backward k, one exchange both ways
        y, dx = forward(k + warmup), backward(k)
        chunk = input_arriving(k, p, v, r, warmup) if k != total - warmup - 1 else None  # (the last F ran)
        grad_chunk = gradient_arriving(k, p, v, r)
        x, dy = communicate(stage, send_next=y, send_prev=dx, recv_prev=chunk is not None,
                            recv_next=grad_chunk is not None)
        if chunk is not None:
            inputs[chunk].append(x)
        if grad_chunk is not None:
            grads[grad_chunk].append(dy)
    if warmup == total and r != p - 1:  # cool-down: the remaining backwards
        grads[v - 1].append(communicate(stage, recv_next=True)[1])
    for k in range(total - warmup, total):
        grad_chunk = backward_key(k + 1, p, v)[1]  # (none after the last, nor the loss's chunk's)
        grad_chunk = None if k == total - 1 or (r == p - 1 and grad_chunk == v - 1) else grad_chunk
        _, dy = communicate(stage, send_prev=backward(k), recv_next=grad_chunk is not None)
        if grad_chunk is not None:
            grads[grad_chunk].append(dy)


SCHEDULES = {'gpipe': gpipe, '1f1b': one_f_one_b, 'interleaved': interleaved_1f1b, 'zb1': zero_bubble_h1}


def run_schedule(stage, name, m, x, y, loss_scale):
    """Split the micro-step's batch into m microbatches and run the schedule."""
    with timed(stage, 'schedule'):
        SCHEDULES[name](stage, m, list(x.chunk(m)), list(y.chunk(m)), loss_scale)
        finish_sends(stage)


@torch.no_grad()
def forward_loss(stage, x, y, m):
    """The mean loss of a batch, forward only through the stages (for estimate_loss), on every rank: the
    mean of its m microbatches' (the tokens a mixture of experts routes together are a microbatch's)."""
    stage.act_shape = (x.size(0) // m,) + tuple(stage.act_shape[1:])
    model, loss = stage.model, torch.zeros((), device=stage.device)
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        for chunk, layers in enumerate(stage.chunks):  # chunk c of every stage, then chunk c + 1 of each
            first, last = stage.is_first and chunk == 0, stage.is_last and chunk == len(stage.chunks) - 1
            h = stage.embed(xm) if first else communicate(stage, recv_prev=True)[0]
            with stage.ctx:
                for layer in layers:
                    h = model.run_block(model.transformer.h[layer], h)
                extra = chunk_moe_loss(stage, chunk, 1 / m)
                loss += 0 if extra is None else extra.float()
                if last:
                    loss += stage.head(h, ym)[1].float() / m
            if not last:
                communicate(stage, send_next=h)
    finish_sends(stage)
    stage.comm.all_reduce(loss, kind='scalars')  # summed over the stages: the head's loss and each's aux
    return loss


def train_step(stage, optimizer, batches, cfg, dp, embed):
    """One iteration: the schedule over each micro-step, then the gradients averaged over dp, the tied
    embedding's two copies summed, the clip over every stage. Returns the mean loss over the global batch."""
    model = stage.model
    stage.loss_sum = torch.zeros((), device=cfg.device)
    stage.act_shape = (cfg.batch_size // cfg.n_microbatches, cfg.block_size, model.config.n_embd)
    for x, y in batches:
        run_schedule(stage, cfg.schedule, cfg.n_microbatches, x, y, 1.0 / (cfg.n_microbatches * len(batches)))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    average_gradients(model.parameters(), dp)  # data parallel: a stage over its column of the grid
    if embed is not None:  # the tied weight's two copies: sum the embedding's and the head's gradient
        embed.all_reduce(model.transformer.wte.weight.grad if stage.is_first else model.lm_head.weight.grad)
    if cfg.grad_clip != 0.0:  # the norm over every stage, a tied weight once (the last stage's copy left out)
        tied = model.lm_head.weight.grad if embed is not None and stage.is_last else None
        clip_grad_norm(grads, cfg.grad_clip, [stage.comm], [(g, float(g is not tied)) for g in grads])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    balance_routers(model, lambda loads: dp.summed(loads, 'router loads'))  # (each stage its layers)
    loss_sum = stage.loss_sum.clone()  # the head's loss (and each stage's MoE aux): over the stages, then dp
    stage.comm.all_reduce(loss_sum, kind='scalars')
    dp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp.size


def build(cfg, rank, world_size, vocab_size):
    """The dp x pp grid; train.py's GPT on the meta device cut to this stage, which alone gets storage and
    values (train.py's, or its checkpoint's); its dropout stream (per replica and stage) and AdamW."""
    grid, coords, comms = process_grid(world_size, rank, dp=world_size // cfg.pp, pp=cfg.pp)
    dp, pp_comm = comms['dp'], comms['pp']
    ckpt_path = rank_path(cfg.out_dir, STAGE_FILE, pp_comm.rank)
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, gpt2=False, meta=True)
    embed = embed_comm(grid, rank, model.config.tie_embeddings)  # (on a resume, the checkpoint's)
    n_params, flops_per_token = model.get_num_params(), model.flops_per_token(cfg.block_size)  # (whole model)
    chunks = keep_stage(model, pp_comm.rank, cfg.pp, cfg.virtual_stages)  # on the meta device: shapes only
    materialize(model, cfg.device)  # storage for this stage's part alone
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
        restore_rng(checkpoint, dp.rank, dp.size, cfg.seed, dp.rank, pp_comm.rank)
    else:
        init_params(model.config, cfg.seed, keep_own(model))
        seed_dropout(cfg.seed, dp.rank, pp_comm.rank)
    print_grid(grid, coords, {'dp': dp, 'pp': pp_comm, 'embed': embed}, rank, dims=('dp', 'pp'))
    if rank == 0:
        print(run_shape(f"world {world_size} = dp {dp.size} x pp {cfg.pp}, {model.config.n_layer // cfg.pp} "
                        f"blocks per stage in {cfg.virtual_stages} chunk(s), {cfg.schedule} over "
                        f"{cfg.n_microbatches} microbatches of {cfg.batch_size // cfg.n_microbatches}", cfg,
                        n_params, model.config.n_expert))
    stage = Stage(model, chunks, pp_comm.rank, cfg.pp, grid[coords['dp'], :, coords['cp'], coords['tp']],
                  (cfg.batch_size // cfg.n_microbatches, cfg.block_size, model.config.n_embd), cfg.device,
                  autocast_context('cuda' if cfg.device.startswith('cuda') else 'cpu', cfg.dtype), pp_comm)
    return stage, configure_adamw(model, cfg, checkpoint), dp, embed, iter_num, best_val_loss, flops_per_token


# -----------------------------------------------------------------------------
# checkpoints: one file per stage, its parameters under the whole model's names; consolidate() joins them

STAGE_FILE = 'ckpt_stage{}.pt'


def save_stage(writer, stage, optimizer, dp, iter_num, best_val_loss, cfg):
    """This stage's part in train.py's format (its parameters by their names in the whole model), every
    replica's dropout stream, and its pieces for consolidate.py: its parameters whole (a tied head's is the
    first stage's embedding). Data-parallel rank 0 writes it: the replicas hold the same."""
    rng_states = gather_rng_states(dp)
    if dp.rank == 0:
        tied = stage.model.config.tie_embeddings
        cut = lambda name, p: None if tied and name == 'lm_head.weight' else (name, p.shape, None)
        checkpoint = train_checkpoint(stage.model.state_dict(), optimizer.state_dict(), rng_states,
                                      vars(stage.model.config), iter_num, best_val_loss, vars(cfg))
        checkpoint.update(pieces=held_pieces(stage.model, optimizer, cut, True), files=(STAGE_FILE, cfg.pp),
                          grid={'pp': cfg.pp, 'virtual_stages': cfg.virtual_stages}, dp_rank=None)
        writer.save(checkpoint, rank_path(cfg.out_dir, STAGE_FILE, stage.index), iter_num)


def main(argv):
    cfg = configure(config, argv)
    check_pipeline(cfg, world_size_from_env(), STAGE_FILE, SCHEDULES)  # refusals: common/model_parallel.py
    rank, world_size = start_run(cfg)
    data, vocab_size = load_dataset(cfg.dataset)
    stage, optimizer, dp, embed, iter_num, best_val_loss, flops = build(cfg, rank, world_size, vocab_size)
    writer = CheckpointWriter(cfg.max_iters)
    step = lambda it: train_step(stage, optimizer, micro_batches(data, cfg, it, dp.rank, dp.size), cfg, dp,
                                 embed)
    training_loop(cfg, SimpleNamespace(
        model=stage.model, optimizer=optimizer, dp=dp,
        loss_of=lambda x, y: forward_loss(stage, x, y, cfg.n_microbatches),
        data=data, step=step, save=lambda it, best: save_stage(writer, stage, optimizer, dp, it, best, cfg),
        flops_per_token=flops, n_devices=world_size, rank=rank,
        kind='pipeline', stage=stage, comms=[c for c in (dp, stage.comm, embed) if c]),
        iter_num, best_val_loss)
    writer.wait()
    if rank == 0:
        print(outputs_line(cfg.out_dir, f"ckpt_stage*.pt (resume; python consolidate.py {cfg.out_dir}: one "
                           "ckpt.pt)", "schedule_trace.json (the last measured schedule)", *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
