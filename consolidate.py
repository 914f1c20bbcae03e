"""
Every sharded checkpoint back into one train.py checkpoint, offline, in one process. Each script saves what
each rank holds (nothing is gathered onto a rank to save) and owns the function that joins its files; this
file finds which script wrote out_dir and writes its join as out_dir/ckpt.pt: the whole model and torch
AdamW's state in configure_optimizers' order, which train.py, sample.py and every script resume from (at any
world size). The shards are memory-mapped and read a tensor at a time, so the process holds about one
consolidated checkpoint (what it writes), not every shard besides.

    python consolidate.py out-zero              # the sharded checkpoint in out-zero/ -> out-zero/ckpt.pt
    python consolidate.py out-tp out_full       # -> out_full/ckpt.pt

zero.py            zero_rank{r}.pt      each rank's chunk of every flat bucket: the chunks laid end to end
tensor_parallel.py ckpt_rank{r}.pt      each tp rank's slices: joined along the dimension each layer was cut
pipeline.py        ckpt_stage{s}.pt     each stage's blocks, by their names in the whole model: merged
train_fsdp.py      ckpt_dcp/            torch.distributed.checkpoint's shards: each tensor read by itself
parallel_4d.py     ckpt_4d_rank{r}.pt   all of the above in turn: ZeRO-1 chunks, then tp slices, then stages
expert_parallel.py ckpt_ep_rank{r}.pt   each ep rank's experts, the dense weights once: merged by name
"""

import os
import sys

import expert_parallel
import parallel_4d
import pipeline
import tensor_parallel
import train_fsdp
import zero
from common.checkpoints import save_checkpoint

# the file (or folder) rank 0 of each script writes -> that script's join of the whole world's files
LAYOUTS = {os.path.basename(zero.shard_path('', 0)): zero.consolidate,
           os.path.basename(tensor_parallel.rank_ckpt_path('', 0)): tensor_parallel.consolidate,
           os.path.basename(pipeline.stage_ckpt_path('', 0)): pipeline.consolidate,
           train_fsdp.SHARDED: train_fsdp.consolidate,
           os.path.basename(parallel_4d.rank_file('', 0)): parallel_4d.consolidate,
           os.path.basename(expert_parallel.rank_file('', 0)): expert_parallel.consolidate}


def consolidate(out_dir, dest_dir=None):
    """out_dir's sharded checkpoint, whichever script wrote it -> dest_dir/ckpt.pt (default out_dir). Returns
    the path written."""
    found = [name for name in LAYOUTS if os.path.exists(os.path.join(out_dir, name))]
    if len(found) != 1:
        what = 'none' if not found else 'several: ' + ', '.join(found)
        raise SystemExit(f"error: consolidate: {out_dir} must hold one sharded checkpoint "
                         f"({', '.join(LAYOUTS)}), "
                         f"holds {what}" + ('; train it with a sharded script first' if not found else
                                            '; move all but one to a folder of their own'))
    checkpoint = LAYOUTS[found[0]](out_dir)
    dest_dir = dest_dir or out_dir
    checkpoint['config'] = dict(checkpoint['config'], out_dir=dest_dir)
    path = os.path.join(dest_dir, 'ckpt.pt')
    save_checkpoint(checkpoint, path)
    print(f"wrote {path} (train.py's format) from {os.path.join(out_dir, found[0])} at iter "
          f"{checkpoint['iter_num']}")
    return path


if __name__ == '__main__':
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith('-'):
        raise SystemExit("usage: python consolidate.py OUT_DIR [DEST_DIR]   (writes DEST_DIR/ckpt.pt, "
                         "default "
                         "OUT_DIR)")
    consolidate(*sys.argv[1:])
