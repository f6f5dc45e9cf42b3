"""Few-step adapters (LoRA and full-rank deltas) for the H3 DiT, split by job: `formats` recognises the nine published
file formats, `presets` reads the sampler a file says it was trained for, `read` reads and checks a file against the
DiT (`read_adapter`), `merge` merges into weights (`AdapterMerge` as they load, `merge_into` in place). Which adapters
a server may load for its task type is the admission's rule (`pipeline.admission.check_adapter_kinds`).

The names below are the package's interface; its modules import each other directly, never through here."""

from h3serve.checkpoint.adapters.formats import AdapterError, AdapterFormat
from h3serve.checkpoint.adapters.merge import AdapterMerge, merge_into
from h3serve.checkpoint.adapters.presets import Preset
from h3serve.checkpoint.adapters.read import Adapter, read_adapter

__all__ = ["Adapter", "AdapterError", "AdapterFormat", "AdapterMerge", "Preset", "merge_into", "read_adapter"]
