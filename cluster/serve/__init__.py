"""The Serve/OpenAI front: the Ray Serve application (ingress deployment + one engine
replica per model copy), the FastAPI routes of the OpenAI API, request validation,
response/SSE formatting and Prometheus metrics.

Owns: HTTP in and out, admission (429), abort on disconnect, the engine actor that runs
LLMEngine's step loop on its own thread. May import ray.serve, fastapi, pydantic,
cluster.engine and cluster.control; never imported by engine/ or control/.
"""
