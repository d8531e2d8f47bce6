"""The OpenAI API's shapes at the front: the request schemas (one validation), the response
and SSE chunk writers, tool choice and the tool-call parsers. No Serve, no replica calls."""
