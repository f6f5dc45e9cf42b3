"""The HTTP service: the vLLM-Omni/OpenAI video API over one engine (app.py), its jobs (jobs.py), request mapping
and records (schemas.py), auth (security.py) and metrics (metrics.py)."""
