"""Where a request goes: Serve's request routers over the engine replicas (the KV router,
Ray's prefix router for comparison), the KV-event tables they read, the replicas known
lost, and the routing counts /metrics reports."""
