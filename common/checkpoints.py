"""Checkpoints and random streams: atomic writes (in the background), the model every script starts from
(train.py's initialization, a checkpoint to resume, GPT-2's weights), train.py's checkpoint format that every
sharded layout consolidates back into, and every rank's random streams, saved and restored: dropout resumes
exactly."""

import contextlib
import json
import math
import os
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from common.distributed import is_master, load_meta_kernels
from common.config import model_config
from model import GPT, GPTConfig


def is_gpt2(init_from):
    """A GPT-2 to start from: a name ('gpt2', 'gpt2-medium', ...) or a save_pretrained directory."""
    return init_from.startswith('gpt2') or os.path.isfile(os.path.join(init_from, 'config.json'))


def trim_log(out_dir, iter_num):
    """On resume, drop log.jsonl's rows from iter_num on: the resumed run writes them again."""
    path = os.path.join(out_dir, 'log.jsonl')
    if os.path.exists(path):
        rows = [line for line in open(path) if line.strip() and json.loads(line).get('iter', -1) < iter_num]
        with open(path, 'w') as f:
            f.writelines(rows)


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash mid-write never leaves a broken checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)  # atomic on POSIX and Windows
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def cpu_copy(obj, keep_whole=False):
    """A copy of obj (dicts, lists, tuples of tensors and plain values) with every tensor copied to CPU
    memory. keep_whole: a CPU tensor that is all of its storage is kept as it is, not copied (torch.save
    writes a view's whole storage: a view, such as a ZeRO chunk inside its bucket, is still copied)."""
    if isinstance(obj, torch.Tensor):
        whole = obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        if keep_whole and obj.device.type == 'cpu' and whole:
            return obj.detach()
        return obj.detach().to('cpu', copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v, keep_whole) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v, keep_whole) for v in obj)
    return obj


class CheckpointWriter:
    """Writes checkpoints in a background thread (as torch.distributed.checkpoint's async_save does), so that
    a slow disk never keeps a rank out of the next collective while its peers wait there under the process
    group's timeout: a 7B model's checkpoint takes minutes, the timeout is one. save() copies the state to CPU
    memory (training goes on changing the tensors), waits for the previous write, starts this one and returns.
    The run's last save (iter_num is last_iter: nothing changes the tensors after it) writes the CPU tensors
    that are whole as they are: there the copy would be a second copy of the rank's state, at the run's end
    its peak."""

    def __init__(self, last_iter=None):
        self.thread, self.error, self.last_iter = None, None, last_iter

    def save(self, obj, path, iter_num=None):
        snapshot = cpu_copy(obj, keep_whole=iter_num is not None and iter_num == self.last_iter)
        self.wait()
        self.thread = threading.Thread(target=self._write, args=(snapshot, path), daemon=False)
        self.thread.start()

    def _write(self, snapshot, path):
        try:
            save_checkpoint(snapshot, path)
        except BaseException as e:  # raised again in the training thread, at the next save or at the end
            self.error = e

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def init_model(cfg, vocab_size, ckpt_path=None, gpt2=True, meta=False):
    """The model init_from names: 'scratch' (train.py's initialization from cfg.seed), 'resume' (ckpt_path, a
    checkpoint with 'model_args') or a GPT-2 name (when gpt2). On the CPU, with the checkpoint's 'model'
    loaded. With meta: on the meta device, shapes only and no values, for a sharded script to cut before it
    materializes its share and fills it (init_params, load_params or its own checkpoint); the checkpoint is
    memory-mapped, so a rank that copies out its share of a whole one reads only those pages; a GPT-2's
    weights are read one tensor at a time by init_values. Returns (model, the checkpoint or None, iter_num,
    best_val_loss); on resume the log is trimmed to iter_num."""
    checkpoint, iter_num, best_val_loss = None, 0, 1e9
    # dropout and activation checkpointing, which no weight depends on, come from this run's flags (as
    # nanoGPT's dropout); everything else from the checkpoint
    overrides = dict(dropout=cfg.dropout, activation_checkpointing=cfg.activation_checkpointing)

    def on_meta():  # (torch's meta kernels loaded first, just before the build: torch's code, not the run's)
        if meta:
            load_meta_kernels()
        return torch.device('meta') if meta else contextlib.nullcontext()
    if cfg.init_from == 'scratch':
        with on_meta():
            model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from == 'resume':
        if os.path.exists(ckpt_path):
            checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False, mmap=meta)
        check_resume_files(checkpoint, ckpt_path)
        with on_meta():
            model = GPT(GPTConfig(**dict(checkpoint['model_args'], **overrides)))
        if not meta:
            model.load_state_dict(checkpoint['model'])
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        check_resume_run(cfg, vocab_size, checkpoint, ckpt_path)
        note = resume_note(cfg, checkpoint)
        if is_master():
            trim_log(cfg.out_dir, iter_num)
            for line in (note, later_checkpoints_note(cfg.out_dir, ckpt_path, iter_num)):
                if line:
                    print(line)
    elif gpt2 and is_gpt2(cfg.init_from):
        from common import hf  # (Hugging Face's files, and transformers, only here)
        if meta:  # the shapes from its config; its weights come later, one tensor at a time (init_values)
            with on_meta():
                model = GPT(hf.open_gpt2(cfg.init_from, **overrides)[0])
        else:
            model = hf.from_pretrained(cfg.init_from, **overrides)
    else:
        raise SystemExit(unknown_init_from(cfg.init_from, gpt2))
    if cfg.block_size > model.config.block_size:
        raise SystemExit(f"error: block_size {cfg.block_size} is larger than the model's "
                         f"{model.config.block_size}: pass --block_size={model.config.block_size} (or less)")
    return model, checkpoint, iter_num, best_val_loss


def later_checkpoints_note(out_dir, ckpt_path, iter_num):
    """One line where out_dir holds checkpoint files of a later iteration than the one resumed, in another
    layout (a ckpt.pt joined by consolidate.py and trained on by train.py, say, beside a sharded run's rank
    files, which the sharded script resumes first): this resume goes back to the older state. None if not.
    A folder's extras.pt counts too: train_fsdp.py's ckpt_dcp/ keeps the iteration there."""
    later = []
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not name.endswith(('.tmp', '.old')):  # (not a save cut short)
            name, path = name + '/', os.path.join(path, 'extras.pt')
        if name.endswith(('.pt', '/')) and os.path.isfile(path) and \
                os.path.abspath(path) != os.path.abspath(ckpt_path):
            try:  # (memory-mapped: the pickle is read, no tensor)
                it = load_mmap(path).get('iter_num', -1)
            except Exception:  # (not a checkpoint of ours: no word on it)
                it = -1
            later += [f"{name} (iteration {it})"] if it > iter_num else []
    if later:
        return (f"note: resuming {ckpt_path} at iteration {iter_num}; later checkpoints beside it: "
                f"{', '.join(later[:3])}{', ...' if len(later) > 3 else ''}, another layout's run (its own "
                f"script resumes it; python consolidate.py {out_dir} joins rank files into ckpt.pt)")
    return None


def resume_note(cfg, checkpoint):
    """One line where this command's model flags or data set differ from those of the run that wrote the
    checkpoint (a resume without the run's config file, say): the model's shape is the checkpoint's, its
    dropout and activation checkpointing this command's (init_model), and the data this command's. None where
    they agree (a smaller block_size is no difference)."""
    run, shape = checkpoint.get('config') or {}, checkpoint['model_args']
    said = [f"{k}={getattr(cfg, k)!r} (this command's; the run had {run[k]!r})"
            if k in ('dropout', 'activation_checkpointing', 'dataset') else
            f"{k}={shape[k]!r} (the checkpoint's; this command says {getattr(cfg, k)!r})"
            for k in [*shape, 'dataset']
            if k in run and k != 'block_size' and getattr(cfg, k, run[k]) != run[k]]
    global_batch = lambda c: c.get('batch_size', 0) * c.get('gradient_accumulation_steps', 0)
    had, has = global_batch(run), global_batch(vars(cfg))
    if had and has and had != has:  # (the global batch)
        said.append(f"a global batch of {has} sequences (this command's; the run had {had}: --batch_size="
                    f"{run['batch_size']} --gradient_accumulation_steps={run['gradient_accumulation_steps']}"
                    ")")
    return "note: resuming with " + ', '.join(said) if said else None


def check_resume_run(cfg, vocab_size, checkpoint, ckpt_path):
    """A resume that cannot continue the run, refused in one line: a checkpoint already past --max_iters (the
    loop would never reach it, and overwrite the checkpoint at every evaluation), a data set with tokens the
    model has no embedding for (a resume without the run's config file falls back to the default data set;
    tensor parallelism's vocabulary slices would train on without a word)."""
    it, n_vocab = checkpoint['iter_num'], checkpoint['model_args']['vocab_size']
    if cfg.max_iters < it and not cfg.eval_only:
        raise SystemExit(f"error: init_from=resume: {ckpt_path} is at iteration {it}, past --max_iters="
                         f"{cfg.max_iters}: pass a --max_iters of {it} or more (or --eval_only=True)")
    if vocab_size is not None and vocab_size > n_vocab:
        ran_on = (checkpoint.get('config') or {}).get('dataset')
        trained_on = f" (the run trained on --dataset={ran_on})" if ran_on else ''
        raise SystemExit(f"error: init_from=resume: --dataset={cfg.dataset} has {vocab_size} tokens, the "
                         f"checkpoint's model {n_vocab}{trained_on}")


def resumed_config(cfg, ckpt_path, gpt2=True):
    """What a script's table of refusals judges on a resume: this command's config with the model's shape the
    checkpoint's (init_model builds it so, whatever the command's flags say, and a resume without the run's
    config file leaves them at their defaults), so that a refusal is about the model that would run, and
    none refuses a model that would; a GPT-2's shape where init_from names one (hf.gpt2_start_config). Returns
    (that config, words for a refusal to add, or None). A script that starts no GPT-2 (gpt2=False, as
    init_model's) refuses any other init_from here, before its checks judge a model it would not build."""
    if not gpt2 and cfg.init_from not in ('scratch', 'resume'):
        raise SystemExit(unknown_init_from(cfg.init_from, gpt2))
    if cfg.init_from not in ('scratch', 'resume') and is_gpt2(cfg.init_from):
        from common.hf import gpt2_start_config  # (its config.json, or the hub's four sizes: no weights read)
        return gpt2_start_config(cfg)
    if cfg.init_from != 'resume' or not os.path.exists(ckpt_path):
        return cfg, None  # (a missing file is the refusals' or init_model's to report)
    checkpoint = load_mmap(ckpt_path)
    if 'model_args' not in checkpoint:
        return cfg, None  # (not a checkpoint of ours: init_model's to report)
    note = resume_note(cfg, checkpoint)
    shape = model_shape(cfg, checkpoint['model_args'])
    return SimpleNamespace(**dict(vars(cfg), **shape)), note and note.removeprefix('note: ')


def unknown_init_from(init_from, gpt2):
    """The one line for an init_from a script cannot start from (gpt2: whether it loads a GPT-2's weights)."""
    if gpt2:
        return f"error: init_from must be 'scratch', 'resume' or a GPT-2 name, got {init_from!r}"
    return (f"error: init_from must be 'scratch' or 'resume' here, got {init_from!r} (GPT-2's weights load "
            "in train.py, train_ddp.py, train_fsdp.py, zero.py, tensor_parallel.py and context_parallel.py)")


def model_shape(cfg, model_args):
    """The model keys init_model takes from the model's source (checkpoint, GPT-2), not from the flags."""
    return {k: v for k, v in model_args.items()
            if hasattr(cfg, k) and k not in ('dropout', 'activation_checkpointing', 'block_size')}


def check_resume_files(checkpoint, ckpt_path):
    """init_from=resume: every rank found its checkpoint file (ckpt_path: a shard, a slice, a stage, or one
    ckpt.pt for all), and all are from one iteration. Each file is written atomically, but by its own rank, so
    a run stopped while saving can leave some ranks' files a save behind: resumed, that mix would be a model
    that never existed. Said on every rank in one line (the ranks compare notes first), never left to hang a
    later collective."""
    iters = [None if checkpoint is None else checkpoint['iter_num']]
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine, iters = iters[0], [None] * dist.get_world_size()
        dist.all_gather_object(iters, mine)
    if checkpoint is None:
        raise SystemExit(f"error: init_from=resume but there is no checkpoint at {ckpt_path}")
    missing = [rank for rank, it in enumerate(iters) if it is None]
    if missing:
        raise SystemExit(f"error: init_from=resume but rank(s) {', '.join(map(str, missing))} found no "
                         f"checkpoint (this rank's: {ckpt_path})")
    if len(set(iters)) > 1:
        at = ', '.join(f"rank {rank}: {it}" for rank, it in enumerate(iters))
        raise SystemExit("error: init_from=resume: the ranks' checkpoint files are from different iterations "
                         f"({at}; this rank's is {ckpt_path}): a run stopped while saving leaves some a save "
                         "behind")


def train_checkpoint(model_sd, optimizer_sd, rng_states, model_args, iter_num, best_val_loss, config,
                     scaler_sd=None):
    """train.py's checkpoint: what every script resumes from and sample.py reads. rng_states: every
    data-parallel rank's random streams, in rank order (rank 0's are also saved under nanoGPT's names)."""
    return {'model': model_sd, 'optimizer': optimizer_sd, 'scaler': scaler_sd or {}, 'rng_states': rng_states,
            'rng_state': rng_states[0]['cpu'], 'cuda_rng_state': rng_states[0]['cuda'],
            'model_args': model_args, 'iter_num': iter_num, 'best_val_loss': best_val_loss, 'config': config}


def rng_state():
    """This process's random streams: the CPU generator, and the current GPU's when there is one."""
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {'cpu': torch.get_rng_state(), 'cuda': torch.cuda.get_rng_state() if on_gpu else None}


def set_rng_state(state):
    torch.set_rng_state(state['cpu'])
    if state.get('cuda') is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])


def seed_dropout(seed, dp_rank, pp_rank=0):
    """Call once the model is built (every rank built the same weights from `seed`). Each data-parallel rank,
    and each pipeline stage (as Megatron offsets its seed by the stage), then draws its own dropout masks. The
    rank at (0, 0) keeps the stream train.py has at this point, so a run of one rank is train.py. The same
    call in every data-parallel script: DDP, ZeRO and FSDP draw the same masks and give one another's loss
    curve."""
    if (dp_rank, pp_rank) != (0, 0):
        torch.manual_seed(seed + dp_rank + 100_003 * pp_rank)


def gather_rng_states(comm):
    """Every rank of comm's group: its rng_state(), in rank order (a collective; the result on every rank)."""
    if comm.size == 1:
        return [rng_state()]
    states = [None] * comm.size
    dist.all_gather_object(states, rng_state(), group=comm.group)
    return states


def restore_rng(checkpoint, rank, world_size, seed, dp_rank, pp_rank=0):
    """Resume the random streams: this rank's own saved state when the checkpoint has one per rank of a world
    of this size ('rng_states'), else (another world size: masks cannot continue exactly) rank 0 takes
    train.py's 'rng_state' and the others start their own stream, as at the start of a run."""
    states = checkpoint.get('rng_states')
    if states is not None and len(states) == world_size:
        set_rng_state(states[rank])
        return
    saved = len(states or [1])  # (no rng_states: train.py's one stream)
    if rank == 0 and pp_rank == 0 and saved != world_size:
        others = ', the others start afresh' if world_size > 1 else ''
        print(f"note: the checkpoint holds the random streams of {saved} rank(s), this run has {world_size}: "
              f"rank 0 continues the saved rank 0's{others} (with dropout on, not exactly the run's masks)")
    set_rng_state({'cpu': checkpoint['rng_state'], 'cuda': checkpoint.get('cuda_rng_state')})
    seed_dropout(seed, dp_rank, pp_rank)


# -----------------------------------------------------------------------------
# A model too large for one rank: built on the meta device (shapes, no memory), each rank gives storage to its
# share alone and fills it with train.py's exact values (init_params replays the initialization a tensor at a
# time), a GPT-2's, or a whole checkpoint's, each tensor handed over whole and cut by the rank's keep()

def init_values(cfg, config, keep):
    """The values of a model that init_model built on the meta device, handed to keep(name, values) one tensor
    at a time: train.py's initialization, or a GPT-2's from its file (init_from=gpt2, or a directory)."""
    if cfg.init_from == 'scratch':
        init_params(config, cfg.seed, keep)
    else:
        from common.hf import open_gpt2
        load_params(open_gpt2(cfg.init_from)[1](), keep)


@torch.no_grad()
def init_params(config, seed, keep):
    """train.py's initialization of GPT(config) after torch.manual_seed(seed), never holding the model: the
    same random draws in the same order (the constructors' default inits, _init_weights, the scaled residual
    projections), one module at a time into a scratch tensor, and keep(name, values) called with every
    parameter's final values (a tied weight under both names) for the caller to copy out its rank's share.
    The random stream ends where GPT(config) leaves it."""
    torch.manual_seed(seed)
    with torch.device('meta'):
        skeleton = GPT(config)  # (on meta nothing is drawn: it gives the modules, their order and shapes)
    leaves = [m for m in skeleton.modules() if hasattr(m, 'reset_parameters') and
              next(m.parameters(), None) is not None and not any(True for _ in m.children())]
    # each parameter by its identity in the skeleton (a tied weight is one, in two modules), before to_empty
    # replaces them: its names, the (module, attribute) pairs that hold it, and the op that writes it last
    names, holder, last_write = {}, {}, {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for i, module in enumerate(leaves):
        for attr, p in module.named_parameters(recurse=False):  # _init_weights redraws Linear, Embedding
            holder[(i, attr)] = id(p)
            last_write[id(p)] = ('init' if isinstance(module, (nn.Linear, nn.Embedding)) else 'construct', i)
    scaled = [(id(p), p.shape) for name, p in skeleton.named_parameters() if name.endswith('c_proj.weight')]
    last_write.update({pid: ('scale', pid) for pid, _ in scaled})

    # one module's parameters at a time, drawn into one scratch buffer (reused: the allocator never fragments)
    scratch = torch.empty(max(sum(p.numel() for p in m.parameters(recurse=False)) for m in leaves))

    def draw_on_cpu(i, draw, op):
        module = leaves[i]
        on_meta, offset = dict(module.named_parameters(recurse=False)), 0
        for attr, p in on_meta.items():
            module._parameters[attr] = nn.Parameter(scratch[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        draw(module)
        for attr in on_meta:
            if last_write[holder[(i, attr)]] == op:
                for name in names[holder[(i, attr)]]:
                    keep(name, module._parameters[attr].detach())
        module._parameters.update(on_meta)  # back to shapes only

    # the constructors' draws (nn.Linear's kaiming_uniform_, nn.Embedding's normal_)
    for i in range(len(leaves)):
        draw_on_cpu(i, lambda module: module.reset_parameters(), ('construct', i))
    for i in range(len(leaves)):  # self.apply(self._init_weights): children before parents, leaves in order
        draw_on_cpu(i, skeleton._init_weights, ('init', i))
    for pid, shape in scaled:  # GPT-2's scaled residual projections
        full = scratch[:math.prod(shape)].view(shape)
        nn.init.normal_(full, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        for name in names[pid]:
            keep(name, full)


def materialize(model, device):
    """Storage on device for a model built on the meta device (the parameters' values still to be written),
    in place: each Parameter stays the same object (what a script holds still points at it; a tied weight
    stays tied). The buffers get theirs: zero (the GPT's are the MoE routers' balancing biases)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # (else to_empty makes new Parameters)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    return zero_buffers(model, device)


@torch.no_grad()
def load_buffers(model, state):
    """The model's buffers from a state dict (a name it lacks: left as it is)."""
    for name, buffer in model.named_buffers():
        if name in state:
            buffer.copy_(state[name])


def zero_buffers(model, device):
    """The model's buffers on device, at their initial value: zero (the MoE routers' balancing biases). For a
    model whose parameters are another's views (zero.py's buckets) and so cannot be to_empty'd."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    return model


@torch.no_grad()
def load_params(named_tensors, keep):
    """A whole model's (name, tensor) pairs (a train.py checkpoint's, or a GPT-2's from open_gpt2) handed to
    keep(name, values) one at a time, as init_params does: a sharded script copies out its share of each."""
    for name, values in named_tensors:
        keep(name, values)


# -----------------------------------------------------------------------------
# Sharded checkpoints back into train.py's: what every script's consolidate(out_dir) shares (consolidate.py
# finds which script wrote out_dir and calls that script's function)

def check_resume_grid(cfg, grid, ckpt_path, then=''):
    """init_from=resume: the saved files must be cut as this run cuts the model (grid: {key: this run's
    value}), else loading them fails deep in load_state_dict. The first file tells (memory-mapped: little is
    read): its 'grid', else its config (a file written before 'grid' was saved). then: what to do after
    consolidating, where the script would still read its rank files."""
    if cfg.init_from != 'resume' or not os.path.exists(ckpt_path):
        return  # (a missing file is init_model's to report, on every rank)
    checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False, mmap=True)
    saved = checkpoint['grid'] if 'grid' in checkpoint else checkpoint['config']
    saved = {k: saved[k] for k in grid if k in saved}
    if saved != {k: grid[k] for k in saved}:
        def as_flags(g):
            ranks = f" on {g['ranks']} ranks" if 'ranks' in g else ''
            return ' '.join(f"--{k}={v}" for k, v in g.items() if k != 'ranks') + ranks
        raise SystemExit(f"error: init_from=resume: {ckpt_path} was saved with {as_flags(saved)}, this run "
                         f"has {as_flags(grid)}: resume with the saved ones, or python consolidate.py "
                         f"{cfg.out_dir} makes one ckpt.pt{then}, which train.py, train_ddp.py, zero.py, "
                         f"train_fsdp.py and context_parallel.py continue from on any number of ranks")


def load_mmap(path):
    """A checkpoint file memory-mapped: a tensor is read from disk when it is used."""
    return torch.load(path, map_location='cpu', weights_only=False, mmap=True)


def rank_path(out_dir, pattern, rank):
    """A rank's own checkpoint file: pattern ('zero_rank{}.pt', 'ckpt_rank{}.pt', ...) with its rank."""
    return os.path.join(out_dir, pattern.format(rank))


def checkpoint_of(state, pieces, files, grid, dp_rank, model_args, iter_num, best_val_loss, cfg):
    """One rank's checkpoint file: what the rank resumes from (state: its own tensors, in its script's form),
    where they sit in the whole model (pieces: pieces_of's, which consolidate.py lays in place), files: the
    world's (pattern, count), the grid it was cut on (a resume on another is refused), this rank's random
    streams (dp_rank: the data-parallel rank whose stream they are, or None for a rank that shares its
    replica's), and train.py's small fields."""
    return {**state, 'pieces': pieces, 'files': files, 'grid': grid, 'rng': rng_state(), 'dp_rank': dp_rank,
            'model_args': model_args, 'iter_num': iter_num, 'best_val_loss': best_val_loss, 'config': cfg}


def buffer_pieces(model, key='model'):
    """pieces_of for the model's buffers (the MoE routers' balancing biases), whole, from the file's key."""
    return [piece for name, buffer in model.named_buffers()
            for piece in pieces_of(name, buffer.shape, {'param': (key, name)})]


def pieces_of(name, shape, paths, boxes=None, chunk=None):
    """Where this rank's part of whole parameter `name` (of shape) sits, for consolidate.py: a list of
    (name, box, flat, rows, paths). paths: where the file keeps the part and its AdamW state ({'param': (key,
    key, ...), 'exp_avg': ..., 'exp_avg_sq': ..., 'step': ...}). The part is the whole parameter, or (boxes,
    tensor parallelism's cut: [(box, first, last)]) its rows first .. last-1 are the whole tensor's box (a
    (start, stop) per dimension). Held as it is, or (chunk=(at, start, end), ZeRO's flat chunk) its flat
    elements at .. at+end-start are elements start .. end of the 1-D tensor the paths name."""
    boxes = boxes or [([(0, n) for n in shape], 0, shape[0])]
    pieces = []
    for box, first, last in boxes:
        per_row = math.prod(stop - start for start, stop in box) // (last - first)
        lo, hi = first * per_row, last * per_row  # the box's elements, in the part's flat order
        if chunk is None:
            pieces.append((name, box, None, (first, last), paths))
            continue
        at, start, end = chunk
        a, b = max(lo, at), min(hi, at + end - start)
        if a < b:
            pieces.append((name, box, (a - lo, b - lo), (start + a - at, start + b - at), paths))
    return pieces
