"""The OpenAI Responses API (/v1/responses), as vLLM serves it: a translation layer over the
chat route, never a second copy of it.

    protocol.py   the request body (validated here) and the response object's shapes;
                  a body becomes one ChatCompletionRequest (input items -> chat messages,
                  tools, tool_choice, text.format -> response_format)
    events.py     a chat answer -> the response object's output items, and the typed
                  stream events (response.created ... response.completed)
    store.py      stored responses (``store``), for GET / DELETE and previous_response_id
    serving.py    OpenAIServingResponses: the route's work, through serving_chat's start
                  and collect (chat template, tokenization, tool parsing, structured outputs)

Imports: what cluster/front may import; cluster.front's chat serving and its openai/ schemas.
"""
