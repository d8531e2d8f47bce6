"""The OpenAI embeddings API (/v1/embeddings), as vLLM serves it, over an engine replica
run by the pooling runner (``--runner pooling``; worker/pooler.py pools the hidden states).

    protocol.py   the request body (validated here), its params (the prompt's truncation and
                  the PoolingParams) and the response's shapes, float or base64
    serving.py    OpenAIServingEmbedding: one engine request per input through the replica
                  client, the vectors back in input order, usage counted

Imports: what cluster/front may import; cluster.front's schemas, replica client and door.
"""
