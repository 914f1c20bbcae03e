"""
Executed schedules (pipeline.py): what each pipeline stage ran in a measured step, as ops with a start and an
end on its clock (measure.ScheduleClock records them), drawn as a text timeline and a Perfetto trace, and the
schedule's report beside the formulas: the bubble, the time in compute and in send/recv, what was held.
"""

import json
import statistics

from common.measure import comm_report, print_measured

COMPUTE = ('F', 'B', 'W')  # forward, backward (zb1: of the input), the weights' gradients (zb1)


def time_split(records, total):
    """The stage's share of the step in compute (F, B and W), in send/recv (the transfer, and on a CPU the
    wait for a neighbour that is still computing) and elsewhere; the bubble is everything that is not
    compute."""
    compute = sum(t1 - t0 for op, _, t0, t1 in records if op in COMPUTE)
    comm = sum(t1 - t0 for op, _, t0, t1 in records if op == 'send/recv')
    return {'compute_fraction': compute / total, 'send_recv_fraction': comm / total,
            'other_fraction': 1 - (compute + comm) / total, 'bubble_fraction': 1 - compute / total}


def schedule_measurements(clock, comms, wire, sent_p2p):
    """A measured step's numbers for its log row: the median time split of its schedules (the first left out
    as a warm-up when there are more), the peaks the clock kept, the bytes counted at the calls and on the
    wire. """
    splits = [time_split(*schedule) for schedule in clock.schedules[1:] or clock.schedules]
    sent = comm_report(comms)
    return {**{k: statistics.median(split[k] for split in splits) for k in splits[0]},
            'n_schedules': len(splits),
            'peak_microbatches_held': clock.peak_held, 'peak_activation_bytes': clock.peak_held_bytes,
            'activation_bytes_per_microbatch': clock.microbatch_bytes,
            'peak_output_grad_bytes': clock.peak_grad_bytes,
            'peak_pending_sends': clock.peaks.get('pending_sends', 0), 'p2p_bytes_per_step': sent_p2p,
            'collective_bytes': sum(sent['collective_bytes'].values()),
            'collective_bytes_by_kind': sent['collective_bytes'], 'wire_bytes': wire.sent,
            'wire_bytes_note': wire.why_not, 'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
            'records': clock.schedules[-1][0], 'step_s': clock.schedules[-1][1]}


def unit_time_bubbles(tracks):
    """Each stage's idle fraction if every op took one unit (F = B = W = 1; a whole backward, B with its W,
    2), replayed in the order each stage ran its ops: a stage starts its next op when it is free and the op's
    input is there (neighbour_op). The wall clock's bubble moves with the machine's load; this one is the
    schedule's own. tracks: each stage's records [(op, key, start, end)], stage 0 first; keys (microbatch,
    chunk) with v chunks a stage. None for an order that cannot run."""
    p = len(tracks)
    ops = [[(op, tuple(k) if isinstance(k, list) else k) for op, k, *_ in records if op in 'FBW']
           for records in tracks]
    v = 1 + max((k[1] for track in ops for _, k in track if isinstance(k, tuple)), default=0)
    cost = {'F': 1, 'W': 1, 'B': 1 if any(op == 'W' for track in ops for op, _ in track) else 2}
    done, free, nxt = {}, [0] * p, [0] * p
    while any(nxt[r] < len(ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(ops[r]):
                op, key = ops[r][nxt[r]]
                before = neighbour_op(r, op, key, p, v)
                if before is not None and before not in done:
                    break
                free[r] = done[(r, op, key)] = max(free[r], done.get(before, 0)) + cost[op]
                nxt[r], moved = nxt[r] + 1, True
        if not moved:
            return None
    return [1 - sum(cost[op] for op, _ in track) / max(free) for track in ops]


def neighbour_op(r, op, key, p, v):
    """(stage, op, key) that must end before stage r runs op of key: an F waits for the previous virtual
    stage's F of that microbatch, a B for the next one's B; a W (and the ends of the pipe) for nobody else."""
    i, c = key if v > 1 else (key, 0)
    place = c * p + r + (-1 if op == 'F' else 1)
    if op == 'W' or place in (-1, p * v):
        return None
    return place % p, op, ((i, place // p) if v > 1 else i)


def op_label(op, i):
    """F3 / B3 / W3: forward / backward / weights' gradients of microbatch 3; F3.1: of microbatch 3 on
    chunk 1."""
    return f"{op}{i[0]}.{i[1]}" if isinstance(i, (tuple, list)) else f"{op}{i}"


def timeline(records, total, n_slots, width):
    """One line of the stage's step, n_slots equal slices of the clock: each forward and backward once, in the
    order executed (F3 = forward of microbatch 3, B3 its backward), in the slot where it started, '-' in the
    slots it goes on running through, '.' where the stage was not computing. An op shorter than a slot, or one
    starting in a slot already taken, takes the next free slot (the row grows past n_slots rather than drop
    it)."""
    slot, cells = total / n_slots, []
    for op, i, t0, t1 in records:
        if op not in COMPUTE:
            continue
        start = max(len(cells), int(t0 / slot))
        cells += ['.'] * (start - len(cells)) + [op_label(op, i)]
        cells += ['-'] * (round(t1 / slot) - len(cells))  # the slots whose middle it runs through
    cells += ['.'] * (n_slots - len(cells))
    return ' '.join(c.ljust(width) for c in cells).rstrip()


def write_schedule_trace(tracks, total, path):
    """The executed schedule as a Chrome/Perfetto trace (open it at ui.perfetto.dev): one track per rank
    (tracks: {name: records}), a slice for each forward, backward and send/recv, and 'idle' for the gaps in
    between, so the bubble is a picture."""
    events = []
    for tid, (name, records) in enumerate(tracks.items()):
        track = {'pid': 0, 'tid': tid}
        events.append(dict(track, ph='M', name='thread_name', args={'name': name}))
        busy = sorted((t0, t1, op_label(op, i) if op in COMPUTE else op) for op, i, t0, t1 in records)
        edges = [(0.0, 0.0, None)] + busy + [(total, total, None)]
        for (_, prev_end, _), (start, _, _) in zip(edges, edges[1:]):
            if start > prev_end:
                events.append(dict(track, ph='X', name='idle', cat='idle', ts=1e6 * prev_end,
                                   dur=1e6 * (start - prev_end)))
        for t0, t1, op in busy:
            events.append(dict(track, ph='X', name=op,
                               cat='communication' if op == 'send/recv' else 'compute',
                               ts=1e6 * t0, dur=1e6 * (t1 - t0)))
    with open(path, 'w') as f:
        json.dump({'traceEvents': events, 'displayTimeUnit': 'ms'}, f)


def print_timelines(title, tracks, total, n_slots, clock):
    """Each rank's executed schedule as one text line (timeline), then each one's order of forwards and
    backwards. tracks: {name: records}; n_slots: the slots a line has; clock: what timed it."""
    width = max(len(op_label(op, i)) for records in tracks.values() for op, i, _,
                _ in records if op in COMPUTE)
    print(f"{title}, step {1000 * total:.1f} ms ({clock}; one slot = {1000 * total / n_slots:.2f} ms; F3/B3 "
          "= "
          f"forward/backward of microbatch 3, W3 its weights' gradients, F3.1 on chunk 1, - = still running, "
          f". = not computing)")
    for name, records in tracks.items():
        print(f"{name} | {timeline(records, total, n_slots, width)}")
    for name, records in tracks.items():
        print(f"{name} executed: " + ' '.join(op_label(op, i) for op, i, _, _ in records if op in COMPUTE))


def print_schedule_report(title, stages, formulas, trace, clock):
    """pipeline.py's measured step: the stages' timelines (a slot ~ one F), the schedule as a Perfetto trace,
    then each stage's (quantity, measured, counted, modelled) lines. stages: the stages' log rows."""
    tracks, total, r0 = {f"stage {r['stage']}": r['records'] for r in stages}, stages[0]['step_s'], stages[0]
    order = sorted(stages, key=lambda r: r['stage'])
    unit = dict(zip([r['stage'] for r in order], unit_time_bubbles([r['records'] for r in order]) or []))
    work = 3 * len({i for op, i, _, _ in r0['records'] if op == 'F'})  # F + B (~2F), or F + B + W: 3 slots
    print_timelines(title, tracks, total, round(work / (1 - r0['bubble_fraction_formula'])), clock)
    write_schedule_trace(tracks, total, trace)
    print_measured(f"measured at iter {r0['iter']}, the median of {r0['n_schedules']} schedule(s); formulas: "
                   f"{formulas} x the most one held, measured; bytes: counted at the calls, the ring "
                   "formula, on the stage's own sockets",
                   [(f"stage {r['stage']} {name}", *values) for r in stages for name, *values in (
                       ('in compute', r['compute_fraction'], None, None),
                       ('in send/recv', r['send_recv_fraction'], None, None),
                       ('other', r['other_fraction'], None, None),
                       ('bubble (not computing)', r['bubble_fraction'], None, r['bubble_fraction_formula']),
                       ('bubble in unit time, as run', None, unit.get(r['stage']),
                        r['bubble_fraction_formula']),
                       ('microbatches held at peak', r['peak_microbatches_held'], None,
                        r['peak_microbatches_held_formula']),
                       ('activation bytes at peak', r['peak_activation_bytes'], None,
                        r['peak_activation_bytes_formula']),
                       *((('  of them output gradients for W', r['peak_output_grad_bytes'], None,
                           r['peak_output_grad_bytes_formula']),) if r['schedule'] == 'zb1' else ()),
                       ('p2p bytes sent', None, r['p2p_bytes_per_step'], r['p2p_bytes_per_step_formula']),
                       ('bytes sent, all groups', r['wire_bytes'], r['collective_bytes'],
                        r['wire_bytes_formula']))],
                   ["bubble in unit time: the order each stage ran its ops, replayed with F = B = W = 1 (a "
                    "whole backward 2): the schedule's own (the clock's moves with the machine's load)",
                    f"the schedule as a trace, one track per stage: {trace} (open at ui.perfetto.dev)"] +
                   [f"wire bytes {r['wire_bytes_note']}" for r in stages[:1] if r['wire_bytes'] is None])
