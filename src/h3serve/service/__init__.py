"""The HTTP service: the vLLM-Omni/OpenAI video API over one engine (app.py), its job store (store.py), the GPU worker
and encoder thread (scheduler.py), the readiness render (warmup.py), the host checks before a start (preflight.py),
request mapping and records (schemas.py), auth (security.py), metrics (metrics.py) and the HTTP connection's
request head deadline (http.py)."""
