"""The HTTP service: the vLLM-Omni/OpenAI video API over one engine (app.py), a request read strictly (bodies.py) and
mapped by its model (schemas.py: VideoCreateRequest, the job record), the job store (store/), the GPU worker and
encoder thread (scheduler.py) moving each job through its states (jobs.py), each job's events (events.py), the
readiness render (warmup.py), the service's folders and start checks (folders.py), auth (security.py), metrics
(metrics.py) and the HTTP connection's request head deadline (http.py)."""
