"""Context parallelism: ring attention over torch.distributed (docs/scale-out.md).

Each rank of a process group holds one shard of a long sequence: its queries, keys and values.
The K/V shards travel round the ring (rank r sends to r + 1 and receives from r - 1) with
torch.distributed point-to-point operations — gloo between CPUs, the same code on any backend —
while each rank computes attention of its queries against the shard it holds, the transfer of
the next shard overlapping the computation of this one (double buffering). The partial results
merge exactly by their log-sum-exps (mha's merge_attention), so the output equals attention over
the whole sequence to within rounding.

Causal attention with the sequence cut into contiguous shards leaves rank 0 nearly idle and the
last rank with all the work. The "zigzag" layout (the default) cuts the sequence into
2·world_size chunks and gives rank r chunks r and 2·world_size - 1 - r: then at every step of
the ring each rank computes exactly half a shard-by-shard block, and the ranks finish together.
shard_sequence / unshard_sequence / gather_sequence convert between the full sequence and the
shards of either layout.

The backward (autograd) runs the same ring: K/V travel again, and the gradients dK, dV of each
shard travel with them, collecting every rank's contribution, one step behind the compute so
their transfer overlaps the next block; after a full turn they are back at their owner. Each
rank's block gradients use the merged output and LSE of the forward, which makes them exact.

Semantics: q (B, Hq, T_local, D), k (B, Hkv, T_local, D), v (B, Hkv, T_local, Dv), float32,
Hq a multiple of Hkv (GQA/MQA without copies); every rank's shard has the same shape (else an
mha.Error on every rank); causal masks are over global positions (query i sees key j <= i).
A failed transfer (a rank that died, a timeout) raises mha.Error naming the step and the peer.
"""
import datetime

import torch
import torch.distributed as dist

from . import _arrays as A
from . import _mha

Error = _mha.Error

LAYOUTS = ("zigzag", "contiguous")
_KV_TAG, _GRAD_TAG = 1_000_001, 1_000_002
_TOP_LEFT = 1


def _check_layout(layout, name):
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise Error(f"{name}: layout must be 'zigzag' or 'contiguous'; got {layout!r}")


def _check_group(group, name):
    """None (the world) or a process group this rank belongs to (torch.distributed.new_group's)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise Error(f"{name}: group must be None or a torch.distributed process group this rank is in; "
                    f"got {type(group).__name__} {group!r:.40}")
    return group


def _check_tensor(x, name):
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise Error(f"{name} must be a torch.Tensor with a sequence dimension; got {type(x).__name__} {x!r:.40}")
    return x


def _check_dim(dim, x, name):
    """dim as torch takes it: in [-x.dim(), x.dim() - 1]."""
    return A.check_int(dim, f"{name}: dim", -x.dim(), x.dim() - 1)


def _chunks(length, world_size, layout, name):
    parts = 2 * world_size if layout == "zigzag" else world_size
    if length % parts:
        raise Error(f"{name}: a sequence of {length} tokens does not split into {parts} equal chunks "
                    f"({layout} layout over {world_size} ranks); pad it to a multiple of {parts}")
    return parts


def shard_sequence(x, rank, world_size, layout="zigzag", dim=-2):
    """Rank `rank`'s shard of the full sequence x along `dim`: chunk `rank` of world_size
    ("contiguous"), or chunks rank and 2·world_size - 1 - rank of 2·world_size ("zigzag")."""
    name = "shard_sequence"
    _check_layout(layout, name)
    _check_tensor(x, f"{name}: x")
    dim = _check_dim(dim, x, name)
    world_size = A.check_int(world_size, f"{name}: world_size", 1, 2**31 - 1)
    rank = A.check_int(rank, f"{name}: rank", 0, world_size - 1)
    parts = _chunks(x.shape[dim], world_size, layout, name)
    chunks = x.chunk(parts, dim=dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim=dim)


def unshard_sequence(shards, layout="zigzag", dim=-2):
    """The full sequence from every rank's shard (a list in rank order): the inverse of shard_sequence."""
    name = "unshard_sequence"
    _check_layout(layout, name)
    if not isinstance(shards, (list, tuple)) or not shards:
        raise Error(f"{name}: shards must be a non-empty list of tensors in rank order; got {type(shards).__name__}")
    for r, x in enumerate(shards):
        _check_tensor(x, f"{name}: shards[{r}]")
        if x.dim() != shards[0].dim():
            raise Error(f"{name}: every shard must have the same rank; got {[tuple(s.shape) for s in shards]}")
    dim = _check_dim(dim, shards[0], name)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    world_size = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    if any(s.shape[dim] % 2 for s in shards):
        raise Error(f"{name}: zigzag shards have an even length; got {[s.shape[dim] for s in shards]}")
    ordered = [halves[r][0] for r in range(world_size)] + [halves[r][1] for r in reversed(range(world_size))]
    return torch.cat(ordered, dim=dim)


def gather_sequence(x, group=None, layout="zigzag", dim=-2):
    """Every rank's shard x gathered (all_gather) and unsharded: the full sequence, on every rank."""
    name = "gather_sequence"
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group first")
    _check_group(group, name)
    _check_layout(layout, name)
    _check_dim(dim, _check_tensor(x, f"{name}: x"), name)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, layout, dim)


class _Ring:
    """This rank's place in the ring and the transfers: a send to the next rank and a receive
    from the previous one, both in flight while the caller computes."""

    def __init__(self, group, timeout):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout = timeout
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.size)
        self.prev = to_global((self.rank - 1) % self.size)
        self.prev_local = (self.rank - 1) % self.size

    def start(self, send, recv, tag):
        return (dist.isend(send, self.next, group=self.group, tag=tag),
                dist.irecv(recv, self.prev, group=self.group, tag=tag))

    def wait(self, works, what, step):
        try:
            for w in works:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
        except RuntimeError as e:  # a peer that died, a timeout: gloo's error, with where it happened
            raise Error(f"ring_attention: rank {self.rank} of {self.size}: {what} at ring step {step} "
                        f"(sending to rank {(self.rank + 1) % self.size}, receiving from rank {self.prev_local}) "
                        f"failed: {e}") from None


def _pack(*xs):
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(buf, like):
    out, at = [], 0
    for x in like:
        out.append(buf[at:at + x.numel()].view(x.shape))
        at += x.numel()
    return out


def _travelling_kv(ring, k, v):
    """Yields (step, k shard, v shard) for each ring step: the shard this rank holds then, the next
    one in transit (sent on to the next rank, received from the previous) while the caller computes."""
    cur = _pack(k, v)
    for step in range(ring.size):
        works = ()
        if step < ring.size - 1:
            nxt = torch.empty_like(cur)
            works = ring.start(cur, nxt, _KV_TAG)
        yield (step, *_unpack(cur, (k, v)))
        if works:
            ring.wait(works, "passing K/V on", step)
            cur = nxt


def _blocks(ring, step, Tl, causal, layout):
    """What this rank computes at ring step `step`: (query rows, key rows, causal) as slices of
    its local rows and of the K/V shard it holds, or None when nothing is visible."""
    src = (ring.rank - step) % ring.size
    every = slice(0, Tl)
    if not causal:
        return every, every, False
    if src == ring.rank:
        return every, every, True  # its own shard: causal within it (zigzag: both chunks in order)
    if layout == "contiguous":
        return (every, every, False) if src < ring.rank else None
    half = Tl // 2
    if src < ring.rank:  # both query chunks come after the shard's first chunk, before its second
        return every, slice(0, half), False
    return slice(half, Tl), every, False  # only the second query chunk, after both of its chunks


def _forward(ring, q, k, v, scale, causal, layout, num_threads):
    B, Hq, Tl, _ = q.shape
    out = torch.empty((B, Hq, Tl, v.shape[-1]), dtype=torch.float32)
    lse = torch.empty((B, Hq, Tl), dtype=torch.float32)
    n = A.native
    for step, kc, vc in _travelling_kv(ring, k, v):
        blocks = _blocks(ring, step, Tl, causal, layout)
        if blocks is not None:
            rows, keys, block_causal = blocks
            qb = q[:, :, rows]
            if step == 0:  # its own shard, every row: the first partial result is written in place
                part, part_lse = out, lse
            else:
                part = torch.empty((B, Hq, qb.shape[2], v.shape[-1]), dtype=torch.float32)
                part_lse = torch.empty((B, Hq, qb.shape[2]), dtype=torch.float32)
            _mha.attention(n(qb), n(kc[:, :, keys]), n(vc[:, :, keys]), n(part), lse=n(part_lse), scale=scale,
                           causal=_TOP_LEFT if block_causal else 0, num_threads=num_threads)
            if step > 0:
                _mha.merge_attention(n(out[:, :, rows]), n(lse[:, :, rows]), n(part), n(part_lse), num_threads)
    return out, lse


def _backward(ring, q, k, v, out, lse, dout, scale, causal, layout, num_threads):
    Tl = q.shape[2]
    n = A.native
    dq = torch.empty_like(q)  # written whole at step 0 (every rank's own shard: every row)
    incoming = None  # (works, buffer): the gradient of the shard held now, from the previous rank
    for step, kc, vc in _travelling_kv(ring, k, v):
        grad = torch.zeros(k.numel() + v.numel(), dtype=torch.float32)  # its dK, dV of the shard, packed
        dk_part, dv_part = _unpack(grad, (k, v))
        blocks = _blocks(ring, step, Tl, causal, layout)
        if blocks is not None:
            rows, keys, block_causal = blocks
            dq_block = dq if step == 0 else torch.empty_like(q[:, :, rows])  # step 0 covers every row
            _mha.attention_backward(n(q[:, :, rows]), n(kc[:, :, keys]), n(vc[:, :, keys]), n(out[:, :, rows]),
                                    n(lse[:, :, rows]), n(dout[:, :, rows]), n(dq_block), n(dk_part[:, :, keys]),
                                    n(dv_part[:, :, keys]), scale=scale, causal=_TOP_LEFT if block_causal else 0,
                                    num_threads=num_threads)
            if step > 0:
                dq[:, :, rows] += dq_block
        if ring.size == 1:
            return dq, dk_part, dv_part
        if incoming is not None:  # add this rank's part to what the previous ranks gathered
            ring.wait(incoming[0], "passing dK/dV on", step - 1)
            grad += incoming[1]
        buf = torch.empty_like(grad)
        incoming = (ring.start(grad, buf, _GRAD_TAG), buf)
    ring.wait(incoming[0], "returning dK/dV", ring.size - 1)
    dk, dv = _unpack(incoming[1], (k, v))
    return dq, dk, dv


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, causal, layout, num_threads):
        out, lse = _forward(ring, q, k, v, scale, causal, layout, num_threads)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, scale, causal, layout, num_threads)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():
            raise Error("ring_attention: second-order gradients (create_graph=True) are not supported")
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, causal, layout, num_threads = ctx.args
        dq, dk, dv = _backward(ring, q, k, v, out, lse, dout.contiguous(), scale, causal, layout, num_threads)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q, k, v, group=None, is_causal=False, scale=None, layout="zigzag", *, num_threads=0,
                   timeout=None):
    """Attention of this rank's query shard over the whole sequence, whose K/V shards are spread
    over the ranks of `group` (default: the world); returns this rank's shard of the output
    (B, Hq, T_local, Dv), differentiable with respect to q, k and v.

    is_causal: over global positions, with the shards laid out as `layout` says ("zigzag":
    shard_sequence's default; "contiguous": rank r holds tokens [r·T_local, (r + 1)·T_local)).
    scale: default 1/sqrt(D). num_threads: mha's threads for each block (0: all available; with
    one rank per core, 1). timeout: seconds to wait for a transfer, in [0.001, 10^7] (default:
    the process group's timeout)."""
    name = "ring_attention"
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group first")
    _check_group(group, name)
    _check_layout(layout, name)
    is_causal = A.check_bool(is_causal, f"{name}: is_causal")
    for x, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(x, torch.Tensor):
            raise Error(f"{name}: {what} must be a torch.Tensor; got {type(x).__name__}")
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 4:
            raise Error(f"{name}: {what} must be a 4-D float32 CPU tensor (B, H, T_local, D); got "
                        f"{tuple(x.shape)} {x.dtype} on {x.device}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise Error(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, Hq, T, D), "
                    "(B, Hkv, T, D) and (B, Hkv, T, Dv) shards of the same tokens")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise Error(f"{name}: the query heads ({q.shape[1]}) must be a multiple of the key/value heads ({k.shape[1]})")
    num_threads = A.check_int(num_threads, f"{name}: num_threads", 0, _mha.MAX_THREADS)
    if scale is None:
        scale = 1.0 / float(q.shape[-1]) ** 0.5 if q.shape[-1] else 1.0
    scale = A.check_number(scale, f"{name}: scale")
    if timeout is not None:
        timeout = datetime.timedelta(seconds=A.check_number(timeout, f"{name}: timeout", 1e-3, 1e7))
    ring = _Ring(group, timeout)
    # Every rank checks every rank's shard shape and settings, so a mismatch is an error everywhere
    # (not a hang, nor a silently wrong result). Shapes in float64 are exact below 2^53.
    mine = torch.tensor(list(q.shape) + list(k.shape) + [v.shape[-1], float(is_causal), LAYOUTS.index(layout),
                                                         float(scale)], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(ring.size)]
    try:
        dist.all_gather(gathered, mine, group=group)
    except RuntimeError as e:
        raise Error(f"{name}: rank {ring.rank} of {ring.size}: exchanging shard shapes failed: {e}") from None
    if any(not torch.equal(s[:9], mine[:9]) for s in gathered):
        listed = ", ".join(f"rank {r}: q {tuple(int(x) for x in s[:4])} k {tuple(int(x) for x in s[4:8])}"
                           for r, s in enumerate(gathered))
        raise Error(f"{name}: every rank must hold a shard of the same shape (uneven shards); got {listed}")
    if any(not torch.equal(s[9:], mine[9:]) for s in gathered):
        listed = ", ".join(f"rank {r}: is_causal={bool(s[9])}, layout={LAYOUTS[int(s[10])]!r}, scale={float(s[11])}"
                           for r, s in enumerate(gathered))
        raise Error(f"{name}: every rank must pass the same is_causal, layout and scale; got {listed}")
    if is_causal and layout == "zigzag" and q.shape[2] % 2:
        raise Error(f"{name}: a zigzag shard holds two equal chunks, so its length must be even; got {q.shape[2]}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _RingFunction.apply(q, k, v, ring, scale, is_causal, layout, num_threads)
    with torch.no_grad():
        out, _ = _forward(ring, q, k, v, scale, is_causal, layout, num_threads)
    return out
