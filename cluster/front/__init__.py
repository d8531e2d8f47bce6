"""The HTTP front: the Ray Serve ingress deployment and what it owns.

    ingress.py            the FastAPI routes of the OpenAI API (chat, completions, models,
                          tokenize, health, metrics, request status), each handed to one of:
    serving_completion.py /v1/completions: one engine request per prompt, echo
    serving_chat.py       /v1/chat/completions and its batch form
    beam_search.py        ``use_beam_search``: a loop of one-token engine requests
    responses/            /v1/responses (OpenAI's Responses API): a body as a chat request,
                          its answer as a response object or typed events; stored responses
    replica_client.py     the connection to the engine replicas: output channel, lifelines,
                          failover, the door's checks; /health through it
    served_model.py       the replicas' info (404 for another model name), the front's metrics
    sse_stream.py         a streamed response's body: chunks, in-band errors, usage, [DONE]
    merged_streams.py     a batch's engine streams read as one, the unfinished cancelled
    schemas.py            request bodies (validated here) and response shapes
    openai_format.py      RequestOutput -> OpenAI responses and SSE chunks
    tool_choice.py        what ``tools`` / ``tool_choice`` ask of the engine
    tool_parsers.py       tool calls out of the model's text
    door.py               the shed gate (429 at the door) and the live-request list
    failover.py           a request whose replica is lost: tried again, or an in-band 503
    routing.py            Serve's request router minus the replicas this front saw die
    lost_replicas.py      which replicas this process saw die, and where requests were routed
    edge.py               body size, auth, OpenAI's error JSON for every error
    tenants.py            API keys -> tenants
    metrics.py            /metrics (vLLM's names), the stats aggregator

Imports: ray.serve, fastapi, pydantic, cluster.wire (the types it shares with the
replica), cluster.ray_utils, scheduler/ (sampling params); never the replica, the engine
loop, the executors or the CLI.
"""
