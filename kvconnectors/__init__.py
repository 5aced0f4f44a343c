"""Code that runs inside vLLM, not in kvroute: KV connectors named by `kv_connector_module_path`.

Importable only where vLLM is (the stack venv); `kvroute stack up` puts a copy of this package on every
instance's PYTHONPATH. Nothing here imports the rest of the project.
"""
