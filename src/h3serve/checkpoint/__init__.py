"""Every published checkpoint layout and format, read into `model/`'s architecture: the one safetensors read path
(`safetensors`, through the threaded `reader`), the row reorders (`rows`), the DiT's, VAEs' and text encoder's
layouts (`dit`, `vae`, `text_encoder`), a released model folder (`folder`) and the few-step adapters (`adapters`).
Load-time transforms of other layers (`accel`'s quantizing hooks) come in as `LoadHook` values, never imported."""
