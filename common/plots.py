"""
bench.py --plot: three pictures of a bench run (matplotlib, an optional install), each saying what it shows.

    bench_loss.png    every row's loss curve is train.py's by design, so the picture plots what matters: each
                      row's largest relative difference from its reference row (log scale), beside the curve
    bench_memory.png  each strategy's whole per-rank state on one axis: parameters, gradients, optimizer
                      state and peak activations, measured (left bar) beside modelled (right, hatched)
    bench_comm.png    bytes one rank sent per step: counted at the calls, the ring formula, measured
"""

import os

STATE = [('param_bytes', 'parameters'), ('grad_bytes', 'gradients'), ('optim_bytes', 'optimizer state'),
         ('peak_activation_bytes', 'activations (peak)')]


def pyplot():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib, an optional install: pip install matplotlib")
    return plt


def plot_losses(plt, ok, path):
    """One curve (train.py's) and, on a log axis beside it, every row's largest relative difference from it:
    sixteen curves that lie on top of one another teach nothing; their differences do."""
    fig, (curve, diff) = plt.subplots(1, 2, figsize=(10, 4))
    first = next(iter(ok.values()))
    iters = sorted(int(k) for k in first['losses'])
    curve.plot(iters, [first['losses'].get(k, first['losses'].get(str(k))) for k in iters], marker='o')
    curve.set(xlabel='iteration', ylabel='training loss (global batch)',
              title=f"the loss curve ({next(iter(ok))}); every row's overlaps it by design")
    names = [n for n, r in list(ok.items())[1:] if r.get('loss_max_rel_diff') is not None]
    floor = 1e-9  # a row equal to the last bit (DDP is train.py's arithmetic) drawn at the floor, and said
    diff.barh(names, [max(ok[n]['loss_max_rel_diff'], floor) for n in names], color='C1')
    for i, n in enumerate(names):
        if ok[n]['loss_max_rel_diff'] == 0:
            diff.text(floor, i, ' identical', va='center', fontsize=8)
    diff.set_xscale('log')
    diff.invert_yaxis()
    diff.set(xlabel='largest relative difference from the reference row (log)', title='how far each row is')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_memory(plt, ok, path):
    """Per rank, the whole state of each strategy, measured beside modelled, one axis, one scale: the bars are
    comparable across strategies (a TP rank holds its slices of the weights AND of their gradients and AdamW
    state). A part a script does not report is left out of its bar and named under the picture."""
    names = [n for n, r in ok.items() if any(r.get(k) is not None for k, _ in STATE)]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    missing = []
    for side, suffix, hatch in ((-0.2, '', None), (0.2, '_formula', '//')):
        bottom = [0.0] * len(names)
        for c, (key, label) in enumerate(STATE):
            values = [(ok[n].get(key + suffix) or 0) / 1e6 for n in names]
            missing += [f"{n} {label}" for n in names if ok[n].get(key + suffix) is None and not suffix]
            ax.bar([i + side for i in range(len(names))], values, 0.38, bottom=bottom, color=f'C{c}',
                   hatch=hatch, label=label if not suffix else None, edgecolor='white')
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
    ax.margins(y=0.08)  # (no bar touches the frame)
    ax.set(ylabel='MB per rank (the largest rank)',
           title='What one rank holds: measured (left) beside modelled (right, hatched)')
    ax.legend(fontsize=8)
    if missing:
        fig.text(0.01, 0.01, 'not reported (left out of the bar): ' + ', '.join(missing[:8]) +
                 (' ...' if len(missing) > 8 else ''), fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)


def plot_comm(plt, ok, path):
    names = [n for n, r in ok.items() if r.get('collective_bytes') is not None]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, (key, label) in enumerate((('collective_bytes', 'counted at the calls (tensors handed over)'),
                                      ('wire_bytes_formula', 'modelled: the ring formula'),
                                      ('wire_bytes', "measured: the rank's own TCP sockets"))):
        ax.bar([i + 0.27 * (j - 1) for i in range(len(names))], [(ok[n].get(key) or 0) / 1e6 for n in names],
               0.26, label=label, color=f'C{j}')
    ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
    ax.set(ylabel='MB per rank per step', title='Bytes sent per step: counted, modelled, measured')
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(results, out_dir, leave_out=None):
    """The three pictures of a bench run's results (bench.py's rows); returns the paths written."""
    plt = pyplot()
    ok = {n: r for n, r in results.items() if r.get('status') == 'ok' and n != leave_out}
    paths = [os.path.join(out_dir, f'bench_{name}.png') for name in ('loss', 'memory', 'comm')]
    for draw, path in zip((plot_losses, plot_memory, plot_comm), paths):
        draw(plt, ok, path)
    plt.close('all')
    return paths
