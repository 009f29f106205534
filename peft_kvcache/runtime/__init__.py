"""What runs at a switch: `MappedCache` (a transformers cache built from another model's KV through a map, which
owns its copy, crop and snapshot operations; `cache`), the target's own attention sink in front of it, memoized
(`target_sink`), the refresh of the positions that matter (`refresh`), the
quality bar and per-request check (`check`), and adapter-switching conversations (`sessions`).

Imports `maps`, `modeling` and the foundation; never calibration, serving or `lab`.
"""
