"""The sans-I/O ggml-RPC framer/validator (hydra_trio.protocol.ggml_rpc): unit and property tests, no sockets."""

from __future__ import annotations

import struct

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.strategies import (
    HELLO_REPLY,
    RPC_BASE,
    RPC_BUFFER,
    RPC_BUFFER_SIZE,
    GgmlRpcMutant,
    RpcStep,
    chunk_cuts,
    ggml_rpc_crashing_graphs,
    ggml_rpc_mutants,
    ggml_rpc_sessions,
    ggml_rpc_silent_openings,
    ggml_rpc_truncated,
    rpc_buffer_steps,
    rpc_tensors,
    split_at,
)
from hydra_trio.protocol import ggml_rpc as g
from hydra_trio.protocol.ggml_rpc import (
    GgmlRpcConnection,
    GgmlRpcError,
    InvalidReply,
    InvalidRpcRequest,
    ReplyData,
    ReplyEnd,
    ReplyHeader,
    Request,
    RequestData,
    RequestEnd,
    RpcCmd,
    RpcTensor,
)
from hydra_trio.protocol.hydra import NEED_DATA as HYDRA_NEED_DATA
from hydra_trio.protocol.hydra import RequestDecoder
from hydra_trio.protocol.need_data import NEED_DATA

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- helpers
def run_session(conn: GgmlRpcConnection, steps: list[RpcStep]) -> tuple[bytes, bytes, list, list]:
    """Feed each request, then its reply; returns (bytes passed on up, down, request events, reply events)."""
    up, down, req_events, rep_events = bytearray(), bytearray(), [], []
    for step in steps:
        for ev in conn.receive_request(step.request):
            req_events.append(ev)
            if not isinstance(ev, RequestEnd):
                up += ev.data
        if step.reply is not None:
            for ev in conn.receive_reply(step.reply):
                rep_events.append(ev)
                if not isinstance(ev, ReplyEnd):
                    down += ev.data
    return bytes(up), bytes(down), req_events, rep_events


def coalesce(events: list) -> list:
    """Events with consecutive data pieces merged, so that differently split inputs compare equal."""
    out: list = []
    for ev in events:
        if isinstance(ev, (RequestData, ReplyData)) and out and type(out[-1]) is type(ev):
            out[-1] = type(ev)(bytes(out[-1].data) + bytes(ev.data))
        elif isinstance(ev, (RequestData, ReplyData)):
            out.append(type(ev)(bytes(ev.data)))
        else:
            out.append(ev)
    return out


def events_of(data_pieces: list[bytes], conn: GgmlRpcConnection | None = None) -> tuple[list, str | None]:
    """Request events for the pieces fed one by one, and the check that stopped them (None: no error)."""
    conn = conn or GgmlRpcConnection()
    out: list = []
    try:
        for piece in data_pieces:
            conn.receive_request_data(piece)
            while (ev := conn.next_request_event()) is not NEED_DATA:
                out.append(ev)
    except InvalidRpcRequest as exc:
        return coalesce(out), exc.check
    return coalesce(out), None


def with_buffer() -> GgmlRpcConnection:
    conn = GgmlRpcConnection()
    run_session(conn, [RpcStep(g.hello_request(), HELLO_REPLY), *rpc_buffer_steps()])
    return conn


def refused(conn: GgmlRpcConnection, data: bytes) -> str:
    with pytest.raises(InvalidRpcRequest) as info:
        conn.receive_request(data)
    return info.value.check


# ---------------------------------------------------------------- tables
def test_type_sizes_come_from_gguf_and_are_checked_against_this_ggml() -> None:
    """gguf.GGML_QUANT_SIZES against the ggml this node runs (ggml_blck_size / ggml_type_size via ctypes)."""
    from hydra_trio.engine.llama.ggml_backend import type_traits
    from hydra_trio.rpc_backend.backend import RpcBackend

    live = type_traits(g.GGML_TYPE_COUNT)
    assert {t for t, (blck, _) in live.items() if blck == 0} == g.REMOVED_TYPES
    table, notes = g.reconcile_type_traits(live)
    assert table == {t: v for t, v in live.items() if v[0] > 0}  # the backend validates with this ggml's sizes
    differ = {t for t, v in g.TYPE_TRAITS.items() if live[t] != v}
    assert len(notes) == len(differ) + len(g.UNDESCRIBED_TYPES)  # every disagreement is reported
    assert {t for t, v in live.items() if v[0] > 0} - set(g.TYPE_TRAITS) == g.UNDESCRIBED_TYPES
    # gguf is the source: it must describe nearly all of this ggml's types, and agree on nearly all
    assert len(differ) + len(g.UNDESCRIBED_TYPES) <= 3, notes
    assert all(g.TYPE_TRAITS[t] == live[t] for t in (0, 1, 2, 3, 8, 10, 12, 14, 30)), notes  # F32..BF16
    assert RpcBackend().type_traits() == table


def test_reconcile_reports_each_difference() -> None:
    live = {t: g.TYPE_TRAITS.get(t, (0, 0)) for t in range(g.GGML_TYPE_COUNT)}
    live[9] = (32, 36)
    live[42] = (64, 18)
    table, notes = g.reconcile_type_traits(live)
    assert table[9] == (32, 36) and table[42] == (64, 18)
    assert any("type 9" in n for n in notes) and any("type 42" in n for n in notes)
    conn = GgmlRpcConnection(type_traits=table)
    conn.receive_request(g.hello_request())
    t = RpcTensor(id=1, type=42, ne=(64, 1, 1, 1), nb=(18, 18, 18, 18))
    conn.receive_request(g.encode_request(RpcCmd.INIT_TENSOR, t.pack()))
    assert (
        refused(GgmlRpcConnection(), g.hello_request() + g.encode_request(RpcCmd.INIT_TENSOR, t.pack()))
        == "tensor_type"
    )


def test_rpc_tensor_layout() -> None:
    assert g.RPC_TENSOR_SIZE == 296  # sizeof(rpc_tensor), packed
    t = RpcTensor(
        id=7,
        type=2,
        buffer=9,
        ne=(32, 2, 1, 1),
        nb=(18, 18, 36, 36),
        op=29,
        src=(1,) + (0,) * 9,
        view_src=3,
        view_offs=4,
        data=5,
        name=b"blk.0.ffn_up_exps.weight",
        use_count=2,
    )
    raw = t.pack()
    assert len(raw) == 296 and RpcTensor.unpack_from(raw) == t
    assert struct.unpack_from("<Q", raw, 0)[0] == 7 and struct.unpack_from("<I", raw, 8)[0] == 2
    assert struct.unpack_from("<Q", raw, 296 - 4 - 64 - 8)[0] == 5  # data just before name[64] and use_count
    assert g.REQUEST_SIZES[RpcCmd.GET_ALLOC_SIZE] == 4 + 11 * 296
    assert g.SET_TENSOR_HEAD_SIZE == 305


def test_nbytes_like_ggml() -> None:
    q = RpcTensor(type=2, ne=(64, 3, 1, 1), nb=(18, 36, 108, 108))
    assert g.tensor_nbytes(q) == 64 * 18 // 32 + 2 * 36
    f = RpcTensor(type=0, ne=(5, 4, 1, 1), nb=(16, 4, 80, 80))  # transposed view
    assert g.tensor_nbytes(f) == 4 + 4 * 16 + 3 * 4
    assert g.tensor_nbytes(attrs.evolve(f, ne=(5, 0, 1, 1))) == 0


# ---------------------------------------------------------------- framing
def test_hello_first_and_once() -> None:
    assert refused(GgmlRpcConnection(), g.encode_request(RpcCmd.DEVICE_COUNT)) == "hello_expected"
    assert refused(GgmlRpcConnection(), g.encode_request(RpcCmd.HELLO, bytes(16))) == "hello_size"
    conn = GgmlRpcConnection()
    conn.receive_request(g.hello_request())
    assert refused(conn, g.hello_request()) == "hello_repeated"
    # after an error the object stays broken
    with pytest.raises(InvalidRpcRequest):
        conn.next_request_event()


def test_hello_caps_are_masked_both_ways() -> None:
    conn = GgmlRpcConnection()
    (req, end) = conn.receive_request(g.hello_request(bytes(range(24))))
    assert req.data == g.hello_request() and end == RequestEnd(RpcCmd.HELLO, 28)
    reply = g.encode_reply(bytes([7, 0, 0, 0]) + b"\xff" * 24)
    (rep, rend) = conn.receive_reply(reply)
    assert rep.data == HELLO_REPLY and rend == ReplyEnd(RpcCmd.HELLO)
    assert conn.hello_answered and conn.between_messages


def test_other_major_version_is_refused() -> None:
    conn = GgmlRpcConnection()
    conn.receive_request(g.hello_request())
    with pytest.raises(InvalidReply, match="speaks ggml-RPC 8"):
        conn.receive_reply(g.encode_reply(bytes([8, 0, 0, 0]) + bytes(24)))


def test_unknown_commands_and_fixed_sizes() -> None:
    for cmd in (18, 19, 200, 255):
        conn = GgmlRpcConnection()
        conn.receive_request(g.hello_request())
        assert refused(conn, g.encode_request(cmd)) == "unknown_command"
    for cmd, size in g.REQUEST_SIZES.items():
        if cmd is RpcCmd.HELLO:
            continue
        conn = with_buffer()
        assert refused(conn, g.encode_request(cmd, bytes(size + 1))) == "size"


def test_size_is_checked_before_the_payload_arrives() -> None:
    conn = with_buffer()
    assert refused(conn, struct.pack("<BQ", RpcCmd.SET_TENSOR, 1 << 40)) == "too_large"
    conn = with_buffer()
    assert refused(conn, struct.pack("<BQ", RpcCmd.GRAPH_COMPUTE, 300 << 20)) == "too_large"
    conn = GgmlRpcConnection(max_message_size=1000)
    conn.receive_request(g.hello_request())
    assert refused(conn, struct.pack("<BQ", RpcCmd.SET_TENSOR, 1001)) == "too_large"


def test_device_index() -> None:
    conn = GgmlRpcConnection(n_devices=1)
    conn.receive_request(g.hello_request())
    conn.receive_request(g.encode_request(RpcCmd.GET_ALIGNMENT, struct.pack("<I", 0)))
    assert refused(conn, g.encode_request(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", 1))) == "device"


# ---------------------------------------------------------------- messages that crash an unguarded server
def test_graph_compute_naming_node_zero_is_refused() -> None:
    """Command 10, size 20, zeros with one node: SIGSEGV in an unguarded server (graph_compute
    accepts node id 0 and computes a NULL node)."""
    conn = with_buffer()
    msg = bytes([10]) + (20).to_bytes(8, "little") + struct.pack("<IIQI", 0, 1, 0, 0)
    assert len(msg) == 29
    with pytest.raises(InvalidRpcRequest, match="node 0 has id 0") as info:
        conn.receive_request(msg)
    assert info.value.check == "graph"


def test_q4_0_tensor_of_one_element_is_refused() -> None:
    """SET_TENSOR of a Q4_0 tensor with ne0 = 1: ggml_nbytes is 0, ggml_backend_tensor_set aborts."""
    conn = with_buffer()
    t = RpcTensor(id=1, type=2, buffer=RPC_BUFFER, ne=(1, 1, 1, 1), nb=(18, 18, 18, 18), data=RPC_BASE)
    with pytest.raises(InvalidRpcRequest, match="not a multiple of the block size 32") as info:
        conn.receive_request(g.encode_set_tensor(t, 0, bytes(18)))
    assert info.value.check == "tensor_shape"


# ---------------------------------------------------------------- tensors and buffers
def test_tensor_data_must_lie_in_its_buffer() -> None:
    t = RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(16, 1, 1, 1), nb=(4, 64, 64, 64), data=RPC_BASE)
    with_buffer().receive_request(g.encode_set_tensor(t, 0, bytes(64)))  # fine
    end = attrs.evolve(t, data=RPC_BASE + RPC_BUFFER_SIZE - 63)
    assert refused(with_buffer(), g.encode_set_tensor(end, 0, bytes(8))) == "tensor_bounds"
    before = attrs.evolve(t, data=RPC_BASE - 4)
    assert refused(with_buffer(), g.encode_set_tensor(before, 0, bytes(8))) == "tensor_bounds"
    assert refused(with_buffer(), g.encode_set_tensor(t, 60, bytes(8))) == "tensor_region"
    assert refused(with_buffer(), g.encode_set_tensor(attrs.evolve(t, buffer=0), 0, bytes(8))) == "tensor_region"


def test_buffer_base_must_be_known_and_freed_buffers_are_forgotten() -> None:
    conn = GgmlRpcConnection()
    steps = [RpcStep(g.hello_request(), HELLO_REPLY), rpc_buffer_steps()[0]]  # no BUFFER_GET_BASE
    run_session(conn, steps)
    t = RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=RPC_BASE)
    assert refused(conn, g.encode_set_tensor(t, 0, bytes(16))) == "tensor_bounds"
    conn = with_buffer()
    conn.receive_request(g.encode_request(RpcCmd.FREE_BUFFER, struct.pack("<Q", RPC_BUFFER)))
    assert RPC_BUFFER not in conn.buffers
    assert refused(conn, g.encode_set_tensor(t, 0, bytes(16))) == "tensor_region"


def test_buffer_named_before_its_alloc_is_answered() -> None:
    conn = GgmlRpcConnection()
    run_session(conn, [RpcStep(g.hello_request(), HELLO_REPLY)])
    conn.receive_request(rpc_buffer_steps()[0].request)  # ALLOC_BUFFER, unanswered
    t = RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=RPC_BASE)
    assert refused(conn, g.encode_request(RpcCmd.INIT_TENSOR, t.pack())) == "tensor_bounds"


def test_a_head_that_passed_is_checked_again_once_the_buffers_change() -> None:
    """The validated-head cache (a COMBINED head repeats its graphs and tensor heads every token)
    gives the verdict a fresh check would: freeing or reallocating a buffer, or an ALLOC_BUFFER
    still unanswered, makes the same bytes pass or fail as they would unchecked before."""
    t = RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(16, 1, 1, 1), nb=(4, 64, 64, 64), data=RPC_BASE)
    set_t = g.encode_set_tensor(t, 0, bytes(64))
    conn = with_buffer()
    for _ in range(2):
        conn.receive_request(set_t)
    assert set_t[: g.HEADER_SIZE + g.SET_TENSOR_HEAD_SIZE] in conn.checked  # remembered: the 2nd was a lookup
    conn.receive_request(g.encode_request(RpcCmd.FREE_BUFFER, struct.pack("<Q", RPC_BUFFER)))
    assert refused(conn, set_t) == "tensor_region"
    # the same buffer handle again, smaller: the graph that passed now reaches outside it
    nodes, ts = _graph()
    graph = g.encode_graph_compute(0, nodes, ts)
    conn = with_buffer()
    conn.receive_request(graph)
    conn.receive_request(g.encode_request(RpcCmd.FREE_BUFFER, struct.pack("<Q", RPC_BUFFER)))
    run_session(conn, rpc_buffer_steps(size=64))
    assert refused(conn, graph) == "tensor_bounds"
    # a tensor in a buffer this connection does not know passes as "no buffer" (deserialize_tensor),
    # unless an ALLOC_BUFFER is unanswered: then it is refused even though it passed before
    leaf = RpcTensor(id=1, type=0, buffer=0xDEAD, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=0)
    init = g.encode_request(RpcCmd.INIT_TENSOR, leaf.pack())
    conn = with_buffer()
    conn.receive_request(init)
    conn.receive_request(init)
    conn.receive_request(rpc_buffer_steps(buffer=0xBEEF)[0].request)  # ALLOC_BUFFER, unanswered
    assert refused(conn, init) == "tensor_bounds"


def test_a_remembered_get_tensor_still_owes_its_reply() -> None:
    t = RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(16, 1, 1, 1), nb=(4, 64, 64, 64), data=RPC_BASE)
    conn = with_buffer()
    for _ in range(3):
        evs = conn.receive_request(g.encode_request(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 8, 24)))
        assert evs[-1] == RequestEnd(RpcCmd.GET_TENSOR, 24)
        assert [type(ev) for ev in conn.receive_reply(g.encode_reply(bytes(24)))] == [ReplyHeader, ReplyEnd]
    with pytest.raises(InvalidReply):
        conn.receive_reply(g.encode_reply(bytes(24)))  # three asked, three answered: nothing is owed


@pytest.mark.parametrize(
    ("change", "check"),
    [
        (dict(type=43), "tensor_type"),
        (dict(type=4), "tensor_type"),  # Q4_2, removed
        (dict(type=2, ne=(31, 1, 1, 1), nb=(18, 18, 18, 18)), "tensor_shape"),
        (dict(ne=(4, 0, 1, 1)), "tensor_shape"),
        (dict(ne=(2**32 - 1, 2**32 - 1, 2**32 - 1, 1), nb=(4, 4, 4, 4)), "tensor_shape"),
        (dict(ne=(4, 2, 1, 1), nb=(4, 0, 32, 32)), "tensor_strides"),
        (dict(type=2, ne=(32, 1, 1, 1), nb=(20, 20, 20, 20)), "tensor_strides"),
        (dict(ne=(2**31, 2**31, 1, 1), nb=(4, 2**32 - 1, 4, 4)), "tensor_bounds"),  # nbytes > INT64_MAX
        (dict(data=2**64 - 8), "tensor_bounds"),  # data + nbytes wraps around
        (dict(data=RPC_BASE + RPC_BUFFER_SIZE), "tensor_bounds"),
    ],
)
def test_tensor_sanity(change: dict, check: str) -> None:
    t = attrs.evolve(
        RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=RPC_BASE), **change
    )
    msg = g.encode_request(RpcCmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, 4))
    assert refused(with_buffer(), msg) == check


def test_empty_tensors_are_fine_in_graphs() -> None:
    """llama.cpp builds zero-row tensors for a ubatch without outputs; ggml skips empty nodes."""
    leaf = RpcTensor(id=1, type=0, buffer=RPC_BUFFER, ne=(8, 0, 1, 1), nb=(4, 32, 0, 0), data=RPC_BASE)
    node = attrs.evolve(leaf, id=2, op=2, src=(1, 1) + (0,) * 8)
    conn = with_buffer()
    evs = conn.receive_request(g.encode_graph_compute(0, [2], [leaf, node]))
    assert isinstance(evs[-1], RequestEnd) and conn.compute_pending


# ---------------------------------------------------------------- graphs
def _graph() -> tuple[list[int], list[RpcTensor]]:
    a = RpcTensor(id=11, type=0, buffer=RPC_BUFFER, ne=(8, 1, 1, 1), nb=(4, 32, 32, 32), data=RPC_BASE)
    b = attrs.evolve(a, id=12, data=RPC_BASE + 32)
    c = attrs.evolve(a, id=13, data=RPC_BASE + 64, op=2, src=(11, 12) + (0,) * 8)
    return [13], [a, b, c]


def test_graph_rules() -> None:
    nodes, ts = _graph()
    with_buffer().receive_request(g.encode_graph_compute(0, nodes, ts))
    assert refused(with_buffer(), g.encode_graph_compute(0, [14], ts)) == "graph"
    assert refused(with_buffer(), g.encode_graph_compute(0, [], ts)) == "graph"
    bad_src = [*ts[:2], attrs.evolve(ts[2], src=(11, 99) + (0,) * 8)]
    assert refused(with_buffer(), g.encode_graph_compute(0, nodes, bad_src)) == "graph"
    bad_view = [*ts[:2], attrs.evolve(ts[2], view_src=98)]
    assert refused(with_buffer(), g.encode_graph_compute(0, nodes, bad_view)) == "graph"
    bad_op = [*ts[:2], attrs.evolve(ts[2], op=101)]
    assert refused(with_buffer(), g.encode_graph_compute(0, nodes, bad_op)) == "graph"
    unbacked = [*ts[:2], attrs.evolve(ts[2], buffer=0, data=0)]
    assert refused(with_buffer(), g.encode_graph_compute(0, nodes, unbacked)) == "graph"
    view = [*ts[:2], attrs.evolve(ts[2], buffer=0, data=0, op=37)]  # a view node computes nothing
    with_buffer().receive_request(g.encode_graph_compute(0, nodes, view))
    msg = bytearray(g.encode_graph_compute(0, nodes, ts))
    struct.pack_into("<I", msg, g.HEADER_SIZE + 8 + 8, 4)  # n_tensors says 4, 3 follow
    assert refused(with_buffer(), bytes(msg)) == "size"


def test_graph_nesting_is_bounded() -> None:
    n = g.MAX_GRAPH_DEPTH + 5
    leaf = RpcTensor(id=1, type=0, ne=(1, 1, 1, 1), nb=(4, 4, 4, 4))
    chain = [leaf] + [attrs.evolve(leaf, id=i + 1, op=37, src=(i,) + (0,) * 9) for i in range(1, n)]
    conn = GgmlRpcConnection()
    conn.receive_request(g.hello_request())
    assert refused(conn, g.encode_graph_compute(0, [n], chain[::-1])) == "graph"
    # the same chain listed in order, nodes first-to-last, nests one level at a time
    conn = GgmlRpcConnection()
    conn.receive_request(g.hello_request())
    conn.receive_request(g.encode_graph_compute(0, list(range(1, n + 1)), chain))


# ---------------------------------------------------------------- replies and boundaries
def test_replies_are_tracked_in_order_and_compute_is_pending_until_read() -> None:
    conn = with_buffer()
    assert conn.between_messages
    nodes, ts = _graph()
    conn.receive_request(g.encode_request(RpcCmd.DEVICE_COUNT))
    conn.receive_request(g.encode_graph_compute(0, nodes, ts))
    get = g.encode_request(RpcCmd.GET_TENSOR, ts[2].pack() + struct.pack("<QQ", 0, 32))
    assert conn.receive_request(get)[-1] == RequestEnd(RpcCmd.GET_TENSOR, 32)
    assert len(conn.pending) == 2 and conn.compute_pending and not conn.between_messages
    conn.receive_reply(g.encode_reply(struct.pack("<I", 1)))  # DEVICE_COUNT, asked before the compute
    assert conn.compute_pending
    assert conn.receive_reply(struct.pack("<Q", 32) + bytes(16)) == []  # half of GET_TENSOR's reply
    assert conn.reply_in_progress and conn.compute_pending
    evs = conn.receive_reply(bytes(16))
    assert evs == [ReplyHeader(RpcCmd.GET_TENSOR, 32, struct.pack("<Q", 32) + bytes(32)), ReplyEnd(RpcCmd.GET_TENSOR)]
    assert not conn.compute_pending and conn.between_messages


def test_unexpected_or_wrong_size_replies() -> None:
    conn = with_buffer()
    with pytest.raises(InvalidReply, match="no reply is owed"):
        conn.receive_reply(b"\0")
    conn = with_buffer()
    conn.receive_request(g.encode_request(RpcCmd.DEVICE_COUNT))
    with pytest.raises(InvalidReply, match="answered 8 bytes, 4 expected"):
        conn.receive_reply(g.encode_reply(bytes(8)))


def test_bulk_data_is_not_copied() -> None:
    conn = with_buffer()
    t = RpcTensor(
        id=1, type=0, buffer=RPC_BUFFER, ne=(65536, 1, 1, 1), nb=(4, 1 << 18, 1 << 18, 1 << 18), data=RPC_BASE
    )
    msg = g.encode_set_tensor(t, 0, bytes(1 << 18))
    head, rest = msg[: g.HEADER_SIZE + 400], msg[g.HEADER_SIZE + 400 :]
    evs = conn.receive_request(head)
    assert [type(e) for e in evs] == [Request, RequestData]
    chunk = bytes(rest)
    (data, end) = conn.receive_request(chunk)
    assert isinstance(data.data, memoryview) and data.data.obj is chunk and len(data.data) == len(chunk)
    assert end == RequestEnd(RpcCmd.SET_TENSOR, None)


# ---------------------------------------------------------------- properties
@FAST
@given(ggml_rpc_sessions())
def test_valid_sessions_round_trip(steps: list[RpcStep]) -> None:
    conn = GgmlRpcConnection()
    up, down, req_events, rep_events = run_session(conn, steps)
    assert up == b"".join(s.request for s in steps)
    assert down == b"".join(s.reply for s in steps if s.reply is not None)
    starts = [(e.cmd, e.size) for e in req_events if isinstance(e, Request)]
    assert starts == [(RpcCmd(s.request[0]), struct.unpack_from("<Q", s.request, 1)[0]) for s in steps]
    ends = [e.cmd for e in rep_events if isinstance(e, ReplyEnd)]
    assert ends == [RpcCmd(s.request[0]) for s in steps if s.reply is not None]
    assert conn.between_messages or conn.compute_pending
    assert not conn.pending and conn.requests == len(steps)


@FAST
@given(ggml_rpc_sessions(max_steps=4), st.data())
def test_splitting_does_not_change_the_events(steps: list[RpcStep], data: st.DataObject) -> None:
    whole = GgmlRpcConnection()
    cut = GgmlRpcConnection()
    for step in steps:
        a = coalesce(whole.receive_request(step.request))
        pieces = split_at(step.request, data.draw(chunk_cuts(len(step.request))))
        b, err = events_of(pieces, cut)
        assert err is None and b == a
        if step.reply is not None:
            ra = coalesce(whole.receive_reply(step.reply))
            rb = []
            for piece in split_at(step.reply, data.draw(chunk_cuts(len(step.reply)))):
                rb += cut.receive_reply(piece)
            assert coalesce(rb) == ra


@FAST
@given(ggml_rpc_mutants(), st.data())
def test_mutants_are_refused_whatever_the_split(m: GgmlRpcMutant, data: st.DataObject) -> None:
    prefix = [RpcStep(g.hello_request(), HELLO_REPLY), *rpc_buffer_steps()]
    msg = m.make(RPC_BUFFER, RPC_BASE)
    conn = GgmlRpcConnection()
    run_session(conn, prefix)
    evs, check = events_of(split_at(msg, data.draw(chunk_cuts(len(msg)))), conn)
    assert check == m.check, (m.kind, evs)
    assert not any(isinstance(e, RequestEnd) for e in evs)  # nothing of it was released whole
    whole = GgmlRpcConnection()
    run_session(whole, prefix)
    assert events_of([msg], whole) == (evs, check)


def passed_on(conn: GgmlRpcConnection, pieces: list[bytes], requests: bool = True) -> tuple[bytes, str | None]:
    """The bytes the pump's path (pass_requests / pass_replies) passes on for ``pieces`` fed one by one,
    and the check (or "reply") that stopped it; the pieces of a feed that raised are not passed on."""
    out = bytearray()
    try:
        for piece in pieces:
            passed = conn.pass_requests(piece) if requests else conn.pass_replies(piece)
            out += b"".join(bytes(p) for p in passed)
    except InvalidRpcRequest as exc:
        return bytes(out), exc.check
    except InvalidReply:
        return bytes(out), "reply"
    return bytes(out), None


@FAST
@given(ggml_rpc_sessions(max_steps=4), st.data())
def test_the_pumps_path_passes_on_what_the_events_do_in_fewer_pieces(steps: list[RpcStep], data: st.DataObject) -> None:
    """pass_requests / pass_replies (the pump's per-message path) against the events, for any split:
    the same bytes, the same state; a feed of whole messages comes out as one slice of the input."""
    events, fast = GgmlRpcConnection(), GgmlRpcConnection()
    for step in steps:
        up, _, _, _ = run_session(events, [RpcStep(step.request, None)])
        cuts = split_at(step.request, data.draw(chunk_cuts(len(step.request))))
        assert passed_on(fast, cuts) == (up, None)
        if step.reply is not None:
            down = b"".join(bytes(ev.data) for ev in events.receive_reply(step.reply) if not isinstance(ev, ReplyEnd))
            assert passed_on(fast, split_at(step.reply, data.draw(chunk_cuts(len(step.reply)))), False) == (down, None)
        assert (fast.requests, fast.replies, len(fast.pending), fast.compute_pending, fast.hello_answered) == (
            events.requests,
            events.replies,
            len(events.pending),
            events.compute_pending,
            events.hello_answered,
        )
        assert fast.buffers == events.buffers and fast.between_messages == events.between_messages
    batch = b"".join(s.request for s in steps if s.reply is None and s.request[0] != RpcCmd.HELLO)
    if batch and not fast.pending:
        pieces = fast.pass_requests(batch)
        assert len(pieces) == 1 and bytes(pieces[0]) == batch  # whole valid messages: the input itself


@FAST
@given(ggml_rpc_mutants(), st.data())
def test_the_pumps_path_refuses_mutants_as_the_events_do(m: GgmlRpcMutant, data: st.DataObject) -> None:
    """A mutant stops the pump's path at the same check, and none of its bytes is passed on, whatever the split."""
    prefix = [RpcStep(g.hello_request(), HELLO_REPLY), *rpc_buffer_steps()]
    msg = m.make(RPC_BUFFER, RPC_BASE)
    conn = GgmlRpcConnection()
    run_session(conn, prefix)
    out, check = passed_on(conn, split_at(msg, data.draw(chunk_cuts(len(msg)))))
    assert check == m.check, m.kind
    whole = GgmlRpcConnection()
    run_session(whole, prefix)
    evs, _ = events_of([msg], whole)
    assert out == b"".join(bytes(e.data) for e in evs if not isinstance(e, RequestEnd))  # what the events release
    assert len(out) < len(msg)
    with pytest.raises(InvalidRpcRequest):  # the error sticks
        conn.pass_requests(b"")


def released_by_events(conn: GgmlRpcConnection, pieces: list[bytes], requests: bool = True) -> tuple[bytes, bool]:
    """The bytes the event path releases for ``pieces`` fed one by one (up to its error), and whether it refused."""
    out = bytearray()
    feed = conn.receive_request_data if requests else conn.receive_reply_data
    nxt = conn.next_request_event if requests else conn.next_reply_event
    try:
        for piece in pieces:
            feed(piece)
            while (ev := nxt()) is not NEED_DATA:
                if not isinstance(ev, (RequestEnd, ReplyEnd)):
                    out += bytes(ev.data)
    except (InvalidRpcRequest, InvalidReply):
        return bytes(out), True
    return bytes(out), False


@FAST
@given(
    ggml_rpc_sessions(max_steps=4),
    st.booleans(),
    st.sampled_from(["flip", "flips", "stray", "cut_stray", "huge"]),
    st.data(),
)
def test_the_pumps_path_never_passes_more_of_damaged_input_than_the_events(
    steps: list[RpcStep], requests: bool, kind: str, data: st.DataObject
) -> None:
    """A valid session whose last request (or reply) is damaged (bytes flipped, stray bytes after it, cut
    short and followed by junk, a huge size field): for any two splits, what the pump's path passes on is
    a prefix of what the events release, and when the events pass all of it, so does the pump's path."""
    events, fast = GgmlRpcConnection(), GgmlRpcConnection()
    last = steps[-1]
    run_session(events, steps[:-1])
    run_session(fast, steps[:-1])
    if not requests:
        run_session(events, [RpcStep(last.request, None)])
        run_session(fast, [RpcStep(last.request, None)])
    wire = bytearray(last.request if requests else last.reply or b"")
    if kind in ("flip", "flips") and wire:
        for _ in range(1 if kind == "flip" else 3):
            wire[data.draw(st.integers(0, len(wire) - 1))] ^= data.draw(st.integers(1, 255))
    elif kind == "stray":
        wire += data.draw(st.binary(min_size=1, max_size=40))
    elif kind == "cut_stray" and wire:
        wire = wire[: data.draw(st.integers(0, len(wire) - 1))] + data.draw(st.binary(min_size=1, max_size=40))
    elif kind == "huge":
        at = data.draw(st.integers(0, len(wire)))
        wire = wire[:at] + (b"\x06" if requests else b"") + (2**64 - 1).to_bytes(8, "little") + bytes(8)
    wire_b = bytes(wire)
    released, refused = released_by_events(events, split_at(wire_b, data.draw(chunk_cuts(len(wire_b)))), requests)
    out, check = passed_on(fast, split_at(wire_b, data.draw(chunk_cuts(len(wire_b)))), requests)
    assert out == released[: len(out)]
    if not refused:
        assert (out, check) == (released, None)


def test_reply_of_the_wrong_size_stops_the_pumps_path() -> None:
    conn = GgmlRpcConnection()
    conn.pass_requests(g.hello_request())
    assert passed_on(conn, [g.encode_reply(bytes(27))], False) == (b"", "reply")
    stray = GgmlRpcConnection()
    assert passed_on(stray, [b"\0" * 8], False) == (b"", "reply")  # nothing owed


def test_low_water_marks_never_ask_for_more_than_the_message_holds() -> None:
    """request_low_water: 9 between messages, the rest of a head being collected, 1 in tensor data;
    reply_low_water: the whole reply owed (capped), 1 when none is."""
    conn = with_buffer()
    assert conn.request_low_water(1 << 18) == 9 and conn.reply_low_water(1 << 18) == 1
    get = g.encode_request(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", 0))
    conn.pass_requests(get[:3])
    assert conn.request_low_water(1 << 18) == 6  # the rest of the header
    conn.pass_requests(get[3:11])
    assert conn.request_low_water(1 << 18) == 2  # the rest of the head
    assert conn.request_low_water(1) == 1
    conn.pass_requests(get[11:])
    assert conn.request_low_water(1 << 18) == 9
    assert conn.reply_low_water(1 << 18) == 8 + 16 and conn.reply_low_water(10) == 10
    reply = g.encode_reply(bytes(16))
    conn.pass_replies(reply[:5])
    assert conn.reply_low_water(1 << 18) == 8 + 16 - 5
    conn.pass_replies(reply[5:])
    assert conn.reply_low_water(1 << 18) == 1


@FAST
@given(ggml_rpc_crashing_graphs())
def test_crashing_graphs_never_get_through(m: GgmlRpcMutant) -> None:
    conn = with_buffer()
    with pytest.raises(InvalidRpcRequest):
        conn.receive_request(m.make(RPC_BUFFER, RPC_BASE))


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=2000), st.binary(max_size=200), st.booleans())
def test_arbitrary_bytes_raise_only_the_modules_errors(request: bytes, reply: bytes, after_hello: bool) -> None:
    conn = GgmlRpcConnection()
    try:
        if after_hello:
            conn.receive_request(g.hello_request())
        conn.receive_request(request)
    except GgmlRpcError:
        pass
    conn2 = with_buffer()
    try:
        conn2.receive_request(request)
    except GgmlRpcError:
        pass
    try:
        conn2.receive_reply(reply)
    except GgmlRpcError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.binary(max_size=4000))
def test_arbitrary_payloads_after_a_valid_header(cmd: int, payload: bytes) -> None:
    conn = with_buffer()
    try:
        conn.receive_request(g.encode_request(cmd, payload))
    except GgmlRpcError:
        pass


@FAST
@given(ggml_rpc_silent_openings())
def test_silent_openings_stay_incomplete(data: bytes) -> None:
    conn = GgmlRpcConnection()
    assert conn.receive_request(data) == []
    assert not conn.hello_sent and conn.request_in_progress


@FAST
@given(ggml_rpc_truncated())
def test_truncated_messages_are_never_released_whole(steps: list[RpcStep]) -> None:
    conn = GgmlRpcConnection()
    run_session(conn, steps[:-1])
    assert conn.between_messages or conn.compute_pending
    evs = conn.receive_request(steps[-1].request)
    assert conn.request_in_progress and not any(isinstance(e, RequestEnd) for e in evs)
    assert sum(len(e.data) for e in evs) <= len(steps[-1].request)


@FAST
@given(rpc_tensors())
def test_generated_tensors_pass(t: RpcTensor) -> None:
    conn = with_buffer()
    conn.receive_request(g.encode_request(RpcCmd.INIT_TENSOR, t.pack()))


def test_both_codecs_are_pull_style_with_one_sentinel() -> None:
    """The ggml-RPC codec reads as the Hydra codec does (and h11): ``receive_*data`` then ``next_*event`` until
    the one :data:`NEED_DATA`; a HELLO fed a byte at a time gives its events once whole."""
    assert HYDRA_NEED_DATA is NEED_DATA
    conn = GgmlRpcConnection()
    assert conn.next_request_event() is NEED_DATA
    hello = g.hello_request()
    events = []
    for i in range(len(hello)):
        conn.receive_request_data(hello[i : i + 1])
        while (ev := conn.next_request_event()) is not NEED_DATA:
            events.append(ev)
        assert conn.next_request_event() is NEED_DATA
    assert isinstance(events[0], Request) and isinstance(events[-1], RequestEnd)
    dec = RequestDecoder(max_payload=1 << 20)
    assert dec.next_event() is NEED_DATA
