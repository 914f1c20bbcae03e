"""
A step's time, predicted (modelled) from the model's FLOPs and this machine's measured rates, never from the
run it is compared with; bench.py prints it beside every row's measured ms/step. The rates are measured and
kept by common/machine_rates.py (its functions named below).

- compute: for every forward and backward pass a rank makes (a micro-batch; a pipeline stage's slot: 1/p of
  one), the ops' fixed cost, plus the training FLOPs (model.flops_per_token) of the tokens it computes at the
  rate one process with a rank's threads measured on the model (machine_rates.measure_compute), plus the
  update (clip, AdamW) of its share of the model. zero.py's stage 3 and train_fsdp.py map each buffer of 1 MB
  or more afresh (distributed.return_freed_buffers_to_the_os), so its pages fault in again: they are priced
  at rates measured so (machine_rates.measure_mapped), plus the fresh buffers their own code fills. ep,
  tp_moe: their busiest rank's experts. cp_ring's attention: the ring's own blocks and merges, timed alone on
  a layer (machine_rates.ring_attention_seconds), in place of its FLOPs at the model's rate; tp's and tp_sp's
  passes: a rank's pass on its slices timed alone (machine_rates.tp_pass_seconds), in place of the pass's
  fixed cost and its FLOPs at the model's rate (narrower matmuls; g copies the activations, f their grads);
  fsdp's pass and update: an FSDP2 rank's timed alone in a world of one (machine_rates.fsdp_seconds: its
  hooks, its copies in and out, its DTensors' dispatch in the update);
- communication: each collective the strategy makes in a step, counted from the scripts (row_work), at the
  time a short sweep measured for that kind of call (the mean of calls each posted after some compute, as in
  training; ' burst': posted back to back, as a ZeRO engine posts its buckets), linear between the sizes
  measured: a latency, then a bandwidth; and each call inside the step (not a burst) waits for the slower
  rank as long as the sweep measured after the compute that comes before it, the compute a rank does spread
  evenly over those calls (machine_rates.waits_after_compute); a pipeline's calls wait on its schedule
  instead, priced as its slots (pipeline_work);
- a pipeline's bubble: each schedule takes m + p - 1 slots of one micro-batch's forward and backward.
On a CPU whose cores all compute, gloo's threads need the same cores, so nothing overlaps: the times add.
Priced: fp32 on a CPU (the MoE rows at the MoE model's own compute rates, machine_rates.moe_rates).

A planned strategy's step on a GPU cluster, for bench.py --estimate, is common/cluster_time.py's.
"""

import os
import statistics

import torch

from common import formulas
from common.distributed import default_bucket_size
from common.machine_rates import crowded_rates, machine_rates, moe_rates
from model import GPT, GPTConfig

MOE_ROWS = ('train_moe', 'ep', 'tp_moe')  # bench rows priced on the bench's MoE model


def call_seconds(table, nbytes):
    """A call's seconds at nbytes from the sweep's [(bytes, seconds)], sizes ascending: the smallest's time
    (the latency) below it, linear between the two sizes around it, along the last segment beyond the largest
    (never less than the segment's first time: a noisy sweep can measure a larger call faster)."""
    i = 1
    while i < len(table) - 1 and nbytes > table[i][0]:
        i += 1
    (n0, t0), (n1, t1) = table[i - 1], table[i]
    return max(t0, t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0))


# -----------------------------------------------------------------------------
# What each bench row computes and sends in one step, per rank (the busiest)

def ddp_buckets(nbytes, first=1 << 20, cap=25 << 20):
    """Bucket sizes in bytes, torch DDP's by default: the first 1 MiB (its all-reduce starts early), then 25
    MiB each."""
    sizes, left = [], nbytes
    while left > 0:
        sizes.append(min(left, first if not sizes else cap))
        left -= sizes[-1]
    return sizes


def row_work(name, config, batch_size, world_size, n_microbatches, expert_share=None):
    """What one rank of a bench row does in a step: FLOPs of forward and backward (with a pipeline's bubble:
    pipeline_work), the share of the model it updates (clip, AdamW), and its collectives [(kind, bytes a call,
    calls)]; None for a row not priced here. The global batch is batch_size x world_size sequences in
    world_size micro-batches (bench.py's flags). A scalar all-reduce (the loss; the clip's norm where the
    gradients are spread over ranks) costs its latency; gloo's reduce-scatter is an all-reduce of the whole
    tensor. expert_share: see busiest_expert_flops. timed_pass, timed_update (tp, tp_sp, fsdp): the rates'
    keys of the parts timed alone that price each of its passes and its update (predict_ms)."""
    w, s, h, L = world_size, config.block_size, config.n_embd, config.n_layer
    with torch.device('meta'):
        model = GPT(config)
    numel = sum(p.numel() for p in model.parameters())
    flops = model.flops_per_token() * batch_size * w * s  # the whole step's forward and backward
    act = batch_size * s * h * 4  # one micro-batch's residual stream, fp32
    # ep, tp_moe: the busiest rank's experts compute more than 1/w of all the experts' FLOPs
    busiest = busiest_expert_flops(model, batch_size * w * s, w, expert_share) if config.n_expert else 0
    scalars = lambda calls: ('all_reduce', 4, calls)
    # (pieces: the forward-and-backward passes through the whole model's ops this rank makes, each paying
    # their fixed cost: a micro-batch is one, a pipeline stage's slot 1/p of one)
    work = lambda share, pieces, update, calls: dict(flops=flops * share, pieces=pieces, update=update,
                                                     calls=calls)
    if name in ('train', 'train_moe'):
        return work(1, w, 1, [])
    if name in ('ddp', 'fsdp') or name.startswith('zero'):
        return data_parallel_work(name, model, w, work, scalars)
    if name in ('tp', 'tp_sp', 'tp_moe'):  # every micro-batch on every rank: 4 all-reduces a layer (an MoE
        # layer's experts spread whole over the ranks: its g too), the embedding's and the head's, the loss's
        # 3 small ones; with sequence parallelism each all-reduce is a reduce-scatter (gloo: an all-reduce)
        # and an all-gather of a sequence chunk
        per_micro = [('all_reduce', act, 4 * L + 2), ('all_reduce', batch_size * s * 4, 3)]
        per_micro += [('all_gather', act // w, 4 * L + 2)] if name == 'tp_sp' else []
        if name == 'tp_moe':  # and the router weights' gradient (CopyToTP), a layer: its k slots a token
            per_micro += [('all_reduce', batch_size * s * config.n_expert_active * 4,
                           sum(map(config.is_moe, range(L))))]
        even = work(1 / w, w, 1 / w, [(k, n, c * w) for k, n, c in per_micro] + [scalars(1)])
        if name != 'tp_moe':  # each of its passes at a tp rank's pass timed alone on its slices (predict_ms)
            even['timed_pass'] = 'tp_sp_pass_s' if name == 'tp_sp' else 'tp_pass_s'
        return dict(even, flops=even['flops'] + busiest)
    if name == 'ep':
        even = expert_parallel_work(model, batch_size, w, work, scalars)
        return dict(even, flops=even['flops'] + busiest)
    if name.startswith('pp_'):
        return pipeline_work(name, config, batch_size, w, n_microbatches, work, scalars)
    if name in GRIDS:
        return grid_work(name, model, batch_size, w, work, scalars)
    if name in ('cp_ring', 'cp_ulysses'):  # the ring: a kv block around the ring (cp - 1) times forward, it
        # and its gradient backward; Ulysses: q, k, v and the output all-to-all'd, and their gradients back
        ring = formulas.cp_comm_bytes_formula(s, batch_size, config.n_head, config.n_kv_head,
                                              h // config.n_head, w, 'ring')
        sends = 2 * (3 * (w - 1) + 1)  # (k and v, or their gradients: two sends each time)
        attention = (('send', ring / sends, sends * L * w) if name == 'cp_ring' else
                     ('all_to_all', act // w, 8 * L * w))
        priced = work(1 / w, w, 1, [attention, ('all_reduce', 4 * numel, 1),
                                    scalars(w + 1)])  # (a loss per micro-batch, the step's; the clip: local)
        # the ring's attention: a layer of each of the rank's w micro-batches, and their attention FLOPs (the
        # part of model.flops_per_token that grows with the sequence, linearly: s is even here), to price at
        # its own measured time instead (predict_ms)
        attention_flops = 2 * (model.flops_per_token(s) - model.flops_per_token(s // 2)) * batch_size * s
        return dict(priced, ring=(L * w, attention_flops)) if name == 'cp_ring' else priced
    return None


def zero_buckets(numels, bucket):
    """The elements of each of zero.py's gradient buckets, as its bucket_groups makes them from parameters of
    numels elements (the model's order): in the order backward produces their gradients, a bucket closed once
    it holds `bucket` elements, so only at a parameter's end (a 100,000-element bucket takes a whole
    1M-element weight)."""
    sizes = [0]
    for n in reversed(numels):
        if sizes[-1] >= bucket:
            sizes.append(0)
        sizes[-1] += n
    return sizes


def data_parallel_work(name, model, w, work, scalars):
    """The data-parallel rows of row_work (ddp, zero0-3, fsdp): each rank its micro-batch, and the
    gradients' buckets reduced (gloo's reduce-scatter: an all-reduce), as the scripts bucket them."""
    numel, L = sum(p.numel() for p in model.parameters()), model.config.n_layer
    buckets = lambda stage: zero_buckets([p.numel() for p in model.parameters()], default_bucket_size(stage))
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    if name in ('ddp', 'zero0'):  # every rank updates the whole model
        sizes = ddp_buckets(4 * numel) if name == 'ddp' else [4 * n for n in buckets(0)]
        return work(1 / w, 1, 1, [('all_reduce', n, 1) for n in sizes] + [scalars(1)])  # (the clip: local)
    if name in ('zero1', 'zero2'):  # each bucket reduce-scattered (gloo: an all-reduce) as backward fills it,
        # its chunk gathered after the step, every bucket's posted back to back (zero.publish_all: a burst)
        calls = [c for n in buckets(int(name[-1]))
                 for c in (('all_reduce', 4 * n, 1), ('all_gather burst', 4 * n // w, 1))]
        return work(1 / w, 1, 1 / w, calls + [scalars(2)])
    if name in ('zero3', 'fsdp'):  # per bucket (each block, the root): 2 gathers, a reduce (gloo: all-reduce)
        # (zero.py's gather on gloo is point-to-point sends into the buffer: priced as the sweep's all-gather)
        buckets = [block] * L + [numel - L * block]
        calls = [c for b in buckets for c in (('all_gather', 4 * b // w, 2), ('all_reduce', 4 * b, 1))]
        # both map their buffers afresh (the mapped rates), and a step fills fresh ones: each bucket gathered
        # twice (zero.py into its flat; FSDP2 into its all-gather output, gloo's temporary, then the
        # parameters copied out: three times that) and its gradients once (zero.py's zeroed bucket; FSDP2's
        # reduce-scatter input, and gloo's clone of it). (FSDP2 gathers the root once: ~1% less here; a
        # buffer a receive fills pays its pages, its write is in the sweep's time: a little over-counted)
        fresh = 4 * numel * (3 if name == 'zero3' else 8)
        priced = dict(work(1 / w, 1, 1 / w, calls + [scalars(2)]), mapped=True, fresh_bytes=fresh)
        # fsdp: its pass and update at an FSDP2 rank's timed alone (its hooks, copies, DTensors: predict_ms)
        fsdp = dict(timed_pass='fsdp_pass_s', timed_update='fsdp_update_s') if name == 'fsdp' else {}
        return dict(priced, **fsdp)


def busiest_expert_flops(model, tokens, w, share=None):
    """The FLOPs the busiest rank's experts compute in a step beyond 1/w of all the experts' (ep and tp_moe
    spread each MoE layer's experts over the w ranks, a run of n_expert/w on each). share: the mean, over the
    iterations and MoE layers, of the largest part of a layer's token-slots one rank's run gets (the routing
    counted in train_moe's log: modelled as every strategy's, as their losses match; busiest_share); None:
    uniform, 1/w. Their FLOPs only: the all-to-alls are priced as evenly routed."""
    if share is None:
        return 0.0
    expert = sum(p.numel() for n, p in model.named_parameters() if '.mlp.experts.0.' in n)  # (every layer's)
    return 6 * expert * model.config.n_expert_active * tokens * (share - 1 / w)


def busiest_share(tokens_per_expert, w):
    """busiest_expert_flops's share, from logged [iteration][MoE layer][expert] counts (None: none logged, or
    experts that do not split into w equal runs, which the scripts refuse)."""
    shares = []
    for layer in [layer for counts in tokens_per_expert or () for layer in counts if sum(layer)]:
        if len(layer) % w:
            return None
        run = len(layer) // w  # rank r holds experts r*run .. (r+1)*run - 1
        per_rank = [sum(layer[r * run:(r + 1) * run]) for r in range(w)]
        shares.append(max(per_rank) / sum(layer))
    return statistics.mean(shares) if shares else None


def expert_parallel_work(model, batch_size, w, work, scalars):
    """The ep row of row_work: each rank its micro-batch and 1/w of each MoE layer's experts (ep = the world:
    each expert on one rank, so no expert gradient is all-reduced). Per MoE layer the split sizes (int64
    counts), then the token-slots' rows dispatched and combined, and both again backward (uniform routing: the
    sweep's all-to-all of equal parts); the dense gradients all-reduced."""
    config, numel = model.config, sum(p.numel() for p in model.parameters())
    moe_layers = sum(map(config.is_moe, range(config.n_layer)))
    experts = sum(p.numel() for n, p in model.named_parameters() if '.mlp.experts.' in n)
    slots = batch_size * config.block_size * config.n_expert_active * config.n_embd * 4
    calls = [('all_to_all', 8 * config.n_expert, moe_layers), ('all_to_all', slots, 4 * moe_layers),
             ('all_reduce', 4 * (numel - experts), 1), scalars(2)]  # (the clip's, the loss)
    return work(1 / w, 1, (numel - experts + experts / w) / numel, calls)


def pipeline_work(name, config, batch_size, w, m, work, scalars):
    """A pipeline row of row_work: w schedules of m micro-batches on w stages, each schedule m + p - 1 slots
    of a micro-batch's forward and backward on one stage (1F1B's and GPipe's bubble are the same: 1F1B holds
    fewer micro-batches); interleaved with v = 2 chunks a stage, m + (p - 1)/v slots; ZB-H1, m + (p - 1)/3
    (its cool-down filled with W, a third of a slot). The sends on a schedule's critical path (a schedule
    simulated with each send costing its sender c): with 1F1B, ZB-H1 and interleaved, the busiest stage's.
    Each of its v chunks sends its output on and its input's gradient back, one tensor a micro-batch, but the
    model's first chunk sends no gradient and its last no output (with 2 stages, each stage holds one of
    them). GPipe runs every forward before any backward, so both directions' sends lie on its path: 2m. A
    stage's receives, and the calls after the schedule (the tied weight's, the scalars), wait on the
    schedule, priced as its slots (stage 0 finishes last): no wait for a drifting rank, the stages are not
    in step. The scalars: the clip's norm and the loss, over the stages (dp = 1); pp_1f1b_measured adds a
    barrier and a MAX all-reduce a schedule."""
    v = 2 if name == 'pp_interleaved' else 1
    slots = m + (w - 1) / (3 if name == 'pp_zb1' else v)
    act = batch_size * config.block_size * config.n_embd * 4
    one_way = w == 2 and name != 'pp_gpipe'  # (with 2 stages, the busiest stage's sends go one way)
    sends = m * (2 * v - one_way)  # a schedule's, on its critical path
    tied = [('all_reduce', 4 * config.vocab_size * config.n_embd, 1)] if config.tie_embeddings else []
    measured = [scalars(2 * w)] if name == 'pp_1f1b_measured' else []
    calls = [('send', act // m, sends * w)] + tied + measured + [scalars(2)]
    return dict(work(slots / m / w, slots, 1 / w, calls), on_schedule=True)


# bench.py's grid rows (parallel_4d.py on 4 x world_size processes, dp = world_size): their pp, cp, tp, ep
# and m, parallel_4d.py's microbatches a micro-step (its default 2; the MoE grid passes 1, and runs GPipe)
GRIDS = {'grid_dp_pp_tp': dict(pp=2, cp=1, tp=2, ep=1, m=2, moe=False),
         'grid_dp_cp_tp': dict(pp=1, cp=2, tp=2, ep=1, m=2, moe=False),
         'grid_pp_tp_ep': dict(pp=2, cp=1, tp=2, ep=2, m=1, moe=True)}  # (on the bench's MoE model)


def grid_work(name, model, batch_size, w, work, scalars):
    """A grid row of row_work: one rank's collectives, counted from parallel_4d.py (each dp rank one
    micro-step of m microbatches): tp's four all-reduces a layer of its stage and the embedding's or head's,
    a microbatch (an MoE layer: the router's gradient too); pp's activation and gradient; the ring's k and v
    blocks and their gradients; ep's split sizes and four all-to-alls a MoE layer; the tied embedding's two
    copies; the dp x cp ZeRO-1 buckets (gloo's reduce-scatter: an all-reduce, then the chunks gathered), each
    posted back to back after the schedule (a burst), ' x4' where that group has 4 ranks. Its compute is 1/n
    of the step's: with more processes than cores, a rank waiting in the bubble gives its core to another, so
    the bubble costs no time of its own (priced at rates measured with n processes at once: crowded_rates).
    None: a group of other than 2 or 4 ranks (not in the sweep)."""
    g, c = GRIDS[name], model.config
    dp_cp, pp, tp, m, L = w * g['cp'], g['pp'], g['tp'], g['m'], c.n_layer // g['pp']
    if dp_cp not in (2, 4):
        return None
    b, t, moe_layers = batch_size // m, c.block_size // g['cp'], sum(map(c.is_moe, range(L)))
    act = b * t * c.n_embd * 4  # a microbatch's residual stream on this rank, fp32
    calls = [('all_reduce', act, m * (4 * L + (2 if pp == 1 else 1))), scalars(3 * m + 5)]
    calls += [('all_reduce', b * t * c.n_expert_active * 4, m * moe_layers)] if c.n_expert else []
    if pp > 1:
        calls += [('send', act, 2 * m)] + ([('all_reduce', c.vocab_size * c.n_embd * 4 // tp, 1)]
                                           if c.tie_embeddings else [])
    if g['cp'] > 1:  # (k and v, each its own send, around the ring and back with their gradients)
        sends = 2 * (3 * (g['cp'] - 1) + 1)
        calls += [('send', b * t * c.n_kv_head // tp * (c.n_embd // c.n_head) * 4, sends * L * m)]
    if g['ep'] > 1:  # (the tp ranks share out the tokens; every expert on one rank of ep x tp: no edp)
        slots = b * t * c.n_expert_active * c.n_embd * 4 // tp
        calls += [('all_to_all', 8 * c.n_expert, m * moe_layers), ('all_to_all', slots, 4 * m * moe_layers)]
    # ZeRO-1 over the first stage's dense parameters, each a 1/tp slice (a norm's weight, whole on every tp
    # rank, counted as a slice: a few hundred elements), in parallel_4d.py's 100,000-element buckets (closed
    # at a parameter's end: zero_buckets), each reduced, then gathered, in bursts
    first = lambda n: (int(n.split('.')[2]) < L if n.startswith('transformer.h.')
                       else pp == 1 or 'ln_f' not in n)  # (the first stage: the embeddings, its blocks)
    held = [p.numel() // tp for n, p in model.named_parameters() if first(n) and '.mlp.experts.' not in n]
    x4 = '' if dp_cp == 2 else ' x4'
    calls += [call for n in zero_buckets(held, 100_000)
              for call in ((f'all_reduce burst{x4}', 4 * n, 1), (f'all_gather burst{x4}', 4 * n // dp_cp, 1))]
    return work(1 / (4 * w), m / pp, 1 / (4 * w), calls)


def wait_seconds(waits, gap):
    """The wait for the slower rank that a call adds after gap seconds of compute, from the sweep's [(seconds
    of compute, seconds more)]: none up to the first gap (the sweep's calls include its wait), linear between
    the gaps measured, the last one's beyond them (not extrapolated)."""
    if not waits or gap <= waits[0][0]:
        return 0.0
    for (g0, w0), (g1, w1) in zip(waits, waits[1:]):
        if gap <= g1:
            return w0 + (w1 - w0) * (gap - g0) / (g1 - g0)
    return waits[-1][1]


def predict_ms(work, rates):
    """(ms, its compute, its communication, of which waiting) of a step: work from row_work, rates from
    machine_rates (a row that maps its buffers afresh at the rates measure_mapped measured, and its fresh
    buffers filled; cp_ring's attention at the ring's measured seconds a layer; tp's, tp_sp's and fsdp's
    passes at a rank's pass timed alone, fsdp's update with what FSDP2's adds, timed alone; where they were
    measured). The calls inside the step (not the bursts; not a pipeline's, on_schedule) each wait for the
    slower rank (wait_seconds) after the step's compute spread evenly over them."""
    collectives = rates['collectives']  # {kind: the sweep's [(bytes, seconds)]}
    rates = dict(rates, **rates['mapped']) if work.get('mapped') else rates
    fresh = work.get('fresh_bytes', 0) * rates.get('fresh_s_per_byte', 0)
    passes_s = work['pieces'] * rates['pass_fixed_s'] + work['flops'] / rates['flops_per_s']  # fwd + bwd
    if work.get('timed_pass') in rates:  # tp: each pass at a tp rank's pass timed alone on its slices (not at
        # the whole model's rates: narrower matmuls); fsdp: at an FSDP2 rank's (its fresh buffers in it)
        passes_s, fresh = work['pieces'] * rates[work['timed_pass']], 0.0
    update_s = work['update'] * rates['update_s']
    if work.get('timed_update') in rates:  # fsdp: what FSDP2's update adds, timed alone on the whole model in
        # a world of one (its DTensors' dispatch, the same per tensor whatever the share), to its share's
        update_s += max(0.0, rates[work['timed_update']] - rates['update_s'])  # (two timings: never below)
    compute = passes_s + update_s + fresh
    layers, flops = work.get('ring', (0, 0))
    if 'ring_attention_s' in rates:  # the ring's attention at its measured seconds, not its FLOPs at the rate
        compute += layers * rates['ring_attention_s'] - flops / rates['flops_per_s']
    # the gap before each call inside the step: the compute the rank does, spread evenly over those calls. A
    # simplification: DDP's and ZeRO's buckets come close together in backward; each kind of call is assumed
    # to wait as the all-reduce does. A pipeline's calls wait on its schedule instead (pipeline_work)
    calls_inside = sum(count for kind, _, count in work['calls'] if 'burst' not in kind)
    gap = compute / max(calls_inside, 1)
    waiting = 0.0 if work.get('on_schedule') else calls_inside * wait_seconds(rates['waits'], gap)
    calls_s = sum(count * call_seconds(collectives[kind], nbytes) for kind, nbytes, count in work['calls'])
    comm = calls_s + waiting
    return 1000 * (compute + comm), 1000 * compute, 1000 * comm, 1000 * waiting


# the parts of a step timed alone (machine_rates.time_alone): (their key in the rates, what, of what, the row
# they price)
TIMED_ALONE = (('ring_attention_s', "the ring's attention", ' a layer', 'cp_ring'),
               ('tp_pass_s', "a tp rank's pass", ' a micro-batch', 'tp'),
               ('tp_sp_pass_s', "a tp_sp rank's pass", ' a micro-batch', 'tp_sp'),
               ('fsdp_pass_s', "an FSDP2 rank's pass", ' a micro-batch', 'fsdp'),
               ('fsdp_update_s', "FSDP2's update", ' a step on the whole model', 'fsdp'))


def rates_line(rates, folder, rows=None):
    """What the prediction stands on, in one line: the rates measured on this machine (the parts timed alone
    for the rows among `rows` only, where given), and where they are."""
    text = (f"a pass's fixed cost {1e3 * rates['pass_fixed_s']:.1f} ms, FLOPs at "
            f"{rates['flops_per_s'] / 1e9:.1f} GFLOP/s, the update {1e3 * rates['update_s']:.1f} ms")
    if rates['collectives']:
        (n0, t0), (n1, t1) = rates['collectives']['all_reduce'][0], rates['collectives']['all_reduce'][-1]
        text += f", an all-reduce {1e3 * t0:.2f} ms at {n0 >> 10} KiB and {1e3 * t1:.1f} ms at {n1 >> 20} MiB"
        text += ", a call's wait for the slower rank " + ', '.join(
            f"+{1e3 * w:.1f} ms after {1e3 * g:.0f} ms of compute" for g, w in rates['waits'][1:])
    for key, what, of_what, row in TIMED_ALONE:
        if rows is not None and row not in rows:
            continue
        if key in rates:
            text += f", {what} {1e3 * rates[key]:.1f} ms{of_what} ({row}; timed alone)"
        elif key in rates.get('not_timed', {}):
            text += f", {what} not timed ({rates['not_timed'][key]}: {row} priced without it)"
    return f"predicted ms/step (modelled, from rates measured on this machine: {text}; " \
           f"{os.path.join(folder, 'machine.json')}), beside the measured:"


def rate_notes(results, rates, on_moe_model, share, w):
    """The lines under rates_line for the rows priced otherwise: zero3 and fsdp at the mapped rates, the MoE
    rows at the MoE model's, ep and tp_moe at their busiest rank (or, with no routing counted, as even)."""
    ran = lambda *names: any(results.get(n, {}).get('status') == 'ok' for n in names)
    lines, mapped = [], rates['mapped']
    if ran('zero3', 'fsdp'):
        lines.append(f"  (zero3 and fsdp at the rates of a process that maps its buffers afresh, as they "
                     f"do: a pass's fixed cost {1e3 * mapped['pass_fixed_s']:.1f} ms, FLOPs at "
                     f"{mapped['flops_per_s'] / 1e9:.1f} GFLOP/s, the update {1e3 * mapped['update_s']:.1f} "
                     f"ms; a fresh buffer filled at {1e-9 / mapped['fresh_s_per_byte']:.1f} GB/s)")
    if on_moe_model:
        lines.append(f"  (the MoE rows at the MoE model's own rates: a pass's fixed cost "
                     f"{1e3 * on_moe_model['pass_fixed_s']:.1f} ms, FLOPs at "
                     f"{on_moe_model['flops_per_s'] / 1e9:.1f} GFLOP/s)")
    if on_moe_model and w > 1 and ran('ep', 'tp_moe'):
        lines.append(f"  (ep and tp_moe: their busiest rank's experts get {share:.2f} of a layer's "
                     f"token-slots, not 1/{w}: train_moe's routing, counted; the all-to-alls priced as even)"
                     if share is not None else
                     "  (ep and tp_moe as if the routing were even: no train_moe routing was counted)")
    return lines


def grid_rates(args, rates, config, moe_config, grids):
    """{grid row: the rates it is priced at}: crowded_rates with its 4 x world_size processes, the compute of
    its model (the MoE grid's on moe_config)."""
    model = lambda name: 'moe' if GRIDS[name]['moe'] else 'dense'
    configs = {model(n): moe_config if GRIDS[n]['moe'] else config for n in grids}
    crowded = crowded_rates(args.out, rates, 4 * args.world_size, configs, args.batch_size)
    # (no waits: waits_after_compute is not measured with 8 processes at once; their calls are the crowded's)
    return {n: dict(crowded[model(n)], collectives=crowded['collectives'], waits=[]) for n in grids}


def grid_note(crowded, n):
    """The line under rates_line for the grid rows: the rates of n processes at once."""
    if not crowded:
        return []
    at = next(iter(crowded.values()))
    return [f"  (the grids at rates measured with {n} processes at once, as they run: a pass's fixed cost "
            f"{1e3 * at['pass_fixed_s']:.1f} ms, FLOPs at {at['flops_per_s'] / 1e9:.1f} GFLOP/s in each, an "
            f"all-reduce in pairs {1e3 * call_seconds(at['collectives']['all_reduce'], 512 << 10):.1f} ms at "
            "512 KiB; their bubble unpriced: a rank waiting in it gives its core to another)"]


def predicted_lines(results, args, vocab_size, moe_config=None, cp_script=None, tp_script=None,
                    fsdp_shard=None):
    """Each ok bench row's predicted ms beside its measured, into results[name]['predicted_ms'], and the lines
    that say so; if predicting fails, one line that says why (the rows' results are kept). The MoE rows
    (MOE_ROWS) on moe_config, with its own compute rates (moe_rates). cp_script: context_parallel.py, whose
    ring attention is timed (machine_rates.ring_attention_seconds); tp_script: tensor_parallel.py, whose
    rank's pass is (machine_rates.tp_pass_seconds); fsdp_shard: train_fsdp.shard_model, with which an FSDP2
    rank's pass and update are (machine_rates.fsdp_seconds)."""
    if torch.cuda.is_available() or args.dtype != 'float32':
        return ["(predicted step time: priced for float32 on a CPU's gloo processes only, not yet for "
                f"{'GPUs' if torch.cuda.is_available() else args.dtype})"]
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, bias=False,
                       block_size=args.block_size, vocab_size=vocab_size)
    moe = moe_config is not None and any(results.get(n, {}).get('status') == 'ok' for n in MOE_ROWS)
    grids = [n for n in GRIDS if results.get(n, {}).get('status') == 'ok']
    try:
        rates = machine_rates(args.out, config, args.batch_size, args.world_size, args.threads,
                              args.remeasure, cp_script, tp_script, fsdp_shard)
        on_moe_model = moe_rates(args.out, rates, moe_config, args.batch_size, args.threads) if moe else None
        crowded = grid_rates(args, rates, config, moe_config, grids) if grids else {}
    except Exception as e:  # (a broken sweep must not lose the bench's results)
        return [f"(predicted step time: not available here: {type(e).__name__}: {e})"]
    share = busiest_share(results.get('train_moe', {}).get('tokens_per_expert'), args.world_size)
    ran = [name for name, r in results.items() if r.get('status') == 'ok']
    lines = [rates_line(rates, args.out, ran)]
    lines += rate_notes(results, rates, on_moe_model, share, args.world_size)
    lines += grid_note(crowded, 4 * args.world_size)
    for name, r in results.items():
        if r.get('status') != 'ok':
            continue
        on_moe = name in MOE_ROWS or GRIDS.get(name, {}).get('moe')
        at = crowded.get(name) or (on_moe_model if on_moe else rates)  # the rates this row is priced at
        work = None if at is None else row_work(
            name, moe_config if on_moe else config, args.batch_size, args.world_size, args.n_microbatches,
            share)
        if work is None or any(kind not in at['collectives'] for kind, _, _ in work['calls']):
            lines.append(f"  {name:<8} (not priced yet)")
            continue
        ms, compute, comm, waiting = predict_ms(work, at)
        r['predicted_ms'] = ms
        spread = '' if not r.get('ms_range') else ' (its steps %.0f-%.0f)' % tuple(r['ms_range'])
        lines.append(f"  {name:<8} predicted {ms:6.1f} (compute {compute:5.1f} + communication {comm:5.1f}, "
                     f"waiting {waiting:5.1f} of it), measured {r['ms']:6.1f}{spread}: "
                     f"{100 * (ms / r['ms'] - 1):+.0f}%")
    return lines + speed_moved(results)


def speed_moved(results, bar=0.2):
    """A line when the train row, all compute, is predicted more than bar off its own step: then this
    machine's speed most likely moved between the rows and the rates (a shared machine's slow spell can last
    tens of seconds: in one quick bench the rates read 51 GFLOP/s, where the others read 60-70, and the rows
    that compute dominates were predicted 30-40% slow), and each row's prediction moved with it."""
    train = results.get('train', {})
    if train.get('predicted_ms') is None or abs(train['predicted_ms'] / train['ms'] - 1) <= bar:
        return []
    miss = 100 * (train['predicted_ms'] / train['ms'] - 1)
    return [f"  (train, all compute, is predicted {miss:+.0f}% off its own step: this machine's speed "
            "likely moved between its rows and its rates, measured after them or kept in machine.json; "
            "`--remeasure` measures them again)"]
