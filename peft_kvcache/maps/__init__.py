"""The map artifact: the typed config of a map (`config`), `KVMap` itself (tensors + config, saved, loaded and
pushed as a Hub folder; `kvmap`), its model card (`card`), the maps of one model's adapters (`adapter_maps`), and
the one function that applies a map to a source cache (`apply`), used by calibration-time evaluation and inference
alike.

Imports `modeling` and the foundation; never the runtime, calibration or serving. The one way up is
`KVMap.calibrate` / `AdapterMaps.calibrate`, which import `peft_kvcache.calibration` when called.
"""
