"""The trainer's side of a protocol push computed where the weights live: one compiled program per push.

`DevicePatcher(model_cfg, dtype).encode(params, full)` takes the policy's params (NNX layout, on the
device) and returns the wire entries of `weight_transfer.ProtocolPusher.push_entries`, one per HF tensor in
the checkpoint's names and layouts. One jitted program does, per parameter and per layer of a stacked one:

1. the cast to the serving dtype and its bit pattern in the HF tensor's element order (the transpose of a
   linear layer's weight, `hf_io.name_table`), kept on the device as the base of the next sparse push;
2. against the last confirmed push's bits (kept on the device too): the changed mask, and its encoding as
   `weight_transfer.ulp_steps` writes it (uint8 gaps and int8 steps of the bit pattern, a gap over 255
   bridged by entries of step 0) for the elements that moved by at most 127 units, and flat int32 indices
   and values for the rest; counts per tensor.

The steps use the bit patterns' difference modulo 2^bits (the server adds a step modulo 2^bits too), so
every changed element whose pattern moved by at most 127 either way is a step. Static shapes: each
tensor's streams have room for a quarter of its elements changed (steps) and a sixteenth moved further
(rest); a tensor over either is sent whole, as `ProtocolPusher` sends one over a quarter changed.

Only the patch crosses to the host: the counts first (one small fetch), then each parameter's streams cut
to their longest tensor's count (rounded up to one of a few sizes, so the cutting programs compile once),
and a whole tensor only where it is sent whole. On XLA:CPU (`compact="host"`, its default there) the scans
and scatters of the compaction are slower than numpy's, so the program ends at one int8 code per element
(the step, -128 for a larger move, 0 unchanged) and the host compacts those (half the bytes of the bf16
model cross). Figures: `device_s` (the program, blocked on), `host_bytes` (bytes fetched), `fetch_s`
(fetch and, on the host, compaction).

Not yet: a sharded base under a multi-host mesh (each host its own shards' patch), and the base's memory
in the plan (one model copy in the serving dtype, on the device).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.models.hf_io import name_table
from cppo_jax.models.transformer import DTYPES
from cppo_jax.rollout.vllm.weight_transfer import gap_steps

__all__ = ["DevicePatcher"]

_BITS = {2: (jnp.uint16, jnp.int16, np.uint16), 4: (jnp.uint32, jnp.int32, np.uint32)}


@dataclasses.dataclass(frozen=True)
class _Param:
    """One NNX parameter as its HF tensors: `names[l]` is layer l's (one name when not stacked)."""

    path: tuple
    names: tuple[str, ...]
    hf_shape: tuple[int, ...]
    n_in: int | None  # a linear weight: the first n_in NNX dims are inputs (transposed in HF)
    stacked: bool

    @property
    def n(self) -> int:
        return math.prod(self.hf_shape)

    @property
    def n_rows(self) -> int:
        return len(self.names)


def _params(model_cfg) -> list[_Param]:
    by_path: dict[tuple, list] = {}
    for e in name_table(model_cfg):
        by_path.setdefault(e.path, []).append(e)
    out = []
    for path, entries in by_path.items():
        entries.sort(key=lambda e: -1 if e.layer is None else e.layer)
        e = entries[0]
        names = tuple(x.hf_name for x in entries)
        out.append(_Param(path, names, e.hf_shape, e.n_in, e.layer is not None))
    return out


def _hf_rows(p: _Param, x, nnx_shape) -> jax.Array:
    """The NNX array `x` as [L, n]: row l is layer l's HF tensor, flattened in HF element order."""
    L = x.shape[0] if p.stacked else 1
    x = x.reshape(L, *nnx_shape)
    if p.n_in:
        x = x.reshape(L, math.prod(nnx_shape[: p.n_in]), -1).transpose(0, 2, 1)
    return x.reshape(L, -1)


def _caps(n: int) -> tuple[int, int]:
    """(step entries, rest elements) a tensor of n elements has room for."""
    return n // 4 + n // 255 + 1, n // 16 + 1


def _encode_row(new_n, old_n, sdt, cap_s: int, cap_r: int):
    """One tensor's patch: (counts [changed, steps, rest], gaps, steps, rest indices, rest bits)."""
    n = new_n.shape[0]
    d_n = jax.lax.bitcast_convert_type(new_n - old_n, sdt)  # modulo 2^bits, as signed
    changed_n = d_n != 0
    small_n = changed_n & (d_n >= -127) & (d_n <= 127)
    big_n = changed_n & ~small_n
    n_small = jnp.sum(small_n, dtype=jnp.int32)
    cap_at = cap_s - n // 255 - 1  # a quarter of the tensor
    (at,) = jnp.nonzero(small_n, size=cap_at, fill_value=n)
    k = jnp.arange(cap_at, dtype=jnp.int32)
    valid = k < n_small
    at = at.astype(jnp.int32)
    gap = at - jnp.concatenate([jnp.full((1,), -1, jnp.int32), at[:-1]])
    fill = jnp.where(valid, (gap - 1) // 255, 0)  # bridging entries before each element
    pos = jnp.where(valid, k + jnp.cumsum(fill), cap_s)
    gaps = (
        jnp.full((cap_s,), 255, jnp.uint8)
        .at[pos]
        .set((gap - 255 * fill).astype(jnp.uint8), mode="drop")
    )
    steps = (
        jnp.zeros((cap_s,), jnp.int8)
        .at[pos]
        .set(d_n[jnp.minimum(at, n - 1)].astype(jnp.int8), mode="drop")
    )
    (rest,) = jnp.nonzero(big_n, size=cap_r, fill_value=0)
    rest = rest.astype(jnp.int32)
    counts = jnp.stack(
        [
            jnp.sum(changed_n, dtype=jnp.int32),
            n_small + jnp.sum(fill),
            jnp.sum(big_n, dtype=jnp.int32),
        ]
    )
    return counts, gaps, steps, rest, new_n[rest]


def _code_row(new_n, old_n, sdt):
    """One tensor's change as int8 codes (the step of the bit pattern where it moved by at most 127,
    -128 where it moved further, 0 where unchanged) and counts [changed, steps, rest]: elementwise, no
    scan, for a device that compacts slower than the host (XLA:CPU)."""
    d_n = jax.lax.bitcast_convert_type(new_n - old_n, sdt)
    small_n = (d_n >= -127) & (d_n <= 127)
    code_n = jax.lax.optimization_barrier(jnp.where(small_n, d_n, -128).astype(jnp.int8))
    changed = jnp.sum(code_n != 0, dtype=jnp.int32)
    big = jnp.sum(code_n == -128, dtype=jnp.int32)
    return jnp.stack([changed, changed - big, big]), code_n


@jax.jit
def _take(x, idx):
    return x.reshape(-1)[idx]


def _bucket(k: int) -> int:
    """k rounded up to a multiple of 1/8 of its power of two (at most 12.5 % more; few sizes)."""
    if k <= 64:
        return 64
    step = 1 << (k.bit_length() - 4)
    return -(-k // step) * step


@functools.partial(jax.jit, static_argnums=1)
def _prefix(x, k: int):
    return x[:, :k]


@jax.jit
def _row(x, i):
    return x[i]


class DevicePatcher:
    """Encodes pushes of one model on the device (see the module docstring); holds the bits of the last
    confirmed push there (`confirm()` after the server's check passed, `invalidate()` after a failure)."""

    def __init__(self, model_cfg, dtype: str, compact: str | None = None):
        # Where the changed elements are compacted: "device" (the whole encoding in the program), or
        # "host" (the program gives int8 codes per element, compacted by numpy): XLA:CPU's scans and
        # scatters are slower than numpy's (cumsum of 50M elements 2.2 s, numpy's flatnonzero 0.1 s)
        self.compact = compact or ("host" if jax.default_backend() == "cpu" else "device")
        self.dtype = np.dtype(DTYPES[dtype])
        self.udt, self.sdt, self.np_udt = _BITS[self.dtype.itemsize]
        self.params = _params(model_cfg)
        self.base = None  # {path: [L, n] bits} of the last confirmed push
        self._pending = None
        self._bits = jax.jit(self._bits_fn)
        self._patch = jax.jit(self._patch_fn)
        self._nnx_shapes = None

    # -- the programs ------------------------------------------------------------------------

    def _bits_fn(self, flat: dict):
        out = {}
        for p in self.params:
            x = flat[p.path].astype(self.dtype)
            rows = _hf_rows(p, x, self._nnx_shapes[p.path])
            out[p.path] = jax.lax.bitcast_convert_type(rows, self.udt)
        return out

    def _patch_fn(self, flat: dict, base: dict):
        # materialized once: else each use below would redo the cast and the strided transpose
        new = jax.lax.optimization_barrier(self._bits_fn(flat))
        patches = {}
        for p in self.params:
            cap_s, cap_r = _caps(p.n)
            if self.compact == "host":
                enc = jax.vmap(lambda a, b: _code_row(a, b, self.sdt))
            else:
                enc = jax.vmap(lambda a, b, cs=cap_s, cr=cap_r: _encode_row(a, b, self.sdt, cs, cr))
            patches[p.path] = enc(new[p.path], base[p.path])
        return new, patches

    # -- one push ----------------------------------------------------------------------------

    def _flat(self, params) -> dict:
        flat = {path: var.get_value() for path, var in nnx.to_flat_state(params)}
        if self._nnx_shapes is None:
            self._nnx_shapes = {}
            for p in self.params:
                shape = flat[p.path].shape
                self._nnx_shapes[p.path] = shape[1:] if p.stacked else shape
        return {p.path: flat[p.path] for p in self.params}

    def encode(self, params, full: bool) -> tuple[list[tuple], dict]:
        """The wire entries of one push of `params` (the NNX param state), full or sparse against the
        last confirmed push, and its figures (`device_s`, `host_bytes`, `fetch_s`, `changed`, `total`).
        An entry is (name, dtype, shape, values) for a whole tensor, or (name, dtype, shape, values,
        rest indices, gaps, steps) for a patch (`ProtocolPusher.push_entries`)."""
        flat = self._flat(params)
        sparse = not full and self.base is not None
        t0 = time.perf_counter()
        if sparse:
            new, patches = self._patch(flat, self.base)
        else:
            new, patches = self._bits(flat), None
        jax.block_until_ready((new, patches))
        t1 = time.perf_counter()
        fetched = 0

        def get(x):
            nonlocal fetched
            out = jax.tree.map(np.asarray, jax.device_get(x))
            fetched += sum(a.nbytes for a in jax.tree.leaves(out))
            return out

        entries, changed, total = [], 0, 0
        counts = get({k: v[0] for k, v in patches.items()}) if sparse else None
        for p in self.params:
            L = len(p.names)
            total += L * p.n
            whole = list(range(L))
            if sparse:
                c = counts[p.path]  # [L, 3]: changed, step entries, rest
                changed += int(c[:, 0].sum())
                cap_s, cap_r = _caps(p.n)
                ok = (4 * c[:, 0] <= p.n) & (c[:, 1] < cap_s) & (c[:, 2] < cap_r)
                s_max = c[:, 1] + (p.n // 255 if self.compact == "host" else 0)  # bridging
                ok &= 2 * s_max + c[:, 2] * (4 + self.dtype.itemsize) < p.n * self.dtype.itemsize
                whole = [i for i in range(L) if not ok[i]]
                rows = [i for i in range(L) if ok[i]]
                if rows and self.compact == "host":
                    entries += self._from_codes(p, rows, patches[p.path][1], new[p.path], get)
                elif rows:
                    _, gaps, steps, rest, vals = patches[p.path]
                    ks, kr = _bucket(int(c[rows, 1].max())), _bucket(int(c[rows, 2].max()))
                    gaps, steps = (
                        get(_prefix(gaps, min(ks, cap_s))),
                        get(_prefix(steps, min(ks, cap_s))),
                    )
                    rest, vals = (
                        get(_prefix(rest, min(kr, cap_r))),
                        get(_prefix(vals, min(kr, cap_r))),
                    )
                    for i in rows:
                        s, r = int(c[i, 1]), int(c[i, 2])
                        entries.append(
                            (
                                p.names[i],
                                self.dtype,
                                p.hf_shape,
                                vals[i, :r].view(self.dtype),
                                rest[i, :r],
                                gaps[i, :s],
                                steps[i, :s],
                            )
                        )
            else:
                changed += L * p.n
            for i in whole:
                bits = get(_row(new[p.path], i)) if L > 1 else get(new[p.path][0])
                entries.append((p.names[i], self.dtype, p.hf_shape, bits.view(self.dtype)))
        self._pending = new
        return entries, {
            "device_s": t1 - t0,
            "fetch_s": time.perf_counter() - t1,
            "host_bytes": float(fetched),
            "changed": changed,
            "total": total,
        }

    def _from_codes(self, p: _Param, rows: list[int], codes, bits, get) -> list[tuple]:
        """Patch entries of `p`'s tensors `rows` from the device's int8 codes, compacted here; the
        values of the elements that moved further than a step are gathered on the device."""
        codes_LN = get(codes if len(rows) == p.n_rows else codes[np.asarray(rows)])
        found = []
        for j, i in enumerate(rows):
            code = codes_LN[j]
            idx = np.flatnonzero(code).astype(np.int32)
            c = code[idx]
            small = c != -128
            found.append((i, idx[~small], *gap_steps(idx[small], c[small])))
        flat = np.concatenate([i * p.n + rest.astype(np.int64) for i, rest, *_ in found])
        k = _bucket(flat.size)
        vals = get(_take(bits, np.pad(flat, (0, k - flat.size)).astype(np.int32)))[: flat.size]
        out, at = [], 0
        for i, rest, gaps, steps in found:
            v = vals[at : at + rest.size].view(self.dtype)
            at += rest.size
            out.append((p.names[i], self.dtype, p.hf_shape, v, rest, gaps, steps))
        return out

    def confirm(self) -> None:
        """The last encoded push was checked on the server: its bits are the next sparse base."""
        if self._pending is not None:
            self.base, self._pending = self._pending, None

    def invalidate(self) -> None:
        self.base, self._pending = None, None
