"""A request whose engine replica is lost, on the front, without Ray or Serve
(cluster/front/failover.py, router/routing.py): the router never hands out a replica the
front has marked lost, a request waiting for its admission on a lost replica is tried
again at once (and one not routed yet waits on), and a stream moves to another replica
until the client has seen some of its output: a token whose text is held back and a chat's
role chunk are not output. A resumed request that a replica refuses for load is asked
again after its Retry-After."""

from __future__ import annotations

import asyncio
import json
from collections import namedtuple
from types import SimpleNamespace

import pytest
from fastapi.responses import Response
from ray.exceptions import ActorDiedError

from pagedserve.cluster.front import failover
from pagedserve.cluster.front.edge import error
from pagedserve.cluster.front.failover import Resumable, admission, patiently
from pagedserve.cluster.front.openai.openai_format import StreamState
from pagedserve.cluster.front.router import lost_replicas
from pagedserve.cluster.front.router.routing import _SkipsLostReplicas
from pagedserve.cluster.front.sse_stream import sse_events
from pagedserve.cluster.wire.failures import ReplicaLost
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.wire.stream import Admission


def _item(text: str = "", ids=(), finish: str | None = None):
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, list(ids), finish, delta_text=text,
                                                             delta_token_ids=list(ids))], finished=finish is not None)
    return out, {}


class _Stream:
    """An engine stream: its items, then ``end`` (an exception to raise, or None: it ends)."""

    def __init__(self, items, end=None) -> None:
        self.items, self.end, self.cancelled = list(items), end, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.end is not None:
            raise self.end
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def _resumable(first: _Stream, then: _Stream, ids_shown: bool = False):
    placed = []

    async def again():
        return then, Admission(True, "live")

    return Resumable(first, Admission(True, "dead"), again, False, placed.append, ids_shown), placed


async def _read(stream) -> list:
    return [item async for item in stream]


def test_a_stream_moves_while_its_tokens_showed_the_client_nothing():
    # Its first token's text is held back (part of a character): nothing shown, so the
    # replica's loss moves it; the client's output is the new replica's, whole.
    held = _Stream([_item("", [99])], ReplicaLost("dead", "its process is gone"))
    s, placed = _resumable(held, _Stream([_item("ab", [7, 8]), _item("c", [9], "length")]))
    items = asyncio.run(_read(s))
    assert [o.outputs[0].delta_text for o, _ in items] == ["", "ab", "c"]
    assert s.attempts == 2 and [a.replica_id for a in placed] == ["dead", "live"]


@pytest.mark.parametrize("shown, ids_shown", [(_item("x", [5]), False), (_item("", [5]), True)])
def test_a_stream_that_showed_output_ends_with_the_loss(shown, ids_shown):
    # Text, or token ids where the response carries them: the client saw it, it cannot move.
    s, placed = _resumable(_Stream([shown], ReplicaLost("dead", "gone")), _Stream([_item("y", [6], "stop")]),
                           ids_shown)
    with pytest.raises(ReplicaLost, match="dead was lost"):
        asyncio.run(_read(s))
    assert s.attempts == 1 and len(placed) == 1


def test_a_ray_actor_error_before_any_output_is_a_loss_too():
    s, _ = _resumable(_Stream([], ActorDiedError()), _Stream([_item("y", [6], "stop")]))
    assert [o.outputs[0].text for o, _ in asyncio.run(_read(s))] == ["y"]
    s, _ = _resumable(_Stream([_item("x", [5])], ActorDiedError()), _Stream([]))
    with pytest.raises(ReplicaLost, match="dead was lost: its stream failed"):
        asyncio.run(_read(s))


def test_a_chat_stream_sends_its_role_chunk_once_across_the_move():
    held = _Stream([_item("", [99])], ReplicaLost("dead", "gone"))
    s, _ = _resumable(held, _Stream([_item("hi", [7], "stop")]))
    state = StreamState("chat-1", 0, "m", True, False)
    model = SimpleNamespace(observe=lambda out: None, observe_abort=lambda n=1: None)
    live = SimpleNamespace(release=lambda rid: None)

    async def lines():
        return [line async for line in sse_events([s], state, False, model, live)]

    chunks = [json.loads(x[6:]) for x in asyncio.run(lines()) if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert sum("role" in d for d in deltas) == 1
    assert "".join(d.get("content") or "" for d in deltas) == "hi"
    assert not any("error" in c for c in chunks)


def test_a_resumed_request_waits_out_replicas_that_refuse_it_for_load(monkeypatch):
    monkeypatch.setattr(failover, "RETRY_AFTER_CAP_S", 0.01)
    answers = [(None, error(429, "overloaded", 1)), (None, error(503, "unavailable", 1)),
               (_Stream([]), Admission(True, "live"))]

    async def again():
        return answers.pop(0)

    stream, adm = asyncio.run(patiently(again))
    assert stream is not None and adm.replica_id == "live" and not answers
    # Another refusal is the answer at once; load for longer than the patience, the last 429.
    answers[:] = [(None, error(400, "bad")), (_Stream([]), Admission(True, "live"))]
    stream, adm = asyncio.run(patiently(again))
    assert stream is None and adm.status_code == 400
    answers[:] = [(None, error(429, "overloaded", 1))] * 50
    stream, adm = asyncio.run(patiently(again, patience_s=0.05))
    assert stream is None and adm.status_code == 429 and isinstance(adm, Response)


class _Front:
    """The replica client's loss future, renewed at each loss (replica_client.py)."""

    def __init__(self) -> None:
        self.loss = asyncio.get_running_loop().create_future()

    def lose(self, replica_id: str) -> None:
        lost_replicas.mark_lost(replica_id)
        loss, self.loss = self.loss, asyncio.get_running_loop().create_future()
        loss.set_result(replica_id)


class _Pending:
    """A generate stream whose Admission comes when the test says."""

    def __init__(self) -> None:
        self.first = asyncio.get_running_loop().create_future()

    def __aiter__(self):
        return self

    def __anext__(self):
        return self.first


def test_an_admission_on_a_lost_replica_is_given_up_at_once_and_one_not_routed_waits_on():
    async def scenario():
        front = _Front()
        # Routed to the replica that is lost: ReplicaLost at once.
        on_dead = _Pending()
        lost_replicas.routed("req-a", "adm-dead-1")
        waiting = asyncio.ensure_future(admission("req-a", on_dead, lambda: front.loss))
        # Not routed yet when it is lost (the router will not choose it): waits for its own.
        unrouted = _Pending()
        patient = asyncio.ensure_future(admission("req-b", unrouted, lambda: front.loss))
        await asyncio.sleep(0.01)
        front.lose("adm-dead-1")
        with pytest.raises(ReplicaLost, match="adm-dead-1 was lost: while the request waited"):
            await asyncio.wait_for(waiting, 1)
        assert lost_replicas.routed_to("req-a") is None  # forgotten once given up
        await asyncio.sleep(0.1)
        assert not patient.done()
        lost_replicas.routed("req-b", "adm-live-1")
        unrouted.first.set_result(Admission(True, "adm-live-1"))
        assert (await asyncio.wait_for(patient, 1)).replica_id == "adm-live-1"
        # A Ray error instead of the Admission: the routed replica's loss.
        failing = _Pending()
        lost_replicas.routed("req-c", "adm-gone-1")
        failing.first.set_exception(ActorDiedError())
        with pytest.raises(ReplicaLost, match="adm-gone-1 was lost: its stream failed"):
            await admission("req-c", failing, lambda: front.loss)

    asyncio.run(scenario())


ReplicaID = namedtuple("ReplicaID", "unique_id")  # hashable, as Serve's is


class _Router:
    """What _SkipsLostReplicas needs of Serve's router: its replicas and its choice (here,
    the next of ``picks``: Serve's choice made before the drop reached its loop)."""

    def __init__(self, replicas, picks) -> None:
        self._replicas = {r.replica_id: r for r in replicas}
        self.picks, self.retries = list(picks), []

    @property
    def curr_replicas(self):
        return self._replicas

    def on_replica_actor_died(self, replica_id) -> None:
        self._replicas.pop(replica_id, None)

    async def _choose_replica_for_request(self, pending_request, *, is_retry: bool = False):
        self.retries.append(is_retry)
        return self.picks.pop(0)


class _Skipping(_SkipsLostReplicas, _Router):
    pass


def test_the_router_never_hands_out_a_replica_marked_lost():
    dead, live = (SimpleNamespace(replica_id=ReplicaID(u)) for u in ("rt-dead-1", "rt-live-1"))
    router = _Skipping([dead, live], [dead, live])
    req = SimpleNamespace(metadata=SimpleNamespace(call_method="generate"),
                          args=[SimpleNamespace(request_id="rt-req-1")])
    lost_replicas.mark_lost("rt-dead-1")  # on the front's loop; the router's drop not run yet
    assert asyncio.run(router._choose_replica_for_request(req)) is live
    assert router.retries == [False, True]  # routed again, as Serve routes a rejected request
    assert dead.replica_id not in router.curr_replicas  # and dropped there and then
    assert lost_replicas.pop_routed("rt-req-1") == "rt-live-1"  # the front knows where it went
