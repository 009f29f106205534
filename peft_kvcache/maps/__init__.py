"""The map artifact: the typed config of a map (`config`; the options of a fit in `calibration_config`, the records
of how a map was made and measured in `provenance`), `KVMap` itself (tensors + config; `kvmap`) and its folder
(saved, loaded and resolved from the Hub; `storage`), its model card (`card`), the maps of one model's adapters
(`adapter_maps`), and the one function that applies a map to a source cache (`apply`), used by calibration-time
evaluation and inference alike.

Imports `modeling` and the foundation; never the runtime, calibration or serving. The one way up is
`KVMap.calibrate` / `AdapterMaps.calibrate`, which import `peft_kvcache.calibration` when called.
"""
